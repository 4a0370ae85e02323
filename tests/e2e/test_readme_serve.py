"""The `hybridserve serve` commands of docs/serving.md (the page the README links for `serve`),
and its curl and Python snippets, run as written against both executors: the sim, and the torch
executor on the built-in SmolLM2 (skipped when `models/smollm2` is absent). The only change is
the port: 8000 becomes a free one, so that the test does not collide with anything listening
there.

Each server is a real `hybridserve serve` process: its start-up banner must name the URL and
the model id the snippets use, and SIGINT must stop it with status 0.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "serving.md").read_text()
# The page up to its first section: the commands and the snippets that work on either executor.
SECTION = PAGE[PAGE.index("# `hybridserve serve`") :]
SECTION = SECTION[: SECTION.index("\n## ")]


def _blocks(language: str = "") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", SECTION, flags=re.DOTALL)


def serve_commands() -> dict[str, str]:
    """executor -> the page's `hybridserve serve` command for it."""
    out = {}
    for block in _blocks():
        for line in block.splitlines():
            if line.startswith("hybridserve serve "):
                executor = shlex.split(line)[shlex.split(line).index("--executor") + 1]
                out[executor] = line
    return out


def curl_snippet() -> str:
    (block,) = [b for b in _blocks() if b.startswith("curl ")]
    return block


def python_snippet() -> str:
    (block,) = [b for b in _blocks("python") if "OpenAI(" in b]
    return block


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # two shared cores
    return env


class ServeProcess:
    def __init__(self, command: str, port: int) -> None:
        argv = shlex.split(command.replace("8000", str(port)))
        assert argv[0] == "hybridserve"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hybridserve.cli", *argv[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=ROOT,
        )
        self.lines: list[str] = []
        self.errors: list[str] = []
        assert self.process.stdout is not None and self.process.stderr is not None
        threading.Thread(target=self._read, args=(self.process.stdout, self.lines)).start()
        threading.Thread(target=self._read, args=(self.process.stderr, self.errors)).start()

    @staticmethod
    def _read(stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line)

    def wait_for_banner(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = "".join(self.lines)
            if "  try:" in text:
                return text
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no start-up banner; stderr: {''.join(self.errors)[-2000:]}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def _torch_ready() -> str | None:
    """Why the torch command cannot run here, or None."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return "the torch executor needs the models extra (torch)"
    from hybridserve.executor.torch.checkpoints import builtin_path

    path = builtin_path("smollm2")
    if not path.is_file():
        return f"{path} is absent (`make models` fetches the built-in SmolLM2 GGUF)"
    return None


@pytest.fixture(params=["sim", "torch"])
def page_server(request: pytest.FixtureRequest) -> Iterator[tuple[ServeProcess, int, str]]:
    executor = request.param
    if executor == "torch" and (reason := _torch_ready()) is not None:
        pytest.skip(reason)
    command = serve_commands()[executor]
    port = free_port()
    server = ServeProcess(command, port)
    try:
        banner = server.wait_for_banner(timeout_s=300 if executor == "torch" else 60)
        yield server, port, banner
    finally:
        code = server.stop()
    assert code == 0, "".join(server.errors)[-2000:]
    assert "Traceback" not in "".join(server.errors)


def test_the_serving_page_lists_a_serve_command_per_executor() -> None:
    commands = serve_commands()
    assert set(commands) == {"sim", "torch"}
    model_ids = {
        shlex.split(c)[shlex.split(c).index("--served-model-name") + 1] for c in commands.values()
    }
    assert len(model_ids) == 1  # the snippets need one model id for both
    (model_id,) = model_ids
    assert f'"model": "{model_id}"' in curl_snippet()
    assert f'model="{model_id}"' in python_snippet()


@pytest.mark.timeout(900)
def test_the_serving_page_snippets_run_unchanged_on_both_executors(
    page_server: tuple[ServeProcess, int, str],
) -> None:
    server, port, banner = page_server
    base = f"http://127.0.0.1:{port}"
    model_id = "my-model"
    assert f"listening on {base}" in banner
    assert f'model id:  "{model_id}"' in banner
    for setting in ("max_num_seqs=", "max_num_batched_tokens=", "max_model_len=", "retention"):
        assert setting in banner
    assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"] == model_id

    curl = curl_snippet().replace("8000", str(port))
    if shutil.which("curl"):
        done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
    else:  # the same request without curl
        body = json.loads(re.search(r"-d '(.*)'", curl, flags=re.DOTALL).group(1))  # type: ignore[union-attr]
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=300).json()
    assert answer["model"] == model_id
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert 1 <= answer["usage"]["completion_tokens"] <= 16

    snippet = python_snippet().replace("8000", str(port))
    done = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300, env=_env()
    )
    assert done.returncode == 0, done.stderr
    if "--executor torch" in " ".join(server.process.args):  # type: ignore[arg-type]
        assert done.stdout.strip()  # SmolLM2 says something back
