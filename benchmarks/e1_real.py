"""Experiment E1 on real engines: the agent workload against `serve --executor torch --preset
baseline`, `serve --executor torch --preset hybridserve` and vLLM (CPU build), on one model and
the same float32 weights, scaled to a small CPU machine.

For each load (`--agents`) and seed, each server is started fresh, `hybridserve agents --url`
runs against it (the same request sequence on every server of a seed), the server's own
preemption counter is read from `/metrics`, and the server is stopped. Seed k runs the servers
in an order rotated by k, so a drift of the machine does not favour one of them. A server that
does not start is reported by name with the tail of its log, and the run goes on.

The workload, scaled from E1: a 1,000-token shared system prompt, contexts growing to 6,000
tokens (`--max-context`), answers of median 32 tokens, tool results of median 150 and tool
times x0.2 (`--time-scale`). A job appends drawn answer tokens (`--answers synthetic`, every
server sees the same prompts) or the tokens the server generated (`--answers server`, as an
agent does: a server's cache of its own answers counts).

The KV pool is the same on every server, in blocks of `--block-size` tokens (32 by default:
vLLM's CPU attention takes multiples of 32, and the cached-token counts compare only at one
block size): `--pool-tokens` / block size blocks, given to hybridserve as `--num-blocks` and to
vLLM as `--num-gpu-blocks-override`, with `VLLM_CPU_KVCACHE_SPACE` (whole GiB) large enough to
hold them. vLLM's pool is sized in bytes per block: the layers of one KV group (all of them on
a model with one attention type) x block size x K and V x KV heads x head dim x 4 bytes
(float32); for SmolLM2-135M (30 layers, 3 KV heads of 64) that is 1,474,560 bytes per 32-token
block, so 1 GiB holds 728 blocks (23,296 tokens, as vLLM logs). `pool_mapping` computes it from
`config.json`, and each vLLM run's log is parsed for the block count it used. Both engines hold
one block back (the null block). On Gemma 3 both split the 15 sliding-window layers into 5
groups of 3 and the 3 full layers into one (each group takes its own blocks per request), and
keep layer k of every group in one tensor, so a block is 3 layers' pages on both and equal
blocks are equal bytes (196,608 bytes a 32-token block; hybridserve's `derive_cache_groups` and
`DeviceCache`, checked against `kv_bytes_per_block` in tests/unit/test_e1_real.py).

The scheduler: vLLM gets the `baseline` preset's limits (vLLM 0.33's 8,192-token budget and
256 sequences; not vLLM-CPU's own serving defaults, 2,048 and 128), so that `baseline` and vLLM
run one schedule; `hybridserve` runs its preset as shipped. Every server gets `--threads`
cores (vLLM: `OMP_NUM_THREADS`, no core reserved for its front end).

The report (one JSON object, the last line of stdout, and `--out FILE`): every run's agents
metrics; per load, the paired ratios hybridserve/vllm, baseline/vllm and hybridserve/baseline
of job goodput, output tokens/s, p99 ITL, p99 TTFT, SLO attainment and cached tokens per turn
(geometric mean of per-seed ratios, 95% t interval, per-seed values); a cache-exactness check
(baseline against vLLM: the cached prompt tokens of every turn both finished, from the agents'
`requests.jsonl`, and each run's mean); and each server's start-up and run times. Server logs,
our servers' step logs (`NAME-aN-sS.steps.jsonl`, `serve --step-log`; step_log_check.py reads
them) and the agents' files go under `--log-dir`.

The pool, 12,288 tokens (384 blocks) by default, is under pressure at 12 agents (seed 0, on
SmolLM2, 2 cores): in a 210-second run (30 s of warm-up) baseline and hybridserve kept 92% of
the prefix a turn could reuse and vLLM 67% (`prefix_kept`), and vLLM queued 3 to 7 requests at
60-95% KV use. With 16,384 tokens (150-second runs), baseline and hybridserve kept all of it at
4 and at 12 agents, vLLM all at 4 and 84% at 12.

    python benchmarks/e1_real.py --quick [--servers baseline,hybridserve]
    python benchmarks/e1_real.py --tables REPORT     # its markdown tables (docs/e1_real.md)
    python benchmarks/e1_real.py --model smollm2 --agents 12 --seeds 5 --duration 210 \\
        --warmup 30 --vllm-python /tmp/vllm-venv/bin/python --out runs/e1_real.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_checkpoint import hf_checkpoint
from server_process import (
    ServerFailed,
    ServerProcess,
    engine_counters,
    free_port,
    vllm_version,
)

from hybridserve.core.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
)
from hybridserve.sim.stats import paired_ratio

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("baseline", "hybridserve", "vllm")
PAIRS = (("hybridserve", "vllm"), ("baseline", "vllm"), ("hybridserve", "baseline"))
METRICS = (
    "job_goodput_per_hour",
    "output_tokens_per_s",
    "itl_p99_ms",
    "ttft_p99_ms",
    "slo_attainment",
    "cached_tokens_per_turn",
)
GIB = 1 << 30
FLOAT32_BYTES = 4
QUICK = {"agents": [4], "seeds": 2, "duration": 60.0, "warmup": 15.0}


def rotated(servers: list[str], seed: int) -> list[str]:
    """The servers in the order seed `seed` runs them: rotated left by `seed`."""
    if not servers:
        return []
    k = seed % len(servers)
    return servers[k:] + servers[:k]


def vllm_layers_per_block(config: dict[str, Any]) -> int:
    """Layers whose pages make one block of vLLM's shared pool: all of them with one attention
    type, else the smallest type's layer count (the larger one when the counts are within
    1.5x), as vLLM's uniform-page grouping does."""
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types") or ["full_attention"] * layers
    counts = sorted(Counter(types).values())
    smallest, largest = counts[0], counts[-1]
    return largest if largest < smallest * 1.5 else smallest


