"""What the interop scripts share: checks that print what they checked, and a
`main` that turns the first failed check into a clear message and exit status 1.

Each script runs one peer client (the real OpenEnv Python package) against a server
whose base URL is the first argument, so a failure here is an incompatibility
between that client and the server.
"""

import asyncio
import inspect
import math
import sys
import traceback
from typing import Any, Callable

# Rewards travel as JSON numbers; compare them with this tolerance.
REWARD_TOLERANCE = 1e-9

# Timeouts handed to the peer clients, so a server that never answers fails the
# script instead of hanging it (the Rust test also bounds the whole script).
CONNECT_TIMEOUT_S = 10.0
MESSAGE_TIMEOUT_S = 20.0


class CheckFailed(Exception):
    """A check did not hold; the message says what was expected and what came."""


def check(condition: bool, what: str, got: Any = None) -> None:
    """Passes when `condition` holds; otherwise fails naming `what` and `got`."""
    if condition:
        print(f"  ok    {what}", flush=True)
        return
    detail = "" if got is None else f"\n        got: {got!r}"
    raise CheckFailed(f"{what}{detail}")


def check_eq(got: Any, want: Any, what: str) -> None:
    """`got == want`."""
    check(got == want, f"{what} == {want!r}", got)


def check_reward(got: Any, want: float, what: str) -> None:
    """A numeric reward within REWARD_TOLERANCE of `want`."""
    ok = isinstance(got, (int, float)) and math.isfinite(got) and abs(got - want) <= REWARD_TOLERANCE
    check(ok, f"{what} == {want}", got)


def check_server_error(code: str, what: str, call: Callable[[], Any]) -> str:
    """`call` raises the RuntimeError the Python client makes of an error frame,
    `Server error: <message> (code: <code>)`; returns the message."""
    try:
        result = call()
    except RuntimeError as e:
        text = str(e)
        check(
            text.startswith("Server error:") and f"(code: {code})" in text,
            f"{what} raises RuntimeError with code {code}",
            text,
        )
        return text
    raise CheckFailed(f"{what} should raise RuntimeError (code: {code})\n        got a result: {result!r}")


async def check_server_error_async(code: str, what: str, call: Callable[[], Any]) -> str:
    """The async form of `check_server_error`: `call()` returns an awaitable."""
    try:
        result = await call()
    except RuntimeError as e:
        text = str(e)
        check(
            text.startswith("Server error:") and f"(code: {code})" in text,
            f"{what} raises RuntimeError with code {code}",
            text,
        )
        return text
    raise CheckFailed(f"{what} should raise RuntimeError (code: {code})\n        got a result: {result!r}")


def section(title: str) -> None:
    """Starts a group of checks in the output."""
    print(f"{title}:", flush=True)


def main(run: Callable[[str], Any]) -> None:
    """Runs `run(base_url)` (a function or a coroutine function) with the URL from
    argv; exits 1 with a message on the first failure."""
    if len(sys.argv) != 2:
        print(f"usage: {sys.argv[0]} BASE_URL", file=sys.stderr)
        sys.exit(2)
    base_url = sys.argv[1].rstrip("/")
    script = sys.argv[0].rsplit("/", 1)[-1]
    try:
        if inspect.iscoroutinefunction(run):
            asyncio.run(run(base_url))
        else:
            run(base_url)
    except CheckFailed as e:
        print(f"FAIL  {e}", flush=True)
        print(f"{script}: FAILED against {base_url}", file=sys.stderr)
        sys.exit(1)
    except Exception:
        traceback.print_exc()
        print(f"{script}: FAILED against {base_url} with an exception (above)", file=sys.stderr)
        sys.exit(1)
    print(f"{script}: all checks passed against {base_url}", flush=True)
