"""The real OpenEnv 0.10.0 MCP clients against agentstack's `echo`, served under
BASE_URL/echo.

    python client_mcp.py http://127.0.0.1:PORT

- `MCPToolClient` (production mode, the default): `POST /mcp openenv/session/create`,
  `WS /ws?session_id=...`, then `tools/list` and `tools/call` over `POST /mcp` with
  that session id, and `openenv/session/close` at the end.
- `GenericEnvClient` stepping the MCP actions `{"type": "list_tools"}` and
  `{"type": "call_tool", ...}` over `/ws` (simulation mode).
"""

from expect import (
    CONNECT_TIMEOUT_S,
    MESSAGE_TIMEOUT_S,
    CheckFailed,
    check,
    check_eq,
    main,
    section,
)
from openenv.core.generic_client import GenericEnvClient
from openenv.core.mcp_client import MCPToolClient

TOOLS = {"echo_message", "echo_with_length"}


def mcp_client(url: str) -> MCPToolClient:
    return MCPToolClient(
        base_url=url,
        connect_timeout_s=CONNECT_TIMEOUT_S,
        message_timeout_s=MESSAGE_TIMEOUT_S,
    )


def check_tools(tools, what: str) -> None:
    # MCPToolClient.list_tools swallows transport and JSON-RPC errors and returns [];
    # an empty list therefore means `tools/list` failed on the wire.
    names = {t.name for t in tools}
    check(TOOLS <= names, f"{what}: lists {sorted(TOOLS)} (empty means tools/list failed)", sorted(names))
    for tool in tools:
        if tool.name in TOOLS:
            schema = tool.input_schema or {}
            check(bool(tool.description), f"{what}: {tool.name} has a description", tool.description)
            check_eq(schema.get("type"), "object", f"{what}: {tool.name} input_schema.type")
            check(
                "message" in (schema.get("properties") or {}),
                f"{what}: {tool.name} input_schema has a `message` property",
                schema,
            )


async def tool_client_async(base: str) -> None:
    section("MCPToolClient, async (HTTP /mcp + /ws?session_id)")
    async with mcp_client(f"{base}/echo") as env:
        check(bool(env._production_session_id), "openenv/session/create returned a session id", env._production_session_id)
        reset = await env.reset(episode_id="interop-mcp")
        check_eq(reset.done, False, "reset over the attached /ws: done")
        check_tools(await env.list_tools(use_cache=False), "list_tools")
        check_eq(await env.call_tool("echo_message", message="hi"), "hi", 'call_tool("echo_message", message="hi")')
        check_eq(
            await env.call_tool("echo_with_length", message="hello"),
            {"message": "hello", "length": 5},
            'call_tool("echo_with_length", message="hello")',
        )
        check(await env.has_tool("echo_message"), "has_tool('echo_message')")
        check(not await env.has_tool("shout"), "not has_tool('shout')")
        for what, name, kwargs in [
            ("an unknown tool", "shout", {"message": "x"}),
            ("a missing argument", "echo_message", {}),
        ]:
            try:
                result = await env.call_tool(name, **kwargs)
            except RuntimeError as e:
                check(str(e).startswith(f"Tool '{name}' failed:"), f"call_tool with {what} raises RuntimeError", str(e))
            else:
                raise CheckFailed(f"call_tool with {what} should raise RuntimeError\n        got: {result!r}")
        state = await env.state()
        check_eq(state.episode_id, "interop-mcp", "state over the attached /ws: episode_id")


def tool_client_sync(base: str) -> None:
    section("MCPToolClient(...).sync()")
    with mcp_client(f"{base}/echo").sync() as env:
        env.reset()
        check_tools(env.list_tools(), "list_tools")
        check_eq(env.call_tool("echo_message", message="sync"), "sync", 'call_tool("echo_message", message="sync")')


def generic_steps(base: str) -> None:
    section("GenericEnvClient stepping MCP actions over /ws")
    client = GenericEnvClient(
        base_url=f"{base}/echo",
        connect_timeout_s=CONNECT_TIMEOUT_S,
        message_timeout_s=MESSAGE_TIMEOUT_S,
    )
    with client.sync() as env:
        env.reset()
        listed = env.step({"type": "list_tools"})
        tools = listed.observation.get("tools")
        check(isinstance(tools, list), "step list_tools: observation.tools is a list", listed.observation)
        names = {t.get("name") for t in tools}
        check(TOOLS <= names, f"step list_tools: lists {sorted(TOOLS)}", sorted(names))
        for tool in tools:
            check(
                isinstance(tool.get("input_schema"), dict),
                f"step list_tools: {tool.get('name')} has input_schema (snake_case on this path)",
                tool,
            )
        check_eq(listed.done, False, "step list_tools: done")

        called = env.step({"type": "call_tool", "tool_name": "echo_message", "arguments": {"message": "x"}})
        obs = called.observation
        check_eq(obs.get("tool_name"), "echo_message", "step call_tool: observation.tool_name")
        check_eq(obs.get("error"), None, "step call_tool: observation.error")
        result = obs.get("result")
        check(isinstance(result, dict), "step call_tool: observation.result is an object", result)
        check_eq(result.get("data"), "x", "step call_tool: observation.result.data")

        called = env.step(
            {"type": "call_tool", "tool_name": "echo_with_length", "arguments": {"message": "four"}}
        )
        check_eq(
            (called.observation.get("result") or {}).get("data"),
            {"message": "four", "length": 4},
            "step call_tool echo_with_length: observation.result.data",
        )

        missing = env.step({"type": "call_tool", "tool_name": "shout", "arguments": {}})
        error = missing.observation.get("error") or {}
        check_eq(error.get("error_type"), "tool_not_found", "step call_tool shout: observation.error.error_type")
        check(bool(error.get("message")), "step call_tool shout: observation.error.message", error)


def run(base: str) -> None:
    import asyncio

    asyncio.run(tool_client_async(base))
    tool_client_sync(base)
    generic_steps(base)


if __name__ == "__main__":
    main(run)