def kv_bytes_per_block(config: dict[str, Any], block_size: int) -> int:
    """vLLM's bytes per block of its KV pool for this model in float32."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    page = block_size * 2 * kv_heads * head_dim * FLOAT32_BYTES
    return vllm_layers_per_block(config) * page


def vllm_min_blocks(
    config: dict[str, Any], block_size: int, max_model_len: int, max_num_batched_tokens: int
) -> int:
    """The fewest blocks vLLM starts with: every KV group must hold one request of
    `max_model_len` (its start-up check; a pool under it exits with "To serve at least one
    request with the model's max seq len ..."). A full-attention group holds the whole length; a
    sliding-window group the window plus a budget's chunk, and one block more (vLLM's
    SlidingWindowSpec.max_memory_usage_bytes), and the null block besides (vLLM-CPU 0.32 with
    exactly the sum estimated a max length one block short). Groups are
    `vllm_layers_per_block` layers."""
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types") or ["full_attention"] * layers
    per_group = vllm_layers_per_block(config)
    window = config.get("sliding_window")
    total = 0
    for kind, count in Counter(types).items():
        if kind == "sliding_attention" and window:
            tokens = min(int(window) - 1 + max_num_batched_tokens, max_model_len)
            blocks = -(-tokens // block_size) + 1
        else:
            blocks = -(-max_model_len // block_size)
        total += -(-count // per_group) * blocks
    return total + 1


def pool_mapping(config: dict[str, Any], pool_tokens: int, block_size: int) -> dict[str, Any]:
    """The pool every server gets: blocks, tokens, and vLLM's settings for it."""
    if pool_tokens < 2 * block_size:
        raise SystemExit(f"--pool-tokens {pool_tokens}: use at least two blocks of {block_size}")
    num_blocks = pool_tokens // block_size
    per_block = kv_bytes_per_block(config, block_size)
    space_gib = max(1, math.ceil(num_blocks * per_block / GIB))
    return {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "tokens": num_blocks * block_size,
        "usable_tokens": (num_blocks - 1) * block_size,
        "vllm_bytes_per_block": per_block,
        "vllm_layers_per_block": vllm_layers_per_block(config),
        "vllm_cpu_kvcache_space_gib": space_gib,
        "vllm_blocks_in_that_space": space_gib * GIB // per_block,
    }


