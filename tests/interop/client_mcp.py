"""The real OpenEnv 0.10.0 MCP clients against an echo environment with the tools
`echo_message` and `echo_with_length`: agentstack's `echo` under BASE_URL/echo, or,
with ENV_PATH `/`, any such server at the root (e.g. the reference MCP echo package
behind `agentstack env serve <dir>`'s proxy).

    python client_mcp.py http://127.0.0.1:PORT [ENV_PATH]

- `MCPToolClient` (production mode, the default): `POST /mcp openenv/session/create`,
  `WS /ws?session_id=...`, then `tools/list` and `tools/call` over `POST /mcp` with
  that session id, and `openenv/session/close` at the end.
- `GenericEnvClient` stepping the MCP actions `{"type": "list_tools"}` and
  `{"type": "call_tool", ...}` over `/ws` (simulation mode).
- The JSON-RPC that MCPToolClient relies on but hides (it swallows `tools/list` and
  `openenv/session/close` errors), checked on the wire with httpx, the HTTP client
  the peer itself uses.
"""

import asyncio

import httpx
from expect import (
    CONNECT_TIMEOUT_S,
    MESSAGE_TIMEOUT_S,
    CheckFailed,
    check,
    check_eq,
    check_peer,
    main,
    section,
)
from openenv.core.generic_client import GenericEnvClient
from openenv.core.mcp_client import MCPToolClient

TOOLS = {"echo_message", "echo_with_length"}

# JSON-RPC error codes the reference server answers with.
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602  # also an unknown session_id
INTERNAL_ERROR = -32603  # also an unknown tool


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
    check(
        TOOLS <= names,
        f"{what}: lists {sorted(TOOLS)} (empty means tools/list failed)",
        sorted(names),
    )
    for tool in tools:
        if tool.name not in TOOLS:
            continue
        schema = tool.input_schema or {}
        check(bool(tool.description), f"{what}: {tool.name} has a description", tool.description)
        check_eq(schema.get("type"), "object", f"{what}: {tool.name} input_schema.type")
        check(
            "message" in (schema.get("properties") or {}),
            f"{what}: {tool.name} input_schema has a `message` property",
            schema,
        )


async def tool_client_async(url: str) -> None:
    section("MCPToolClient, async (HTTP /mcp + /ws?session_id)")
    async with mcp_client(url) as env:
        session_id = env._production_session_id
        check(bool(session_id), "openenv/session/create returned a session id", session_id)
        reset = await env.reset(episode_id="interop-mcp")
        check_eq(reset.done, False, "reset over the attached /ws: done")
        check_tools(await env.list_tools(use_cache=False), "list_tools")
        check_eq(
            await env.call_tool("echo_message", message="hi"),
            "hi",
            'call_tool("echo_message", message="hi")',
        )
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
                check(
                    str(e).startswith(f"Tool '{name}' failed:"),
                    f"call_tool with {what} raises RuntimeError",
                    str(e),
                )
            else:
                raise CheckFailed(
                    f"call_tool with {what} should raise RuntimeError\n        got: {result!r}"
                )
        state = await env.state()
        check_eq(state.episode_id, "interop-mcp", "state over the attached /ws: episode_id")


def tool_client_sync(url: str) -> None:
    section("MCPToolClient(...).sync()")
    with mcp_client(url).sync() as env:
        env.reset()
        check_tools(env.list_tools(), "list_tools")
        check_eq(
            env.call_tool("echo_message", message="sync"),
            "sync",
            'call_tool("echo_message", message="sync")',
        )


def call_tool(tool_name: str, **arguments) -> dict:
    return {"type": "call_tool", "tool_name": tool_name, "arguments": arguments}


