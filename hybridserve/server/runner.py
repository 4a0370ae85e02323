"""Run the app under uvicorn with the server's own shutdown and exit code.

The first SIGINT or SIGTERM (or `should_exit`) drains before uvicorn stops: new requests get
503 with Retry-After while the listening socket stays open, requests not started yet are
aborted at once, running ones get `shutdown_timeout_s` to finish and are then cut short (see
`ServerState.drain`); then uvicorn closes the connections, the engine stops, and the process
exits 0. A second signal stops at once. A dead engine stops the server with exit code 1, so
a supervisor restarts it.
"""

from __future__ import annotations

import socket
from types import FrameType
from typing import Any

import uvicorn

from hybridserve.server.app import ServerState

# After the drain, how long uvicorn waits for the last responses to be written.
FLUSH_TIMEOUT_S = 5


class HybridServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, state: ServerState, *, banner: str | None = None
    ) -> None:
        super().__init__(config)
        self.state = state
        self.banner = banner  # printed once the socket listens
        state.request_exit = self._exit_soon

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.banner:
            print(self.banner, flush=True)

    def _exit_soon(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            # A second signal: stop at once, and let the process end by that signal.
            self.force_exit = True
            super().handle_exit(sig, frame)
        else:
            # Not recorded as a captured signal: uvicorn would re-raise it once stopped, and
            # a graceful shutdown should end the process with 0.
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.state.drain(self.state.settings.shutdown_timeout_s, lambda: self.force_exit)
        await super().shutdown(sockets)


def server_config(app: Any, *, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=FLUSH_TIMEOUT_S
    )


def serve(
    app: Any, *, host: str, port: int, log_level: str = "warning", banner: str | None = None
) -> int:
    """Serve `app` (from `create_app`) until shutdown, printing `banner` once it listens;
    returns the process exit code."""
    state: ServerState = app.state.hybridserve
    config = server_config(app, host=host, port=port, log_level=log_level)
    HybridServer(config, state, banner=banner).run()
    return state.exit_code
