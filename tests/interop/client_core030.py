"""The legacy `openenv-core` 0.3.0 clients against agentstack's `echo`, served under
BASE_URL/echo. Run with the 0.3.0 venv's python.

    python client_core030.py http://127.0.0.1:PORT

0.3.0 clients are async-first (`.sync()` wraps them) and speak only WebSocket `/ws`:
`MCPToolClient` 0.3.0 never uses HTTP `/mcp` (its production flag is always off), so
it lists and calls tools with `step({"type": "list_tools"})` and
`step({"type": "call_tool", ...})`. 0.3.0 has no top-level `metadata` in results.
"""

import asyncio

from expect import (
    CONNECT_TIMEOUT_S,
    MESSAGE_TIMEOUT_S,
    CheckFailed,
    check,
    check_eq,
    check_peer,
    check_reward,
    check_server_error,
    check_server_error_async,
    main,
    section,
)
from openenv.core.generic_client import GenericEnvClient
from openenv.core.mcp_client import MCPToolClient
from openenv.core.env_server.mcp_types import (
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
    ListToolsObservation,
)

TOOLS = {"echo_message", "echo_with_length"}

# echo's reward: 0.1 per character, capped at 1.
REWARD_PER_CHAR = 0.1


async def generic_async(base: str) -> None:
    section("GenericEnvClient 0.3.0, async")
    client = GenericEnvClient(
        base_url=f"{base}/echo",
        connect_timeout_s=CONNECT_TIMEOUT_S,
        message_timeout_s=MESSAGE_TIMEOUT_S,
    )
    async with client as env:
        reset = await env.reset(seed=7, episode_id="interop-030")
        check(isinstance(reset.observation, dict), "reset: observation is an object", reset.observation)
        check_eq(reset.done, False, "reset: done")
        step = await env.step({"message": "hello"})
        check_eq(step.observation.get("echoed_message"), "hello", "step hello: observation.echoed_message")
        check_eq(step.observation.get("message_length"), 5, "step hello: observation.message_length")
        check_reward(step.reward, 5 * REWARD_PER_CHAR, "step hello: reward")
        check_eq(step.done, False, "step hello: done")
        state = await env.state()
        check_eq(state.get("episode_id"), "interop-030", "state.episode_id")
        check_eq(state.get("step_count"), 1, "state.step_count")
        await check_server_error_async(
            "VALIDATION_ERROR", "step {'bogus': 1}", lambda: env.step({"bogus": 1})
        )
        step = await env.step({"message": "again"})
        check_eq(step.observation.get("echoed_message"), "again", "the session is still usable")


def generic_sync(base: str) -> None:
    section("GenericEnvClient 0.3.0, .sync()")
    client = GenericEnvClient(
        base_url=f"{base}/echo",
        connect_timeout_s=CONNECT_TIMEOUT_S,
        message_timeout_s=MESSAGE_TIMEOUT_S,
    )
    with client.sync() as env:
        env.reset(episode_id="interop-030-sync")
        step = env.step({"message": "hi"})
        check_eq(step.observation.get("echoed_message"), "hi", "step hi: observation.echoed_message")
        check_reward(step.reward, 2 * REWARD_PER_CHAR, "step hi: reward")
        check_server_error("VALIDATION_ERROR", "step {'bogus': 1}", lambda: env.step({"bogus": 1}))
        check_eq(env.state().get("step_count"), 1, "state.step_count")


async def mcp_tools(base: str) -> None:
    section("MCPToolClient 0.3.0 (tool steps over /ws)")
    client = MCPToolClient(
        base_url=f"{base}/echo",
        connect_timeout_s=CONNECT_TIMEOUT_S,
        message_timeout_s=MESSAGE_TIMEOUT_S,
    )
    check_eq(client.use_production_mode, False, "0.3.0 MCPToolClient stays on /ws")
    async with client as env:
        await env.reset(episode_id="interop-030-mcp")
        # list_tools returns [] when the observation does not parse as a tool list.
        tools = await env.list_tools(use_cache=False)
        names = {t.name for t in tools}
        check(TOOLS <= names, f"list_tools: lists {sorted(TOOLS)}", sorted(names))
        for tool in tools:
            check(
                "message" in ((tool.input_schema or {}).get("properties") or {}),
                f"list_tools: {tool.name} input_schema has a `message` property",
                tool.input_schema,
            )
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
        try:
            result = await env.call_tool("shout", message="x")
        except RuntimeError as e:
            check(
                "tool_not_found" in str(e),
                "call_tool('shout') raises RuntimeError (type: tool_not_found)",
                str(e),
            )
        else:
            raise CheckFailed(
                f"call_tool('shout') should raise RuntimeError\n        got: {result!r}"
            )

        listed = await env.step(ListToolsAction())
        check(
            isinstance(listed.observation, ListToolsObservation),
            "step ListToolsAction: the observation parses as ListToolsObservation",
            listed.observation,
        )
        called = await env.step(CallToolAction(tool_name="echo_message", arguments={"message": "x"}))
        check(
            isinstance(called.observation, CallToolObservation) and called.observation.error is None,
            "step CallToolAction: the observation parses as CallToolObservation, no error",
            called.observation,
        )
        state = await env.state()
        check_eq(state.episode_id, "interop-030-mcp", "state.episode_id")


def run(base: str) -> None:
    check_peer("openenv-core", "0.3.0")
    asyncio.run(generic_async(base))
    generic_sync(base)
    asyncio.run(mcp_tools(base))


if __name__ == "__main__":
    main(run)
