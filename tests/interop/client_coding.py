"""The real OpenEnv 0.10.0 clients against agentstack's `coding` environment, served
at BASE_URL (`agentstack env serve coding`): tests run in agentstack's sandbox.

    python client_coding.py http://127.0.0.1:PORT

- `GenericEnvClient` (WebSocket `/ws`): a function task solved in one step earns 1.0;
  a wrong solution earns less; the visible tests report failures; a repository task
  read, edited and submitted through step actions.
- `MCPToolClient`: the same tools over `POST /mcp`.
"""

from expect import CONNECT_TIMEOUT_S, MESSAGE_TIMEOUT_S, check, check_eq, check_peer, main, section
from openenv.core.generic_client import GenericEnvClient
from openenv.core.mcp_client import MCPToolClient

SOLUTION = "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())\n"
WRONG = "def count_vowels(s):\n    return len(s)\n"


def generic(url: str) -> None:
    client = GenericEnvClient(base_url=url, connect_timeout_s=CONNECT_TIMEOUT_S, message_timeout_s=MESSAGE_TIMEOUT_S)
    with client.sync() as env:
        section("GenericEnvClient: a function task in one step")
        reset = env.reset(task="count_vowels")
        check("count_vowels" in reset.observation["prompt"], "reset: the prompt names the function", reset.observation)
        result = env.step({"code": SOLUTION})
        check_eq(result.done, True, "submit: done")
        check_eq(result.reward, 1.0, "submit: every hidden test passes")

        section("GenericEnvClient: run_tests, then a wrong submission")
        env.reset(task="count_vowels", max_steps=3)
        ran = env.step({"tool": "run_tests", "code": WRONG})
        check_eq(ran.done, False, "run_tests: not done")
        check_eq(ran.reward, 0.0, "run_tests: no reward yet")
        check("FAILED" in ran.observation["output"], "run_tests: failures are reported", ran.observation)
        result = env.step({"tool": "submit"})
        check(0.0 <= result.reward < 1.0, "a wrong solution earns less than 1", result.reward)
        state = env.state()
        check_eq(state.task if hasattr(state, "task") else state.get("task"), "count_vowels", "state: task")

        section("GenericEnvClient: a repository task")
        reset = env.reset(task="inventory_stock_checks")
        check("invtrack/inventory.py" in reset.observation["files"], "reset: the repository's files", reset.observation["files"])
        read = env.step({"tool": "read_file", "path": "invtrack/inventory.py"})
        check("def remove" in read.observation["output"], "read_file returns the source", read.observation["output"][:200])
        result = env.step({"tool": "submit"})
        check(0.0 < result.reward < 1.0, "the unfixed snapshot earns partial credit", result.reward)


def tools(url: str) -> None:
    section("MCPToolClient: the coding tools")
    client = MCPToolClient(base_url=url, connect_timeout_s=CONNECT_TIMEOUT_S, message_timeout_s=MESSAGE_TIMEOUT_S)
    with client.sync() as env:
        env.reset(task="count_vowels", max_steps=5)
        names = {t.name for t in env.list_tools()}
        check_eq(names, {"write_file", "read_file", "list_files", "run_tests", "submit"}, "list_tools")
        env.call_tool("write_file", path="solution.py", content=SOLUTION)
        ran = env.call_tool("run_tests")
        check_eq((ran["tests_passed"], ran["tests_total"]), (2, 2), "run_tests: the visible tests pass")
        submitted = env.call_tool("submit")
        check_eq(submitted["reward"], 1.0, "submit: reward")


def run(url: str) -> None:
    check_peer("openenv", "0.10.0")
    generic(url)
    tools(url)


main(run)
