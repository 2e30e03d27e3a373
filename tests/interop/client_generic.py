"""The real OpenEnv 0.10.0 `GenericEnvClient`, sync and async, against an agentstack
server that serves `echo`, `arithmetic` and `connect_four` under path prefixes.

    python client_generic.py http://127.0.0.1:PORT

The client speaks only WebSocket `/ws` (reset, step, state, close) and turns error
frames into `RuntimeError("Server error: <message> (code: <code>)")`.
"""

import asyncio

from expect import (
    CONNECT_TIMEOUT_S,
    MESSAGE_TIMEOUT_S,
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

# echo's reward: 0.1 per character, capped at 1.
REWARD_PER_CHAR = 0.1


def client(url: str) -> GenericEnvClient:
    return GenericEnvClient(
        base_url=url,
        connect_timeout_s=CONNECT_TIMEOUT_S,
        message_timeout_s=MESSAGE_TIMEOUT_S,
    )


def check_observation_shape(result, what: str) -> None:
    """reward and done travel beside the observation, never inside it."""
    check(isinstance(result.observation, dict), f"{what}: observation is an object", result.observation)
    check(
        "reward" not in result.observation and "done" not in result.observation,
        f"{what}: observation carries no reward/done keys",
        result.observation,
    )
    check(isinstance(result.done, bool), f"{what}: done is a bool", result.done)


def check_echo_step(result, message: str, step: int, what: str) -> None:
    check_observation_shape(result, what)
    check_eq(result.observation.get("echoed_message"), message, f"{what}: observation.echoed_message")
    check_eq(result.observation.get("message_length"), len(message), f"{what}: observation.message_length")
    check_reward(result.reward, min(REWARD_PER_CHAR * len(message), 1.0), f"{what}: reward")
    check_eq(result.done, False, f"{what}: done")
    # 0.10.0 servers keep metadata inside the observation and also surface it
    # beside it when non-empty; the client exposes the latter as StepResult.metadata.
    nested = result.observation.get("metadata") or {}
    check_eq(nested.get("original_message"), message, f"{what}: observation.metadata.original_message")
    check_eq((result.metadata or {}).get("step"), step, f"{what}: top-level metadata.step")


def echo_sync(base: str) -> None:
    section("echo, GenericEnvClient(...).sync()")
    with client(f"{base}/echo").sync() as env:
        reset = env.reset(seed=7, episode_id="interop-sync")
        check_observation_shape(reset, "reset")
        check_eq(reset.done, False, "reset: done")
        step = env.step({"message": "hello"})
        check_echo_step(step, "hello", 1, "step hello")
        state = env.state()
        check_eq(state.get("episode_id"), "interop-sync", "state.episode_id (as reset asked)")
        check_eq(state.get("step_count"), 1, "state.step_count")

        check_server_error("VALIDATION_ERROR", "step {'bogus': 1}", lambda: env.step({"bogus": 1}))
        check_server_error("VALIDATION_ERROR", "step {'message': 3}", lambda: env.step({"message": 3}))
        again = env.step({"message": "again"})
        check_echo_step(again, "again", 2, "the session is still usable: step again")
        state = env.state()
        check_eq(state.get("step_count"), 2, "state.step_count (rejected steps do not count)")
        check_eq(state.get("episode_id"), "interop-sync", "state.episode_id unchanged")

        reset = env.reset(episode_id="interop-sync-2")
        check_eq(env.state().get("step_count"), 0, "a second reset: state.step_count")
        check_eq(env.state().get("episode_id"), "interop-sync-2", "a second reset: state.episode_id")


async def echo_async(base: str) -> None:
    section("echo, async GenericEnvClient")
    async with client(f"{base}/echo") as env:
        reset = await env.reset(seed=3, episode_id="interop-async")
        check_observation_shape(reset, "reset")
        step = await env.step({"message": "hello"})
        check_echo_step(step, "hello", 1, "step hello")
        state = await env.state()
        check_eq(state.get("episode_id"), "interop-async", "state.episode_id")
        check_eq(state.get("step_count"), 1, "state.step_count")
        await check_server_error_async(
            "VALIDATION_ERROR", "step {'bogus': 1}", lambda: env.step({"bogus": 1})
        )
        step = await env.step({"message": "hi"})
        check_echo_step(step, "hi", 2, "the session is still usable: step hi")

    section("echo, two async sessions at once")

    async def session(name: str, steps: int) -> dict:
        async with client(f"{base}/echo") as env:
            await env.reset(episode_id=name)
            for i in range(steps):
                result = await env.step({"message": f"{name}-{i}"})
                if result.observation.get("echoed_message") != f"{name}-{i}":
                    return {"error": result.observation}
            return await env.state()

    a, b = await asyncio.gather(session("left", 3), session("right", 5))
    check_eq((a.get("episode_id"), a.get("step_count")), ("left", 3), "session left: state")
    check_eq((b.get("episode_id"), b.get("step_count")), ("right", 5), "session right: state")


def arithmetic(base: str) -> None:
    section("arithmetic, GenericEnvClient(...).sync()")
    with client(f"{base}/arithmetic").sync() as env:
        first = env.reset(seed=11)
        check_observation_shape(first, "reset seed=11")
        check_eq(first.done, False, "reset: done")
        check(
            isinstance(first.observation.get("problem"), str),
            "reset: observation.problem is text",
            first.observation,
        )
        again = env.reset(seed=11)
        check_eq(again.observation, first.observation, "reset seed=11 twice: the same problem")
        step = env.step({"answer": "0"})
        check_observation_shape(step, "step answer=0")
        check(
            isinstance(step.reward, (int, float)) and step.reward in (0, 1),
            "step answer=0: reward is 0 or 1",
            step.reward,
        )
        check_eq(step.done, True, "step answer=0: done (one attempt by default)")
        check_eq(env.state().get("step_count"), 1, "state.step_count")
        # An environment that raises is an EXECUTION_ERROR frame; the session lives on.
        check_server_error(
            "EXECUTION_ERROR", "step after the episode ended", lambda: env.step({"answer": "1"})
        )
        check_server_error("VALIDATION_ERROR", "step {'bogus': 1}", lambda: env.step({"bogus": 1}))
        env.reset(seed=12)
        check_eq(env.state().get("step_count"), 0, "a new episode after the errors: step_count")


def connect_four(base: str) -> None:
    section("connect_four, GenericEnvClient(...).sync()")
    with client(f"{base}/connect_four").sync() as env:
        reset = env.reset(seed=5)
        check_observation_shape(reset, "reset")
        check_eq(reset.done, False, "reset: done")
        step = env.step({"column": 3})
        check_observation_shape(step, "step column=3")
        check(isinstance(step.reward, (int, float)), "step column=3: reward is a number", step.reward)
        check_eq(step.done, False, "step column=3: done (two discs cannot end the game)")
        check_eq(env.state().get("step_count"), 1, "state.step_count")

        env.reset(seed=5)
        illegal = env.step({"column": 99})
        check_observation_shape(illegal, "step column=99")
        check(
            isinstance(illegal.reward, (int, float)) and illegal.reward < 0,
            "step column=99: a negative reward",
            illegal.reward,
        )
        message = illegal.observation.get("message")
        check(
            isinstance(message, str) and "99" in message,
            "step column=99: observation.message says why",
            illegal.observation,
        )
        print(f"        message: {message!r}")
        check_eq(illegal.done, True, "step column=99: done (illegal moves end the game by default)")
        check_server_error(
            "EXECUTION_ERROR", "step after the game ended", lambda: env.step({"column": 0})
        )
        check_eq(env.reset(seed=6).done, False, "the session is still usable: reset")


def run(base: str) -> None:
    check_peer("openenv", "0.10.0")
    echo_sync(base)
    asyncio.run(echo_async(base))
    arithmetic(base)
    connect_four(base)


if __name__ == "__main__":
    main(run)
