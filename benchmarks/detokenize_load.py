"""Server CPU per generated token against output length, with a real model's tokenizer.

Starts a server subprocess (this script with `--serve`) on the simulated executor whose
output is detokenized by the smollm2 tokenizer (the built-in GGUF; `make models` fetches it).
For each of `--lengths` it streams `--repeats` requests of exactly that many tokens, one at a
time, and prints one JSON line: the server's process CPU outside `Engine.step` (HTTP, SSE,
detokenizing, stop strings, the event loop) per generated token, from /metrics deltas. Flat
from 100 to 8,000 tokens means detokenizing is linear in the output. `--decoder whole`
re-decodes the whole output at every delivery instead (the quadratic approach), to compare.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

TOKENIZER = Path(__file__).resolve().parents[1] / "models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
COUNTERS = (
    "process_cpu_seconds_total",
    "hybridserve:engine_step_cpu_seconds_total",
    "hybridserve:generation_tokens_total",
    "hybridserve:engine_steps_total",
)


class WholeDecoder:
    """The quadratic reference: decode every id so far at each push, send the new suffix."""

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._sent = 0

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new, self._sent = text[self._sent :], len(text)
        return new

    def flush(self) -> str:
        text = self._decode(self._ids)
        new, self._sent = text[self._sent :], len(text)
        return new


def serve(port: int, decoder: str, sim_speed: float) -> int:
    from hybridserve.cli.serve_commands import build_app
    from hybridserve.cli.sim_backend import SimServingBackend
    from hybridserve.executor.torch.tokenizer import gguf_tokenizer
    from hybridserve.server.app import ServerSettings
    from hybridserve.server.runner import serve as run_server
    from hybridserve.server.torch_backend import TorchTokenizer

    text = gguf_tokenizer(TOKENIZER)

    class Tokenizer(TorchTokenizer):
        def new_decoder(self) -> Any:
            return WholeDecoder(text.decode) if decoder == "whole" else super().new_decoder()

    tokenizer = Tokenizer(text, (0,))

    class Backend(SimServingBackend):
        @property
        def tokenizer(self) -> Any:
            return tokenizer

    backend = Backend(sim_speed=sim_speed, max_model_len=16_384)
    return run_server(build_app(backend, ServerSettings()), host="127.0.0.1", port=port)


def _counters(base_url: str) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def _stream(base_url: str, model: str, max_tokens: int) -> int:
    body = {
        "model": model,
        "prompt": "Tell me a story.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    chars = 0
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                chars += len(choices[0]["text"]) if choices else 0
    return chars


def _wait_ready(base_url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit("the server did not start within 120 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 1000, 8000])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decoder", choices=("offset", "whole"), default="offset")
    parser.add_argument(
        "--sim-speed",
        type=float,
        default=10.0,
        help="modelled step time / this = wall step time; slow enough that each delivery "
        "carries one token, as on a real GPU",
    )
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        sys.exit(serve(args.serve, args.decoder, args.sim_speed))
    if not TOKENIZER.is_file():
        raise SystemExit(f"{TOKENIZER} is absent: run `make models`")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, __file__, "--serve", str(port), "--decoder", args.decoder]
    command += ["--sim-speed", str(args.sim_speed)]
    process = subprocess.Popen(command)
    try:
        _wait_ready(base_url, process)
        model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        _stream(base_url, model, 50)  # warm up
        for length in args.lengths:
            before = _counters(base_url)
            chars = sum(_stream(base_url, model, length) for _ in range(args.repeats))
            after = _counters(base_url)
            delta = {k: after[k] - before[k] for k in COUNTERS}
            tokens = delta["hybridserve:generation_tokens_total"]
            outside = delta["process_cpu_seconds_total"] - delta[COUNTERS[1]]
            line = {
                "decoder": args.decoder,
                "sim_speed": args.sim_speed,
                "output_tokens": length,
                "requests": args.repeats,
                "generated_tokens": int(tokens),
                "engine_steps": int(delta["hybridserve:engine_steps_total"]),
                "text_chars": chars,
                "server_cpu_s": round(delta["process_cpu_seconds_total"], 3),
                "server_cpu_outside_step_per_token_us": round(outside / tokens * 1e6, 1),
            }
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
    finally:
        process.terminate()
        process.wait(timeout=60)


if __name__ == "__main__":
    main()
