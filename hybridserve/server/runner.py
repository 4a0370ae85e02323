"""Run the app under uvicorn with the server's own shutdown and exit code.

The first SIGINT or SIGTERM (or `should_exit`) drains before uvicorn stops: new requests get
503 with Retry-After while the listening socket stays open, requests not started yet are
aborted at once, running ones get `shutdown_timeout_s` to finish and are then cut short (see
`ServerState.drain`); then uvicorn closes the connections, the engine stops, and the process
exits 0. A second signal stops at once. The first one says so at once on stderr (how long the
running requests get, how many there are, and that a second signal stops now). A dead engine
stops the server with exit code 1, so a supervisor restarts it.

`listening_socket` binds the port before the caller loads a model, so a port in use is an error
at once rather than after the load; uvicorn then listens on that socket.
"""

from __future__ import annotations

import socket
import sys
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
            running = self.state.engine.num_streams()
            message = shutdown_message(self.state.settings.shutdown_timeout_s, running)
            print(message, file=sys.stderr, flush=True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.state.drain(self.state.settings.shutdown_timeout_s, lambda: self.force_exit)
        await super().shutdown(sockets)


def shutdown_message(timeout_s: float, running: int) -> str:
    """What the first Ctrl-C (or SIGTERM) prints at once: the drain can take `timeout_s`."""
    if running == 0:
        return "shutting down: no running requests"
    plural = "" if running == 1 else "s"
    return (
        f"shutting down: waiting up to {timeout_s:g} s for {running} running request{plural}; "
        "Ctrl-C again to stop now"
    )


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, for `serve` to hand to uvicorn (which listens on it).
    Raises OSError: EADDRINUSE when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn binds: a port left in TIME_WAIT by a server just stopped is free again.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def server_config(app: Any, *, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=FLUSH_TIMEOUT_S
    )


def serve(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str = "warning",
    banner: str | None = None,
    sock: socket.socket | None = None,
) -> int:
    """Serve `app` (from `create_app`) until shutdown, printing `banner` once it listens, on
    `sock` when given (from `listening_socket`), else on a socket uvicorn binds; returns the
    process exit code."""
    state: ServerState = app.state.hybridserve
    config = server_config(app, host=host, port=port, log_level=log_level)
    HybridServer(config, state, banner=banner).run(sockets=None if sock is None else [sock])
    return state.exit_code