VLLM_OVERRIDE = re.compile(r"Overriding num_gpu_blocks=(\d+) with num_gpu_blocks_override=(\d+)")
VLLM_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def parse_vllm_pool(log: str) -> dict[str, int | None]:
    """The blocks vLLM's memory would give, the blocks it used, and the tokens it logged."""
    override, tokens = VLLM_OVERRIDE.search(log), VLLM_TOKENS.search(log)
    return {
        "blocks_from_memory": int(override.group(1)) if override else None,
        "num_blocks": int(override.group(2)) if override else None,
        "logged_tokens": int(tokens.group(1).replace(",", "")) if tokens else None,
    }


def preemptions(metrics_text: str) -> float | None:
    """The preemption counter of a Prometheus page (hybridserve's or vLLM's), summed."""
    values = [
        float(line.rsplit(None, 1)[1])
        for line in metrics_text.splitlines()
        if re.match(r"^(hybridserve|vllm):num_preemptions_total\b", line)
    ]
    return sum(values) if values else None


def hybridserve_command(
    args: argparse.Namespace, preset: str, port: int, step_log: Path | None = None
) -> list[str]:
    """Our server's command line; `step_log`: where it logs its steps (`serve --step-log`)."""
    extra = ["--step-log", str(step_log)] if step_log is not None else []
    return [
        sys.executable, "-c", "from hybridserve.cli import main; main()", "serve",
        "--executor", "torch", "--model", str(args.checkpoint), "--device", "cpu",
        "--served-model-name", args.model, "--port", str(port), "--threads", str(args.threads),
        "--preset", preset, "--block-size", str(args.block_size),
        "--num-blocks", str(args.pool["num_blocks"]), "--max-model-len", str(args.max_model_len),
        # vLLM's budget given to both (on a CPU `serve` would otherwise take 2,048)
        "--max-num-batched-tokens", str(DEFAULT_MAX_NUM_BATCHED_TOKENS),
        "--shutdown-timeout", "5", *extra,
    ]  # fmt: skip


