"""`hybridserve serve --executor torch --dcp 2`: the server process is rank 0 and schedules, a
second local process holds the other half of the KV; clients get transformers' greedy text,
and shutting the server down ends the other rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybridserve.parallel.launch import find_free_port
from tests.e2e.test_torch_server import _reference_text, _write_checkpoint

STARTUP_S = 90


@pytest.fixture(scope="module")
def dcp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any, Any]]:
    folder = tmp_path_factory.mktemp("tiny-llama-dcp")
    reference, tok = _write_checkpoint(folder)
    port = find_free_port()
    command = [sys.executable, "-m", "hybridserve.cli", "serve", "--executor", "torch"]
    command += ["--model", str(folder), "--device", "cpu", "--max-model-len", "256"]
    command += ["--preset", "baseline", "--dcp", "2", "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the DCP server did not start:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.3)
    yield base, (reference, tok), proc
    if proc.poll() is None:
        proc.kill()


def _children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def test_dcp_2_server_completion_matches_transformers_greedy(dcp_server) -> None:  # type: ignore[no-untyped-def]
    base, (reference, tok), _ = dcp_server
    prompt = (
        "the cat sat on the mat and then the dog ran to the park and then slept and the bird "
        "sang on the tree and the cat ate fish and then the dog sat on the mat"
    )  # 38 tokens: a repeat hits one 32-token block (16 tokens on each rank)
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    expected = _reference_text(reference, tok, tok.encode(prompt).ids, 12)
    assert expected.strip()
    assert response.json()["choices"][0]["text"].split() == expected.split()
    # The same prompt again resumes from the cached prefix, sharded over both ranks.
    again = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert again.json()["choices"][0]["text"] == response.json()["choices"][0]["text"]
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    hits = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("hybridserve:prefix_cache_hits_total")
    ]
    assert hits == [32.0]


def test_stopping_the_dcp_server_ends_its_other_rank(dcp_server) -> None:  # type: ignore[no-untyped-def]
    _, _, proc = dcp_server
    # Rank 1 is forked by the multiprocessing forkserver, a child of the server process.
    ranks = [pid for server in _forkservers(proc.pid) for pid in _children(server)]
    assert len(ranks) == 1, "the server should run exactly one other DCP rank"
    proc.send_signal(signal.SIGINT)
    # Released by the driver, rank 1 exits at once; a straggler is killed only after 30 s.
    assert proc.wait(timeout=25) == 0
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in ranks if _is_running(pid)]


def _forkservers(pid: int) -> set[int]:
    """The server's forkserver child (the rank processes are its children)."""
    return {c for c in _children(pid) if "forkserver" in _cmdline(c)}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_to_the_dcp_server_process_group_shuts_down_cleanly(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A `kill` of the whole process group (a service manager, a container stop) reaches every
    rank at once: the server still releases its other rank and exits without a traceback."""
    folder = tmp_path_factory.mktemp("tiny-llama-dcp-term")
    _write_checkpoint(folder)
    port = find_free_port()
    command = [sys.executable, "-m", "hybridserve.cli", "serve", "--executor", "torch"]
    command += ["--model", str(folder), "--device", "cpu", "--max-model-len", "256"]
    command += ["--dcp", "2", "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "no start"
            time.sleep(0.3)
        ranks = [pid for server in _forkservers(proc.pid) for pid in _children(server)]
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in stderr and "Error" not in stderr, stderr[-3000:]
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM once done
    assert len(ranks) == 1 and not [pid for pid in ranks if _is_running(pid)]