def generic_steps(url: str) -> None:
    section("GenericEnvClient stepping MCP actions over /ws")
    client = GenericEnvClient(
        base_url=url,
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

        obs = env.step(call_tool("echo_message", message="x")).observation
        check_eq(obs.get("tool_name"), "echo_message", "step call_tool: observation.tool_name")
        check_eq(obs.get("error"), None, "step call_tool: observation.error")
        result = obs.get("result")
        check(isinstance(result, dict), "step call_tool: observation.result is an object", result)
        check_eq(result.get("data"), "x", "step call_tool: observation.result.data")

        obs = env.step(call_tool("echo_with_length", message="four")).observation
        check_eq(
            (obs.get("result") or {}).get("data"),
            {"message": "four", "length": 4},
            "step call_tool echo_with_length: observation.result.data",
        )

        error = env.step(call_tool("shout")).observation.get("error") or {}
        check_eq(
            error.get("error_type"),
            "tool_not_found",
            "step call_tool shout: observation.error.error_type",
        )
        check(bool(error.get("message")), "step call_tool shout: observation.error.message", error)


def jsonrpc_on_the_wire(url: str) -> None:
    section("POST /mcp JSON-RPC, raw (what MCPToolClient sends)")
    mcp_url = f"{url}/mcp"
    ids = iter(range(1, 1000))

    with httpx.Client(timeout=MESSAGE_TIMEOUT_S) as http:

        def rpc(method: str, params: dict) -> dict:
            request_id = next(ids)
            request = {"jsonrpc": "2.0", "method": method, "params": params, "id": request_id}
            response = http.post(mcp_url, json=request)
            check_eq(response.status_code, 200, f"{method}: HTTP status")
            body = response.json()
            check_eq(
                (body.get("jsonrpc"), body.get("id")),
                ("2.0", request_id),
                f"{method}: jsonrpc and id echoed",
            )
            return body

        def error_code(body: dict) -> object:
            return (body.get("error") or {}).get("code")

        created = rpc("openenv/session/create", {})
        session_id = (created.get("result") or {}).get("session_id")
        check(
            isinstance(session_id, str) and session_id,
            "openenv/session/create: result.session_id",
            created,
        )

        listed = rpc("tools/list", {"session_id": session_id})
        tools = (listed.get("result") or {}).get("tools") or []
        check(TOOLS <= {t.get("name") for t in tools}, f"tools/list: lists {sorted(TOOLS)}", listed)
        for tool in tools:
            check(
                isinstance(tool.get("inputSchema"), dict),
                f"tools/list: {tool.get('name')} has camelCase inputSchema (as the reference)",
                tool,
            )

        arguments = {"message": "abc"}
        called = rpc(
            "tools/call",
            {"name": "echo_with_length", "arguments": arguments, "session_id": session_id},
        )
        result = called.get("result") or {}
        check_eq(result.get("data"), {"message": "abc", "length": 3}, "tools/call: result.data")
        check_eq(result.get("is_error"), False, "tools/call: result.is_error (snake_case)")
        check(
            isinstance(result.get("content"), list) and result["content"],
            "tools/call: result.content is a non-empty list",
            result,
        )
        unknown = rpc("tools/call", {"name": "shout", "arguments": {}, "session_id": session_id})
        check_eq(error_code(unknown), INTERNAL_ERROR, "tools/call of an unknown tool: error.code")

        closed = rpc("openenv/session/close", {"session_id": session_id})
        check_eq((closed.get("result") or {}).get("closed"), True, "openenv/session/close: result.closed")
        after = rpc("tools/list", {"session_id": session_id})
        check_eq(error_code(after), INVALID_PARAMS, "tools/list on the closed session: error.code")
        check_eq(error_code(rpc("no/such/method", {})), METHOD_NOT_FOUND, "an unknown method: error.code")

        empty = http.post(mcp_url, json={})
        check_eq(empty.status_code, 200, "POST /mcp {}: HTTP status (openenv validate's mcp_endpoint)")
        body = empty.json()
        check_eq(
            (body.get("jsonrpc"), error_code(body)),
            ("2.0", INVALID_REQUEST),
            "POST /mcp {}: jsonrpc and error.code",
        )


def run(base: str, env_path: str = "/echo") -> None:
    check_peer("openenv", "0.10.0")
    url = base + env_path.rstrip("/")
    asyncio.run(tool_client_async(url))
    tool_client_sync(url)
    generic_steps(url)
    jsonrpc_on_the_wire(url)


if __name__ == "__main__":
    main(run, optional=("ENV_PATH",))
