"""The real OpenEnv 0.10.0 `GenericEnvClient` against an agentstack server started with
API keys (`agentstack env serve --api-key`, or AGENTSTACK_API_KEY):

    AGENTSTACK_API_KEY=KEY python client_api_key.py http://127.0.0.1:PORT

Without an `Authorization` header, or with a wrong key, the WebSocket upgrade is
refused with HTTP 401 and the client fails to connect; with
`headers={"Authorization": "Bearer KEY"}` (the client's own way to send a token) an
episode runs. `/health` answers without a key; the other HTTP routes answer 401 with
FastAPI's `{"detail": ...}` shape.
"""

import json
import os
import urllib.error
import urllib.request

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

# echo's reward: 0.1 per character, capped at 1.
REWARD_PER_CHAR = 0.1


def client(url: str, headers=None) -> GenericEnvClient:
    return GenericEnvClient(
        base_url=url,
        connect_timeout_s=CONNECT_TIMEOUT_S,
        message_timeout_s=MESSAGE_TIMEOUT_S,
        headers=headers,
    )


def check_refused(url: str, headers, what: str) -> None:
    """Opening a session fails, and the failure is the server's 401."""
    try:
        with client(url, headers).sync() as env:
            result = env.reset()
    except ConnectionError as e:
        check("401" in str(e), f"{what}: the client fails to connect with HTTP 401", str(e))
        print(f"        error: {e}")
        return
    raise CheckFailed(f"{what}: a session opened without a valid key\n        got: {result!r}")


def http_status(url: str, headers=None) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=MESSAGE_TIMEOUT_S) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def run(base: str) -> None:
    check_peer("openenv", "0.10.0")
    keys = os.environ.get("AGENTSTACK_API_KEY", "")
    key = next((k.strip() for k in keys.split(",") if k.strip()), None)
    check(key is not None, "AGENTSTACK_API_KEY holds the server's key")
    url = f"{base}/echo"
    authorized = {"Authorization": f"Bearer {key}"}

    section("HTTP")
    status, body = http_status(f"{url}/health")
    check_eq((status, body), (200, {"status": "healthy"}), "GET /health without a key")
    status, body = http_status(f"{url}/metadata")
    check_eq(status, 401, "GET /metadata without a key")
    check(isinstance(body.get("detail"), str), "the 401 body is {'detail': str}", body)
    status, body = http_status(f"{url}/metadata", authorized)
    check_eq((status, body.get("name")), (200, "echo"), "GET /metadata with the key")

    section("GenericEnvClient without the key")
    check_refused(url, None, "no headers")
    check_refused(url, {"Authorization": "Bearer not-the-key"}, "a wrong key")

    section("GenericEnvClient(headers={'Authorization': 'Bearer <key>'})")
    with client(url, authorized).sync() as env:
        reset = env.reset(seed=3, episode_id="keyed")
        check_eq(reset.done, False, "reset: done")
        step = env.step({"message": "hello"})
        check_eq(step.observation.get("echoed_message"), "hello", "step: observation.echoed_message")
        check(
            abs(step.reward - REWARD_PER_CHAR * len("hello")) < 1e-9,
            "step: reward",
            step.reward,
        )
        state = env.state()
        check_eq(state.get("episode_id"), "keyed", "state.episode_id")
        check_eq(state.get("step_count"), 1, "state.step_count")


if __name__ == "__main__":
    main(run)
