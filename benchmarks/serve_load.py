"""Load a `hybridserve serve --executor sim` subprocess on loopback at fixed concurrency.

Prints one JSON object: requests/s, output tokens/s, client-side p50/p99 TTFT and ITL, and the
server's overhead: its process CPU time outside `Engine.step` (HTTP, JSON, SSE, detokenizing,
the event loop), per generated token and as a fraction of the CPU time spent in `Engine.step`
and of the executor's (here modelled) step time. CPU rather than wall time, so that threads
waiting for the GIL or for a core do not count as work. Server figures are deltas of its /metrics
(`process_cpu_seconds_total`, `hybridserve:engine_step_seconds_total`, ...) over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hybridserve.loadgen.client import sse_lines
from hybridserve.metrics.stats import percentile

SERVER_COUNTERS = (
    "process_cpu_seconds_total",
    "hybridserve:engine_step_seconds_total",
    "hybridserve:engine_step_cpu_seconds_total",
    "hybridserve:executor_step_duration_seconds_total",
    "hybridserve:engine_steps_total",
    "hybridserve:generation_tokens_total",
)


@dataclass
class ClientStats:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    completed: int = 0
    output_tokens: int = 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _server_counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    out = dict.fromkeys(SERVER_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


async def _one(
    http: httpx.AsyncClient, url: str, body: dict[str, object], stats: ClientStats
) -> None:
    start = time.perf_counter()
    last: float | None = None
    async with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in sse_lines(response):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                stats.output_tokens += chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            now = time.perf_counter()
            if last is None:
                stats.ttft_s.append(now - start)
            else:
                stats.itl_s.append(now - last)
            last = now
    stats.completed += 1


async def _drive(base_url: str, args: argparse.Namespace, model: str) -> tuple[ClientStats, float]:
    stats = ClientStats()
    url = f"{base_url}/v1/completions"
    remaining = iter(range(args.requests))

    async def worker(http: httpx.AsyncClient) -> None:
        for index in remaining:
            prompt = f"request {index}: " + "lorem ipsum dolor sit amet " * (
                args.prompt_chars // 27
            )
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            await _one(http, url, body, stats)

    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=300.0) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
        return stats, time.perf_counter() - start


def _wait_ready(base_url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit("the server did not start within 60 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-chars", type=int, default=512)
    parser.add_argument("--model-profile", default="qwen3-next-80b-a3b")
    parser.add_argument("--sim-speed", type=float, default=1.0, help="1 = real time")
    args = parser.parse_args()
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-c", "from hybridserve.cli import main; main()", "serve",
        "--executor", "sim", "--model-profile", args.model_profile,
        "--sim-speed", str(args.sim_speed), "--port", str(port), "--max-model-len", "8192",
    ]  # fmt: skip
    process = subprocess.Popen(command)
    try:
        _wait_ready(base_url, process)
        before = _server_counters(base_url)
        stats, wall_s = asyncio.run(_drive(base_url, args, args.model_profile))
        after = _server_counters(base_url)
    finally:
        process.terminate()
        process.wait(timeout=30)
    delta = {k: after[k] - before[k] for k in SERVER_COUNTERS}
    step_s = delta["hybridserve:engine_step_cpu_seconds_total"]
    executor_s = delta["hybridserve:executor_step_duration_seconds_total"]
    tokens = delta["hybridserve:generation_tokens_total"]
    outside_s = max(delta["process_cpu_seconds_total"] - step_s, 0.0)
    report = {
        "setup": vars(args),
        "completed": stats.completed,
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(stats.completed / wall_s, 2),
        "output_tokens_per_s": round(stats.output_tokens / wall_s, 1),
        "ttft_ms": {
            "p50": round(percentile(stats.ttft_s, 50) * 1e3, 2),
            "p99": round(percentile(stats.ttft_s, 99) * 1e3, 2),
        },
        "itl_ms": {
            "p50": round(percentile(stats.itl_s, 50) * 1e3, 2),
            "p99": round(percentile(stats.itl_s, 99) * 1e3, 2),
        },
        "server": {
            "engine_steps": int(delta["hybridserve:engine_steps_total"]),
            "generated_tokens": int(tokens),
            "process_cpu_s": round(delta["process_cpu_seconds_total"], 3),
            "engine_step_wall_s": round(delta["hybridserve:engine_step_seconds_total"], 3),
            "engine_step_cpu_s": round(step_s, 3),
            "executor_step_s": round(executor_s, 3),
            "outside_step_cpu_s": round(outside_s, 3),
            "overhead_per_token_us": round(outside_s / tokens * 1e6, 1) if tokens else None,
            "overhead_fraction_of_engine_step": round(outside_s / step_s, 3) if step_s else None,
            "overhead_fraction_of_executor_step": (
                round(outside_s / executor_s, 3) if executor_s else None
            ),
        },
    }
    sys.stdout.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
