"""`hybridserve serve --executor torch` against vLLM (CPU build) through the same client.

Starts each server as a subprocess on loopback, drives `/v1/completions` (token-id prompts,
greedy, `ignore_eos`, streamed) at each `--concurrency` with seeded random prompts of
`--prompt-tokens` tokens (the first `--shared-prefix` of them equal in every prompt), and prints
one JSON object: per server and concurrency, request and output-token throughput, TTFT / ITL /
TPOT p50, the server's CPU seconds (its whole process tree, from /proc) and output tokens per
server CPU-second, plus hybridserve / vLLM ratios and whether the greedy texts are identical.

vLLM runs when `--vllm-python` names an interpreter that can import it (a separate virtual
environment: it is no dependency of this project); it loads `--vllm-model`, a checkpoint folder,
by default the built-in `--model` written as one with hybridserve's float32 weights
(benchmarks/hf_checkpoint.py). Otherwise its entry says why it was skipped.

    .venv/bin/python benchmarks/serve_vs_vllm.py [--concurrency 8,32] [--requests-per-user 2]
        [--prompt-tokens 256] [--max-tokens 64] [--shared-prefix 0] [--threads N]
        [--vllm-python /tmp/vllm-venv/bin/python [--vllm-model DIR]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hybridserve.loadgen.client import sse_lines

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_checkpoint import hf_checkpoint
from server_process import engine_counters, free_port, vllm_version, wait_ready


@dataclass
class Stats:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    completed: int = 0
    texts: dict[int, str] = field(default_factory=dict)


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and every descendant still alive (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    total, todo, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
        todo.extend(children.get(current, []))
    return total


def _p50_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 2) if values else None


async def _one(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], index: int, stats: Stats
) -> None:
    start = time.perf_counter()
    first: float | None = None
    last: float | None = None
    text, tokens = [], 0
    async with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in sse_lines(response):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
                stats.ttft_s.append(now - start)
            elif last is not None:
                stats.itl_s.append(now - last)
            last = now
            text.append(chunk["choices"][0]["text"])
    if first is not None and last is not None and tokens > 1:
        stats.tpot_s.append((last - first) / (tokens - 1))
    stats.output_tokens += tokens
    stats.completed += 1
    stats.texts[index] = "".join(text)


async def _drive(
    base_url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> tuple[Stats, float]:
    stats = Stats()
    queue = iter(enumerate(prompts))

    async def user(http: httpx.AsyncClient) -> None:
        for index, prompt in queue:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            await _one(http, f"{base_url}/v1/completions", body, index, stats)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=600.0) as http:
        start = time.perf_counter()
        await asyncio.gather(*(user(http) for _ in range(concurrency)))
        return stats, time.perf_counter() - start


def _engine_counters(base_url: str) -> dict[str, float]:
    """hybridserve's engine counters from `/metrics` (`server_process.engine_counters`); empty
    for a server that does not export them (vLLM) or does not answer."""
    try:
        return engine_counters(httpx.get(f"{base_url}/metrics", timeout=10).text)
    except httpx.HTTPError:
        return {}


def _model_name(base_url: str) -> str:
    return str(httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"])


def _serve(
    command: list[str],
    port: int,
    args: argparse.Namespace,
    workloads: dict[int, list[list[int]]],
    warm_up: list[list[int]],
) -> dict[str, Any]:
    base_url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    try:
        wait_ready(base_url, process, args.start_timeout)
        model = _model_name(base_url)
        # Warm-up: first-call costs of the model, the tokenizer and the HTTP stack, on prompts
        # of their own (the measured prompts would otherwise start cached).
        asyncio.run(_drive(base_url, model, warm_up, 2, 4))
        results: dict[str, Any] = {}
        for concurrency, prompts in workloads.items():
            cpu_before, counters_before = _tree_cpu_s(process.pid), _engine_counters(base_url)
            stats, wall_s = asyncio.run(
                _drive(base_url, model, prompts, concurrency, args.max_tokens)
            )
            cpu_s = _tree_cpu_s(process.pid) - cpu_before
            counters = _engine_counters(base_url)
            engine = {k: v - counters_before.get(k, 0.0) for k, v in counters.items()}
            results[str(concurrency)] = {
                "completed": stats.completed,
                "wall_s": round(wall_s, 2),
                "requests_per_s": round(stats.completed / wall_s, 3),
                "output_tokens_per_s": round(stats.output_tokens / wall_s, 1),
                "ttft_p50_ms": _p50_ms(stats.ttft_s),
                "itl_p50_ms": _p50_ms(stats.itl_s),
                "tpot_p50_ms": _p50_ms(stats.tpot_s),
                "server_cpu_s": round(cpu_s, 2),
                "server_cores_busy": round(cpu_s / wall_s, 2),
                "output_tokens_per_server_cpu_s": round(stats.output_tokens / cpu_s, 1)
                if cpu_s
                else None,
                "_texts": stats.texts,
            }
            if engine.get("engine_steps"):  # where the wall time went: in engine steps, or between
                results[str(concurrency)].update(
                    engine_steps=int(engine["engine_steps"]),
                    engine_step_ms_mean=round(
                        engine["engine_step_seconds"] / engine["engine_steps"] * 1e3, 2
                    ),
                    engine_step_share_of_wall=round(engine["engine_step_seconds"] / wall_s, 3),
                    engine_step_cpu_s=round(engine.get("engine_step_cpu_seconds", 0.0), 2),
                )
        return results
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _vllm_skip_reason(args: argparse.Namespace) -> str | None:
    _, why_not = vllm_version(args.vllm_python)
    if why_not is not None:
        return why_not
    if args.vllm_model is None and args.model in ("smollm2", "gemma3-270m"):
        args.vllm_model = str(hf_checkpoint(args.model))
    if not args.vllm_model or not Path(args.vllm_model, "config.json").is_file():
        return "--vllm-model must be a checkpoint folder (config.json + safetensors)"
    return None


def _vllm_cmd(args: argparse.Namespace) -> Any:
    def command(port: int) -> list[str]:
        return [
            args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", args.vllm_model, "--port", str(port), "--dtype", "float32",
            "--max-num-seqs", str(max(args.concurrency)), "--max-model-len", "4096",
        ]  # fmt: skip

    return command


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _round_view(runs: dict[str, Any], concurrency: list[int]) -> dict[str, Any]:
    """One round without the texts, with its hybridserve / vLLM ratios when both served."""
    view: dict[str, Any] = {
        side: {c: {k: v for k, v in e.items() if k != "_texts"} for c, e in run.items()}
        if "skipped" not in run
        else run
        for side, run in runs.items()
    }
    ours, theirs = runs["hybridserve"], runs.get("vllm", {"skipped": "not run"})
    if "skipped" in ours or "skipped" in theirs:
        return view
    view["ratios"] = {
        str(c): {
            "requests_per_s": _ratio(
                ours[str(c)]["requests_per_s"], theirs[str(c)]["requests_per_s"]
            ),
            "itl_p50": _ratio(ours[str(c)]["itl_p50_ms"], theirs[str(c)]["itl_p50_ms"]),
            "identical_greedy_texts": sum(
                ours[str(c)]["_texts"].get(i) == t for i, t in theirs[str(c)]["_texts"].items()
            )
            / max(len(theirs[str(c)]["_texts"]), 1),
        }
        for c in concurrency
    }
    return view


def _median_or_none(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), 3) if kept else None


def _medians(runs: list[dict[str, Any]], concurrency: list[int]) -> dict[str, Any]:
    """Per concurrency, the median over rounds of every numeric field."""
    if any("skipped" in run for run in runs):
        return next(run for run in runs if "skipped" in run)
    out: dict[str, Any] = {}
    for c in map(str, concurrency):
        keys = [k for k, v in runs[0][c].items() if isinstance(v, int | float)]
        out[c] = {k: _median_or_none([run[c][k] for run in runs]) for k in keys}
    return out


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="hybridserve --model")
    parser.add_argument("--concurrency", type=_ints, default=[8, 32])
    parser.add_argument("--requests-per-user", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--shared-prefix", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=0, help="server threads (0: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--vllm-model", default=None)
    parser.add_argument(
        "--ours-args",
        default="",
        help="more `hybridserve serve` flags, e.g. '--preset baseline --max-num-batched-tokens "
        "2048' (vLLM 0.33's schedule at vLLM's CPU serving default budget)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds; medians and per-round ratios"
    )
    args = parser.parse_args()
    if args.shared_prefix > args.prompt_tokens:
        raise SystemExit("--shared-prefix cannot exceed --prompt-tokens")
    rng = random.Random(args.seed)
    shared = [rng.randrange(100, args.vocab) for _ in range(args.shared_prefix)]
    own = args.prompt_tokens - args.shared_prefix
    workloads = {
        c: [
            shared + [rng.randrange(100, args.vocab) for _ in range(own)]
            for _ in range(c * args.requests_per_user)
        ]
        for c in args.concurrency
    }
    warm_up = [
        [rng.randrange(100, args.vocab) for _ in range(args.prompt_tokens)] for _ in range(2)
    ]
    threads = args.threads or len(os.sched_getaffinity(0))

    def ours_cmd(port: int) -> list[str]:
        return [
            sys.executable, "-c", "from hybridserve.cli import main; main()", "serve",
            "--executor", "torch", "--model", args.model, "--device", "cpu", "--port", str(port),
            "--threads", str(threads), "--max-num-seqs", str(max(args.concurrency)),
            *args.ours_args.split(),
        ]  # fmt: skip

    report: dict[str, Any] = {"setup": {**vars(args), "threads": threads}}
    reason = _vllm_skip_reason(args)
    if reason is None:
        # vLLM's CPU backend: its KV cache size (GiB) and OpenMP threads, as many as ours. By
        # default it keeps one core for its front end and computes on the rest (one of two
        # here): no reserved core, so both sides compute on every core. Its compile cache does
        # not load on this torch, so ahead-of-time compiling only slows each start.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        os.environ["OMP_NUM_THREADS"] = str(threads)
    rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        # Interleaved: odd rounds start with vLLM, so a drift of the machine hits both sides.
        sides = ["hybridserve", "vllm"] if reason is None else ["hybridserve"]
        if index % 2:
            sides.reverse()
        runs: dict[str, Any] = {}
        for side in sides:
            print(f"round {index + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
            command = ours_cmd if side == "hybridserve" else _vllm_cmd(args)
            try:
                runs[side] = _serve(command(port := free_port()), port, args, workloads, warm_up)
            except RuntimeError as exc:
                runs[side] = {"skipped": f"{side} did not serve: {exc}"}
        rounds.append(runs)
    report["rounds"] = [_round_view(runs, args.concurrency) for runs in rounds]
    report["hybridserve"] = _medians([r["hybridserve"] for r in rounds], args.concurrency)
    if reason is not None:
        report["vllm"] = {"skipped": reason}
    elif any("skipped" in r["vllm"] for r in rounds):
        report["vllm"] = next(r["vllm"] for r in rounds if "skipped" in r["vllm"])
    else:
        report["vllm"] = _medians([r["vllm"] for r in rounds], args.concurrency)
        report["hybridserve_over_vllm"] = {
            str(c): {
                key: _median_or_none([r["ratios"][str(c)][key] for r in report["rounds"]])
                for key in ("requests_per_s", "itl_p50", "identical_greedy_texts")
            }
            for c in args.concurrency
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
