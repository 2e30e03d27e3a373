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
    ok = (
        isinstance(got, (int, float))
        and math.isfinite(got)
        and abs(got - want) <= REWARD_TOLERANCE
    )
    check(ok, f"{what} == {want}", got)


def _check_raised(code: str, what: str, error: RuntimeError) -> str:
    text = str(error)
    check(
        text.startswith("Server error:") and f"(code: {code})" in text,
        f"{what} raises RuntimeError with code {code}",
        text,
    )
    return text


def _not_raised(code: str, what: str, result: Any) -> CheckFailed:
    return CheckFailed(
        f"{what} should raise RuntimeError (code: {code})\n        got a result: {result!r}"
    )


def check_server_error(code: str, what: str, call: Callable[[], Any]) -> str:
    """`call` raises the RuntimeError the Python client makes of an error frame,
    `Server error: <message> (code: <code>)`; returns its text."""
    try:
        result = call()
    except RuntimeError as e:
        return _check_raised(code, what, e)
    raise _not_raised(code, what, result)


async def check_server_error_async(code: str, what: str, call: Callable[[], Any]) -> str:
    """The async form of `check_server_error`: `call()` returns an awaitable."""
    try:
        result = await call()
    except RuntimeError as e:
        return _check_raised(code, what, e)
    raise _not_raised(code, what, result)


def check_peer(distribution: str, version: str) -> None:
    """The python running this script has the peer it is meant to test."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        got = installed(distribution)
    except PackageNotFoundError:
        raise CheckFailed(
            f"{distribution} is not installed in {sys.executable}\n"
            "        hint: run scripts/install-peers, or point the test's variable at its venv"
        ) from None
    check_eq(got, version, f"the peer: {distribution} in {sys.executable}")


def section(title: str) -> None:
    """Starts a group of checks in the output."""
    print(f"{title}:", flush=True)


def main(run: Callable[..., Any], optional: tuple[str, ...] = ()) -> None:
    """Runs `run(base_url, *optional_args)` (a function or a coroutine function) with
    the arguments from argv; exits 1 with a message on the first failure.
    `optional` names positional arguments that may follow BASE_URL."""
    args = sys.argv[1:]
    if not 1 <= len(args) <= 1 + len(optional):
        names = "".join(f" [{name}]" for name in optional)
        print(f"usage: {sys.argv[0]} BASE_URL{names}", file=sys.stderr)
        sys.exit(2)
    base_url = args[0].rstrip("/")
    script = sys.argv[0].rsplit("/", 1)[-1]
    try:
        if inspect.iscoroutinefunction(run):
            asyncio.run(run(base_url, *args[1:]))
        else:
            run(base_url, *args[1:])
    except CheckFailed as e:
        print(f"FAIL  {e}", flush=True)
        print(f"{script}: FAILED against {base_url}", file=sys.stderr)
        sys.exit(1)
    except Exception:
        traceback.print_exc()
        print(f"{script}: FAILED against {base_url} with an exception (above)", file=sys.stderr)
        sys.exit(1)
    print(f"{script}: all checks passed against {base_url}", flush=True)
