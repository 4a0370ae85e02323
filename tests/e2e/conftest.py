"""A live server on 127.0.0.1 (uvicorn in a thread, simulated executor) for the e2e tests."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridserve.cli.serve_commands import build_app
from hybridserve.cli.sim_backend import SimServingBackend
from hybridserve.server.app import ServerSettings, ServerState
from hybridserve.server.runner import HybridServer, server_config

MODEL = "qwen3-next-80b-a3b"


@dataclass
class LiveServer:
    base_url: str
    state: ServerState
    server: HybridServer
    thread: threading.Thread
    client: httpx.Client  # one connection pool: a client per call costs ~50 ms of set-up

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """Every sample of /metrics by `name{labels}` (labels sorted), parsed by prometheus."""
        text = self.client.get(f"{self.base_url}/metrics", headers=headers).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name"
                )
                out[f"{sample.name}{{{labels}}}"] = sample.value
        return out

    def wait_idle(self, timeout_s: float = 20.0) -> None:
        """Until the engine holds no request (finished ids flushed)."""
        deadline = time.monotonic() + timeout_s
        scheduler = self.state.parts.scheduler
        while time.monotonic() < deadline:
            with self.state.engine.lock:
                if not scheduler.has_requests() and not self.state.engine.num_queued():
                    return
            time.sleep(0.02)
        raise AssertionError("the engine still holds requests")

    def stop(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)


def free_port() -> int:
    """A loopback port free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until_serving(
    base_url: str, process: subprocess.Popen[str] | None = None, timeout_s: float = 60.0
) -> None:
    """Poll `base_url`/health until the server answers; fail when `timeout_s` passes or the
    server's `process` (when given) has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(base_url + "/health", timeout=5)
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"{base_url} did not answer in {timeout_s} s"
            assert process is None or process.poll() is None, "the server process exited"
            time.sleep(0.05)


def start_server(
    *,
    settings: ServerSettings | None = None,
    sim_speed: float = 1000.0,
    max_model_len: int = 4096,
    shutdown_timeout_s: float = 5.0,
    num_blocks: int | None = None,
    backend: SimServingBackend | None = None,
    **options: Any,
) -> LiveServer:
    """A sim server; `options` are SchedulerConfig fields."""
    backend = backend or SimServingBackend(sim_speed=sim_speed, max_model_len=max_model_len)
    settings = replace(settings or ServerSettings(), shutdown_timeout_s=shutdown_timeout_s)
    app = build_app(backend, settings, num_blocks=num_blocks, overrides=options)
    return serve_in_thread(app)


def serve_in_thread(app: Any) -> LiveServer:
    """Run `app` under uvicorn in a daemon thread on a free loopback port, with the server's
    own shutdown (`HybridServer`): `stop()` drains as SIGINT does."""
    port = free_port()
    config = server_config(app, host="127.0.0.1", port=port)
    server = HybridServer(config, app.state.hybridserve)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    base_url = f"http://127.0.0.1:{port}"
    return LiveServer(base_url, app.state.hybridserve, server, thread, httpx.Client())


@pytest.fixture(scope="module")
def live_server() -> Iterator[LiveServer]:
    server = start_server(settings=ServerSettings(max_request_bytes=64 * 1024))
    yield server
    server.stop()
