"""The OpenEnv reference server for the side-by-side benchmark.

Serves the environment `openenv init` generates (the echo template: action
``{"message": str}``, observation ``echoed_message``/``message_length``, reward
``min(0.1 * len, 1.0)``) with openenv's own ``create_app`` under uvicorn, on
127.0.0.1 only.

It binds the socket itself so that port 0 works, then prints one line to stdout,
``listening on http://127.0.0.1:PORT``, the same first line ``agentstack env serve``
prints; the load generator parses it.

Usage: python reference_server.py --port 0 --max-concurrent-envs 2000
"""

import argparse
import socket
import sys
from typing import Any, Optional
from uuid import uuid4

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class EchoAction(Action):
    """A message to echo."""

    message: str = Field(..., description="Message to echo back")


class EchoObservation(Observation):
    """The echoed message and its length."""

    echoed_message: str = Field(default="", description="The echoed message")
    message_length: int = Field(default=0, description="Length of the echoed message")


class EchoEnvironment(Environment):
    """The `openenv init` template environment, trimmed of its comments."""

    # Each session gets its own instance, so sessions may run side by side.
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(
        self,
        seed: Optional[int] = None,
        episode_id: Optional[str] = None,
        **kwargs: Any,
    ) -> EchoObservation:
        self._state = State(
            episode_id=episode_id if episode_id is not None else str(uuid4()),
            step_count=0,
        )
        return EchoObservation(
            echoed_message="Echo environment ready!",
            message_length=0,
            done=False,
            reward=0.0,
        )

    def step(self, action: EchoAction) -> EchoObservation:  # type: ignore[override]
        self._state.step_count += 1
        message = action.message
        length = len(message)
        return EchoObservation(
            echoed_message=message,
            message_length=length,
            done=False,
            reward=min(length * 0.1, 1.0),
            metadata={"original_message": message, "step": self._state.step_count},
        )

    @property
    def state(self) -> State:
        return self._state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-concurrent-envs", type=int, default=256)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()

    app = create_app(
        EchoEnvironment,
        EchoAction,
        EchoObservation,
        env_name="echo",
        max_concurrent_envs=args.max_concurrent_envs,
    )

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    port = sock.getsockname()[1]
    # uvicorn's defaults otherwise (asyncio loop, h11, websockets, 2048 backlog,
    # 20 s server pings); only the per-connection log lines are turned off, as they
    # would be in a deployment under load.
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level=args.log_level, access_log=False
    )
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    sys.stdout.flush()
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