def vllm_command(args: argparse.Namespace, port: int) -> list[str]:
    return [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(args.checkpoint), "--served-model-name", args.model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--block-size", str(args.block_size),
        "--num-gpu-blocks-override", str(args.pool["num_blocks"]),
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(DEFAULT_MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(DEFAULT_MAX_NUM_BATCHED_TOKENS),
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
    ]  # fmt: skip


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """vLLM's CPU settings: the KV space (whole GiB) holding the pool, `--threads` OpenMP
    threads with no core reserved for the front end, and no AOT compile cache (on torch 2.13
    its load fails and every start compiled again)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(args.pool["vllm_cpu_kvcache_space_gib"]),
        "OMP_NUM_THREADS": str(args.threads),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_USE_AOT_COMPILE": "0",
    }


def server_process(args: argparse.Namespace, name: str, load: int, seed: int) -> ServerProcess:
    port = free_port()
    log = args.log_dir / f"{name}-a{load}-s{seed}.log"
    if name == "vllm":
        return ServerProcess(name, vllm_command(args, port), log, port, env=vllm_env(args))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    steps = args.log_dir / f"{name}-a{load}-s{seed}.steps.jsonl"
    command = hybridserve_command(args, name, port, steps)
    return ServerProcess(name, command, log, port, env=env)


def agents_command(
    args: argparse.Namespace, url: str, load: int, seed: int, out: Path
) -> list[str]:
    return [
        sys.executable, "-c", "from hybridserve.cli import main; main()", "agents",
        "--url", url, "--model", args.model, "--agents", str(load),
        "--duration", str(args.duration), "--warmup", str(args.warmup), "--seed", str(seed),
        "--time-scale", str(args.time_scale),
        "--system-prompt-tokens", str(args.system_prompt_tokens),
        "--max-context", str(args.max_context), "--output-tokens", str(args.output_tokens),
        "--tool-result-tokens", str(args.tool_result_tokens), "--out", str(out), "--json",
        "--answers", args.answers,
    ]  # fmt: skip


def run_load_command(args: argparse.Namespace, command: list[str]) -> dict[str, Any]:
    """Run a load generator's command line (`hybridserve agents ... --json`): its JSON report,
    or {"error": ...} with the tail of its output."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=env,
            timeout=args.duration + 180,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"agents ran past --duration + 180 s ({args.duration + 180:.0f} s)"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"agents exited with {done.returncode}: {done.stderr.strip()[-800:]}"}
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def one_run(args: argparse.Namespace, name: str, load: int, seed: int) -> dict[str, Any]:
    """Start `name` fresh, run the agents against it, read its preemptions, stop it."""
    server = server_process(args, name, load, seed)
    entry: dict[str, Any] = {"server": name, "agents": load, "seed": seed}
    out = args.log_dir / f"{name}-a{load}-s{seed}"
    if not serve_and_load(
        args, server, entry, lambda url: agents_command(args, url, load, seed, out)
    ):
        return entry
    if (out / "requests.jsonl").is_file():
        entry["requests_file"] = str(out / "requests.jsonl")
        rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
        entry["prefix_kept"] = prefix_kept(rows, args.block_size, args.system_prompt_tokens)
    if name == "vllm":
        entry["vllm_pool"] = parse_vllm_pool(server.log_path.read_text(errors="replace"))
    return entry


def serve_and_load(
    args: argparse.Namespace,
    server: ServerProcess,
    entry: dict[str, Any],
    command: Callable[[str], list[str]],
) -> bool:
    """Start `server`, run the load generator's `command(base_url)` against it, read its
    preemptions (and our engine's counters) from `/metrics`, stop it; all into `entry`
    (`failed` with the log's tail when it does not start). Returns whether it started."""
    try:
        entry["startup_s"] = round(server.start(args.start_timeout), 1)
    except ServerFailed as exc:
        entry["failed"] = {"reason": exc.reason, "log_tail": exc.log_tail}
        print(f"  {exc}; its log ends:\n{exc.log_tail}", file=sys.stderr, flush=True)
        return False
    try:
        began = time.monotonic()
        entry["metrics"] = run_load_command(args, command(server.base_url))
        entry["agents_wall_s"] = round(time.monotonic() - began, 1)
        try:
            page = httpx.get(f"{server.base_url}/metrics", timeout=10).text
            entry["server_preemptions"] = preemptions(page)
            if server.name != "vllm":
                entry["engine_counters"] = engine_counters(page)
        except httpx.HTTPError as exc:
            entry["server_preemptions"] = None
            entry["metrics_error"] = str(exc)
    finally:
        server.stop()
    return True


def per_seed(
    runs: list[dict[str, Any]], server: str, load: int, seeds: list[int], key: str
) -> list[float | None]:
    """`key` of `server`'s run at `load` for each seed (None where it failed or is missing)."""
    found = {
        r["seed"]: r.get("metrics", {}).get(key)
        for r in runs
        if r["server"] == server and r["agents"] == load
    }
    return [found.get(seed) for seed in seeds]


def load_ratios(
    runs: list[dict[str, Any]], load: int, seeds: list[int], servers: list[str]
) -> dict[str, Any]:
    """Per pair of servers that ran, per metric: the paired ratio and both sides' values."""
    out: dict[str, Any] = {}
    for ours, base in PAIRS:
        if ours in servers and base in servers:
            out[f"{ours}/{base}"] = {
                key: paired_metric(runs, load, seeds, ours, base, key) for key in METRICS
            }
    return out


