"""Servers under test as subprocesses on loopback, for the benchmarks that compare real engines.

A `ServerProcess` starts its command in a process group of its own with stdout and stderr in a
log file, waits until `/health` answers 200 (or the process exits, or a timeout passes), and
stops the whole group (SIGINT, then SIGKILL after a grace period), so a server's workers (vLLM's
engine core) go with it. A server that does not come up raises `ServerFailed` with its name and
the tail of its log.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


class ServerFailed(RuntimeError):
    """A server that did not start: its name, why, and the last lines of its log."""

    def __init__(self, name: str, reason: str, log_tail: str) -> None:
        super().__init__(f"{name} did not start: {reason}")
        self.name = name
        self.reason = reason
        self.log_tail = log_tail


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ready(base_url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Return once `base_url/health` answers 200; RuntimeError if the process exits first or
    the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s")


def log_tail(path: Path, lines: int = 30) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def vllm_version(python: str | None) -> tuple[str | None, str | None]:
    """(vLLM's version, None) when `python` imports vllm, else (None, why not)."""
    if not python:
        return None, "no --vllm-python given (vLLM lives in a virtual environment of its own)"
    try:
        probe = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python} cannot run: {exc}"
    if probe.returncode != 0:
        return None, f"{python} cannot import vllm: {probe.stderr.strip()[-300:]}"
    return probe.stdout.strip().splitlines()[-1], None


@dataclass
class ServerProcess:
    """One server run: its command, extra environment, log file and port."""

    name: str
    command: list[str]
    log_path: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> float:
        """Start and wait until ready; the seconds that took. Raises ServerFailed."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        try:
            wait_ready(self.base_url, self.process, timeout_s)
        except RuntimeError as exc:
            self.stop()
            raise ServerFailed(self.name, str(exc), log_tail(self.log_path)) from None
        return time.monotonic() - began

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop the server's process group: SIGINT, then SIGKILL after `grace_s`."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        _reap_group(process.pid)


def _reap_group(pgid: int) -> None:
    """SIGKILL what is left of the group (workers that outlived their parent)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


ENGINE_COUNTERS = (  # hybridserve's engine counters, whole run (warm-up included)
    "engine_steps", "engine_step_seconds", "engine_step_cpu_seconds",
    "executor_step_duration_seconds", "prompt_tokens", "generation_tokens",
)  # fmt: skip


def engine_counters(metrics_text: str) -> dict[str, float]:
    """hybridserve's step counters from its Prometheus page: steps, the wall and CPU seconds
    inside Engine.step and the executor, prompt and generated tokens (vLLM has none of them)."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        match = re.match(r"^hybridserve:(\w+?)_total\{", line)
        if match and match.group(1) in ENGINE_COUNTERS:
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(line.rsplit(None, 1)[1])
    return found
