"""The real OpenEnv 0.10.0 `GenericEnvClient` against a verifiers environment that
`agentstack env import` wrapped and `agentstack env serve` serves.

    python client_verifiers.py http://127.0.0.1:PORT ANSWERS FULL_REWARD

ANSWERS is a JSON object from each question of the single-turn fixture to its answer;
FULL_REWARD is the rubric's weighted score for a short, correct answer. A wrong answer
must earn less, and two sessions at once must each get their own rollout.
"""

import asyncio
import json

from expect import (
    CONNECT_TIMEOUT_S,
    MESSAGE_TIMEOUT_S,
    check,
    check_eq,
    check_peer,
    check_reward,
    check_server_error,
    main,
    section,
)
from openenv.core.generic_client import GenericEnvClient


def client(url: str) -> GenericEnvClient:
    return GenericEnvClient(
        base_url=url,
        connect_timeout_s=CONNECT_TIMEOUT_S,
        message_timeout_s=MESSAGE_TIMEOUT_S,
    )


def question(result) -> str:
    """The fixture's question: the text of the newest user message."""
    messages = result.observation.get("messages")
    check(
        isinstance(messages, list) and messages and messages[-1].get("role") == "user",
        "observation.messages ends with the user's question",
        result.observation,
    )
    check_eq(result.observation.get("prompt"), messages[-1]["content"], "observation.prompt")
    return result.observation["prompt"]


def single_session(base: str, answers: dict, full: float) -> None:
    section("GenericEnvClient(...).sync(): one correct, one wrong answer")
    with client(base).sync() as env:
        first = env.reset(seed=4, episode_id="vf-1")
        check_eq(first.done, False, "reset: done")
        check_eq(first.reward, None, "reset: no reward yet")
        asked = question(first)
        check(asked in answers, "reset: the question is one of the fixture's", asked)
        again = env.reset(seed=4, episode_id="vf-1")
        check_eq(question(again), asked, "reset seed=4 twice: the same example")

        right = env.step({"message": answers[asked]})
        check_eq(right.done, True, "correct answer: done (single turn)")
        check_reward(right.reward, full, "correct answer: reward is the rubric's full score")
        check_eq(right.observation.get("stop_condition"), "max_turns_reached", "stop_condition")
        check_eq(
            right.observation.get("messages", [])[-1],
            {"role": "assistant", "content": answers[asked]},
            "the final observation ends with the reply",
        )
        state = env.state()
        check_eq((state.get("episode_id"), state.get("step_count")), ("vf-1", 1), "state")
        check_server_error(
            "EXECUTION_ERROR",
            "a step after the episode ended",
            lambda: env.step({"message": "again"}),
        )

        env.reset(seed=4)
        wrong = env.step({"message": "no idea"})
        check_eq(wrong.done, True, "wrong answer: done")
        check(
            isinstance(wrong.reward, (int, float)) and wrong.reward < full,
            f"wrong answer: reward below {full}",
            wrong.reward,
        )
        check_eq(wrong.observation.get("metrics", {}).get("exact_answer"), 0.0, "metrics.exact_answer")


async def two_sessions(base: str, answers: dict, full: float) -> None:
    section("two async sessions at once, each its own rollout")

    async def session(seed: int, correct: bool) -> float:
        async with client(base) as env:
            first = await env.reset(seed=seed)
            asked = first.observation["prompt"]
            reply = answers[asked] if correct else "999999"
            return (await env.step({"message": reply})).reward

    right, wrong = await asyncio.gather(session(1, True), session(2, False))
    check_reward(right, full, "the correct session's reward")
    check(wrong < full, "the wrong session's reward is lower", wrong)


def run(base: str, answers_json: str, full_reward: str) -> None:
    check_peer("openenv", "0.10.0")
    answers = json.loads(answers_json)
    full = float(full_reward)
    single_session(base, answers, full)
    asyncio.run(two_sessions(base, answers, full))


if __name__ == "__main__":
    main(run, optional=("ANSWERS", "FULL_REWARD"))