def paired_metric(
    runs: list[dict[str, Any]], load: int, seeds: list[int], ours: str, base: str, key: str
) -> dict[str, Any]:
    """`key` of `ours` over `base`, seed by seed: the paired ratio and both sides' values."""
    mine, theirs = per_seed(runs, ours, load, seeds, key), per_seed(runs, base, load, seeds, key)
    return {**paired_ratio(mine, theirs), ours: mine, base: theirs}


def turn_agreement(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """Cached prompt tokens of the same requests (same id: same prompt on one seed) on two
    servers, over the requests both finished: how many, the fraction equal, the mean absolute
    difference and both sides' means."""
    mine = {r["id"]: r["cached_tokens"] for r in ours if r.get("cached_tokens") is not None}
    both = [
        (mine[r["id"]], r["cached_tokens"])
        for r in theirs
        if r.get("cached_tokens") is not None and r["id"] in mine
    ]
    if not both:
        return {"compared": 0, "equal_fraction": None}
    return {
        "compared": len(both),
        "equal_fraction": round(sum(a == b for a, b in both) / len(both), 4),
        "mean_abs_difference": round(statistics.fmean(abs(a - b) for a, b in both), 2),
        "mean": [round(statistics.fmean(side), 2) for side in zip(*both, strict=True)],
    }


def prefix_kept(rows: list[dict[str, Any]], block_size: int, system_tokens: int) -> dict[str, Any]:
    """How much of the reusable prefix the server still had, over its finished turns: a turn's
    ideal hit is its job's previous prompt in whole blocks (a job's first turn: the shared
    system prompt, after the run's first request), at most its own prompt less one token in
    whole blocks. `cached_over_ideal` below 1 means evicted prefixes (pool pressure); above 1,
    hits past a block boundary (exact tails)."""
    previous: dict[str | None, int] = {}
    cached = ideal = short = turns = 0
    for index, row in enumerate(rows):
        session, length = row.get("session"), int(row["prompt_tokens"])
        reusable = previous.get(session, system_tokens if index else 0)
        previous[session] = length
        if row.get("cached_tokens") is None:
            continue
        best = min(reusable // block_size, (length - 1) // block_size) * block_size
        turns += 1
        cached += row["cached_tokens"]
        ideal += best
        short += row["cached_tokens"] < best
    return {
        "turns": turns,
        "ideal_tokens_per_turn": round(ideal / turns, 1) if turns else None,
        "cached_over_ideal": round(cached / ideal, 4) if ideal else None,
        "turns_short_of_ideal": short,
    }


def requests_of(runs: list[dict[str, Any]], server: str, load: int, seed: int) -> list[Any]:
    """The per-request rows of one run (empty when it wrote none)."""
    for r in runs:
        if (r["server"], r["agents"], r["seed"]) == (server, load, seed) and "requests_file" in r:
            lines = Path(r["requests_file"]).read_text().splitlines()
            return [json.loads(line) for line in lines]
    return []


def cache_exactness(runs: list[dict[str, Any]], load: int, seeds: list[int]) -> dict[str, Any]:
    """Baseline (vLLM 0.33's schedule and cache) against vLLM: per seed, the cached prompt
    tokens of the turns both finished (`turn_agreement`: `mean` is [baseline, vllm]), and
    each run's means over its own finished turns (these differ when one server finishes more,
    and longer, turns than the other)."""
    per_turn = [
        turn_agreement(requests_of(runs, "baseline", load, s), requests_of(runs, "vllm", load, s))
        for s in seeds
    ]
    compared = sum(t["compared"] for t in per_turn)
    equal = sum(t["compared"] * (t["equal_fraction"] or 0.0) for t in per_turn)
    out: dict[str, Any] = {
        "per_turn": per_turn,
        "per_turn_equal_fraction": round(equal / compared, 4) if compared else None,
    }
    for key in ("cached_tokens_per_turn", "prompt_tokens_per_turn", "prefix_hit_rate"):
        sides = {s: per_seed(runs, s, load, seeds, key) for s in ("baseline", "vllm")}
        means = {
            s: round(statistics.fmean(v), 2) if (v := [x for x in vals if x is not None]) else None
            for s, vals in sides.items()
        }
        out[key] = {"per_seed": sides, "mean": means}
    return out


def timings(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per server: mean start-up seconds, agents seconds, and their sum per run."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["server"] for r in runs):
        mine = [r for r in runs if r["server"] == name and "startup_s" in r]
        if not mine:
            continue
        start = statistics.fmean(r["startup_s"] for r in mine)
        agents = statistics.fmean(r.get("agents_wall_s", 0.0) for r in mine)
        out[name] = {
            "startup_s": round(start, 1),
            "agents_s": round(agents, 1),
            "per_run_s": round(start + agents, 1),
        }
    return out


def add_engine_options(add: Callable[..., Any]) -> None:
    """The options of every real run (e1_real.py's and trace_real.py's): its length, the servers
    and the pool, block size, context and threads they all get."""
    add("--duration", type=float, default=210.0, help="seconds per run, warm-up included")
    add("--warmup", type=float, default=30.0)
    add("--servers", type=_names, default=list(SERVERS), help="baseline,hybridserve,vllm")
    add("--vllm-python", default="/tmp/vllm-venv/bin/python")
    add("--pool-tokens", type=int, default=12_288, help="the KV pool of every server")
    add("--block-size", type=int, default=32)
    add("--max-model-len", type=int, default=8_192)
    add("--threads", type=int, default=len(os.sched_getaffinity(0)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", default="smollm2", choices=("smollm2", "gemma3-270m"))
    add("--agents", type=_ints, default=[4, 8, 12], help="loads, e.g. 4,8,12")
    add(
        "--seeds",
        type=int,
        default=5,
        help="N seeds from --first-seed (5 or more for the real run)",
    )
    add("--first-seed", type=int, default=0, help="the first seed [default: 0]")
    add("--merge", type=Path, action="append", default=[],
        help="an earlier report of this workload; its runs join these")  # fmt: skip
    add_engine_options(add)
    add("--time-scale", type=float, default=0.2)
    add("--system-prompt-tokens", type=int, default=1_000)
    add("--max-context", type=int, default=6_000)
    add("--output-tokens", type=float, default=32)
    add("--tool-result-tokens", type=float, default=150)
    add(
        "--answers",
        default="synthetic",
        choices=("synthetic", "server"),
        help="what a job appends after each answer (agents --answers)",
    )
    add("--start-timeout", type=float, default=600.0)
    add("--log-dir", type=Path, default=ROOT / "runs" / "e1_real_logs")
    add("--out", type=Path, default=None, help="also write the report here")
    add("--quick", action="store_true", help="smoke: 4 agents, 2 seeds, 60 s runs (15 s warm-up)")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.seeds < 1 and not (args.seeds == 0 and args.merge):
        parser.error(f"--seeds {args.seeds}: use 1 or more (0 only to --merge reports)")
    if args.first_seed < 0:
        parser.error(f"--first-seed {args.first_seed}: use 0 or more")
    if not args.duration > args.warmup >= 0:
        parser.error(f"--duration {args.duration} must exceed --warmup {args.warmup} >= 0")
    return args


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give loads of 1 or more, e.g. 4,8,12")
    return values


def _names(text: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    unknown = [n for n in names if n not in SERVERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: use some of {','.join(SERVERS)}")
    return list(dict.fromkeys(names))


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Checkpoint, pool and the servers that can run; the report's setup."""
    args.checkpoint = hf_checkpoint(args.model)
    config = json.loads((args.checkpoint / "config.json").read_text())
    args.pool = pool_mapping(config, args.pool_tokens, args.block_size)
    setup: dict[str, Any] = {
        k: str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
        if k not in ("pool", "quick", "merge", "first_seed")
    }
    setup["quick"] = args.quick
    if "vllm" in args.servers:
        version, why_not = vllm_version(args.vllm_python)
        setup["vllm_version"] = version
        if why_not is not None:
            setup["vllm_skipped"] = why_not
            args.servers = [s for s in args.servers if s != "vllm"]
            print(f"vllm skipped: {why_not}", file=sys.stderr, flush=True)
    floor = vllm_min_blocks(
        config, args.block_size, args.max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS
    )
    args.pool["vllm_min_blocks"] = floor
    if "vllm" in args.servers and args.pool["num_blocks"] < floor:
        raise SystemExit(
            f"--pool-tokens {args.pool_tokens}: {args.pool['num_blocks']} blocks, and vLLM "
            f"refuses to start {args.model} with fewer than {floor} at --max-model-len "
            f"{args.max_model_len} (every KV group must hold one request of that length); "
            f"use --pool-tokens {floor * args.block_size} or more, or a smaller --max-model-len"
        )
    return setup


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    total = len(args.agents) * args.seeds * len(args.servers)
    for load in args.agents:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for name in rotated(args.servers, seed):
                print(
                    f"run {len(runs) + 1}/{total}: {name}, {load} agents, seed {seed}",
                    file=sys.stderr,
                    flush=True,
                )
                runs.append(entry := timed(one_run, args, name, load, seed))
                _say(entry)
    return runs


def timed(run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`run(*args)`'s entry with when it ran, `began` and `ended` (ISO times): a calibration's
    drift over a set is read against them (fidelity.py --calibrations-after)."""
    began = datetime.now().astimezone().isoformat(timespec="seconds")
    entry = run(*args)
    entry["began"] = began
    entry["ended"] = datetime.now().astimezone().isoformat(timespec="seconds")
    return entry


def _say(entry: dict[str, Any]) -> None:
    metrics = entry.get("metrics", {})
    if "failed" in entry or "error" in metrics:
        return
    print(
        f"  start {entry['startup_s']} s; jobs/h {metrics.get('job_goodput_per_hour')}, "
        f"tok/s {metrics.get('output_tokens_per_s')}, cached/turn "
        f"{metrics.get('cached_tokens_per_turn')}, cached/ideal "
        f"{entry.get('prefix_kept', {}).get('cached_over_ideal')}, "
        f"preemptions {entry.get('server_preemptions')}",
        file=sys.stderr,
        flush=True,
    )


TABLE_COLUMNS = (  # (metric, heading, divisor)
    ("requests_completed", "requests done", 1.0),
    ("job_goodput_per_hour", "jobs/h", 1.0),
    ("output_tokens_per_s", "output tok/s", 1.0),
    ("ttft_p50_ms", "TTFT p50 s", 1000.0),
    ("ttft_p99_ms", "TTFT p99 s", 1000.0),
    ("itl_p50_ms", "ITL p50 ms", 1.0),
    ("itl_p99_ms", "ITL p99 s", 1000.0),
    ("cached_tokens_per_turn", "cached tokens/turn", 1.0),
    ("prefix_hit_rate", "hit rate", 1.0),
)


def _fmt(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return f"{value:,.{digits}f}"


def markdown_tables(report: dict[str, Any]) -> str:
    """Per load: each server's means over the seeds (per seed in brackets), then the paired
    ratios with their 95% intervals: the tables of docs/e1_real.md."""
    out: list[str] = []
    for load, ratios in report["ratios"].items():
        listed = report["setup"]["seeds"]
        seeds = listed[load] if isinstance(listed, dict) else list(range(listed))
        out += [f"### {load} agents, seeds {', '.join(map(str, seeds))}", ""]
        out.append("| server | " + " | ".join(h for _, h, _ in TABLE_COLUMNS) + " |")
        out.append("|---" * (1 + len(TABLE_COLUMNS)) + "|")
        for server in SERVERS:
            if not any(r["server"] == server and str(r["agents"]) == load for r in report["runs"]):
                continue
            cells = []
            for key, _, div in TABLE_COLUMNS:
                values = [
                    None if v is None else v / div
                    for v in per_seed(report["runs"], server, int(load), seeds, key)
                ]
                kept = [v for v in values if v is not None]
                mean = statistics.fmean(kept) if kept else None
                cells.append(
                    f"{_fmt(mean)} [{', '.join(_fmt(v) for v in values)}]" if kept else "-"
                )
            out.append(f"| {server} | " + " | ".join(cells) + " |")
        out += [
            "",
            "| paired ratio | " + " | ".join(METRICS) + " |",
            "|---" * (1 + len(METRICS)) + "|",
        ]
        for pair, metrics in ratios.items():
            cells = []
            for key in METRICS:
                r = metrics[key]
                ci = "" if r["ci95"] is None else f" [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"
                cells.append("-" if r["mean"] is None else f"{r['mean']:.2f}{ci}")
            out.append(f"| {pair} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--tables":
        print(markdown_tables(json.loads(Path(sys.argv[2]).read_text())))
        return
    args = parse_args(argv)
    setup = prepare(args)
    began = time.monotonic()
    earlier = [merged_runs(path, setup) for path in args.merge]
    runs = [run for part in earlier for run in part] + run_all(args)
    report = summarise(setup, args.pool, runs)
    report["wall_s"] = round(time.monotonic() - began, 1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


# The settings that make two reports one workload; a merged report must match on every one.
WORKLOAD_KEYS = (
    "model", "duration", "warmup", "pool_tokens", "block_size", "max_model_len", "threads",
    "time_scale", "system_prompt_tokens", "max_context", "output_tokens", "tool_result_tokens",
    "answers",
)  # fmt: skip
# What a report written before a key existed ran with.
WORKLOAD_DEFAULTS = {"answers": "synthetic"}


def merged_runs(path: Path, setup: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs of an earlier report, checked to be the same workload as this one."""
    try:
        earlier = json.loads(path.read_text())
        theirs = earlier["setup"]
        runs = list(earlier["runs"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"--merge {path}: not an e1_real report ({err})") from None

    def value(settings: dict[str, Any], key: str) -> Any:
        return settings.get(key, WORKLOAD_DEFAULTS.get(key))

    differ = [k for k in WORKLOAD_KEYS if value(theirs, k) != value(setup, k)]
    if differ:
        pairs = ", ".join(f"{k} {value(theirs, k)!r} here {value(setup, k)!r}" for k in differ)
        raise SystemExit(f"--merge {path}: another workload ({pairs}); rerun with its settings")
    return runs


def summarise(
    setup: dict[str, Any], pool: dict[str, Any], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """The report of a set of runs: paired ratios and cache exactness per load, over every seed
    run at that load (a merged report's seeds included); a (server, load, seed) run twice is an
    error."""
    keys = [(r["server"], r["agents"], r["seed"]) for r in runs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise SystemExit(f"runs given twice (server, agents, seed): {twice}; merge each once")
    loads = sorted({r["agents"] for r in runs})
    servers = [s for s in SERVERS if any(r["server"] == s for r in runs)]
    seeds = {n: sorted({r["seed"] for r in runs if r["agents"] == n}) for n in loads}
    setup = setup | {"agents": loads, "seeds": {str(n): seeds[n] for n in loads}}
    return {
        "setup": setup,
        "pool": pool,
        "runs": runs,
        "ratios": {str(n): load_ratios(runs, n, seeds[n], servers) for n in loads},
        "cache_exactness": {str(n): cache_exactness(runs, n, seeds[n]) for n in loads}
        if {"baseline", "vllm"} <= set(servers)
        else None,
        "failed_runs": [
            {k: r[k] for k in ("server", "agents", "seed")} | {"reason": r["failed"]["reason"]}
            for r in runs
            if "failed" in r
        ],
        "timings": timings(runs),
    }


if __name__ == "__main__":
    main()
