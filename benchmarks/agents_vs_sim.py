"""One server against its simulator, in one go: calibrate it over HTTP, run the E1 agents
against it on several seeds, simulate the same workload on the same seeds with that
calibration, and print the measured and simulated metrics side by side.

Works against any OpenAI-compatible server the machine can reach (a vLLM on a GPU, `hybridserve
serve`). Prints one JSON object on its last line, rows in docs/fidelity.json's shape:
`{"engine", "load", "metric", "measured", "simulated", "error", "scored"}` with `error =
simulated / measured - 1` (means over the seeds); `scored` is false for every row (the caller
decides which loads it calibrated on).

    python benchmarks/agents_vs_sim.py --url http://127.0.0.1:8000 --gpu-name H100-SXM \\
        --model-config /path/to/config.json --preset baseline --engine vllm --seeds 0,1,2 \\
        --agents 20 --duration 900 --warmup 120 [--calibration FILE] [--quick]

The simulated agents append synthetic answer tokens as the load generator does (so neither side
reuses an answer's KV next turn). Known differences the comparison keeps (docs/agents.md): the
simulator sizes the KV pool by vLLM's rule for the calibrated device, the server has its own
pool (benchmarks/fidelity.py gives both the same one); and the simulator has no HTTP or
detokenisation term (the calibration's `black_box.request_overhead_s` measures it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridserve.loadgen.calibrate import (
    REMOTE_GRID,
    REMOTE_QUICK_GRID,
    RemoteTarget,
    calibrate_remote,
    device_for,
    model_profile_for,
)
from hybridserve.loadgen.run import LoadConfig, run_load
from hybridserve.sim.calibration import Calibration
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.run import run_simulation
from hybridserve.sim.workload import AgentParams

METRICS = (
    "job_goodput_per_hour",
    "output_tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "prefix_hit_rate",
    "slo_attainment",
)


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", help="The served name [default: the first /v1/models lists].")
    parser.add_argument("--api-key")
    parser.add_argument("--model-config", type=Path, help="The served model's config.json.")
    parser.add_argument("--gpu-name", default="H200")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--peaks-from", type=Path)
    parser.add_argument("--calibration", type=Path, help="Skip calibrating: use this file.")
    parser.add_argument("--quick", action="store_true", help="The quick calibration grid.")
    parser.add_argument("--preset", default="baseline", help="The simulated scheduler.")
    parser.add_argument("--engine", default="server", help="The rows' engine label.")
    parser.add_argument("--load", default=None, help="The rows' load label [default: agents].")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--system-prompt-tokens", type=int, default=12_000)
    parser.add_argument("--max-context", type=int, default=131_072)
    parser.add_argument("--output-tokens", type=float)
    parser.add_argument("--tool-result-tokens", type=float)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--out", type=Path, help="Also write the report here.")
    return parser.parse_args()


def _agents(args: argparse.Namespace) -> AgentParams:
    """The workload both sides run; tool times scaled as the load generator scales its waits."""
    return (
        AgentParams(
            num_agents=args.agents,
            system_prompt_tokens=args.system_prompt_tokens,
            context_limit=args.max_context,
        )
        .with_medians(output_tokens=args.output_tokens, tool_result_tokens=args.tool_result_tokens)
        .with_tool_times_scaled(args.time_scale)
    )


def _calibration(args: argparse.Namespace) -> Path:
    if args.calibration is not None:
        return Path(args.calibration)
    gpu, peaks = device_for(args.gpu_name, args.peaks_from)
    target = RemoteTarget(
        url=args.url,
        model=args.model,
        api_key=args.api_key,
        gpu=gpu,
        peaks=peaks,
        profile=model_profile_for(args.model_config, args.model),
        dtype=args.dtype,
        kv_dtype=args.dtype if args.dtype in ("bf16", "fp32") else "bf16",
        vocab_size=args.vocab_size,
    )
    grid = REMOTE_QUICK_GRID if args.quick else REMOTE_GRID
    result = asyncio.run(calibrate_remote(target, grid=grid))
    path = Path("runs") / "calibration" / f"{args.engine}-remote.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    print(f"calibration: {path}", file=sys.stderr)
    return path


def _measured(args: argparse.Namespace, agents: AgentParams, seed: int) -> dict[str, float]:
    # The load generator scales drawn tool times by --time-scale itself: give it E1's.
    unscaled = replace(
        agents,
        tool_time_fast=AgentParams().tool_time_fast,
        tool_time_slow=AgentParams().tool_time_slow,
    )
    config = LoadConfig(
        url=args.url,
        model=args.model,
        api_key=args.api_key,
        seed=seed,
        duration_s=args.duration,
        warmup_s=args.warmup,
        time_scale=args.time_scale,
        vocab_size=args.vocab_size,
    )
    return asyncio.run(run_load(config, agents=unscaled)).summary


def _simulated(
    args: argparse.Namespace, agents: AgentParams, seed: int, calibration: Calibration
) -> dict[str, float]:
    config = SimConfig(
        model=args.model or "custom",
        model_config=None if args.model_config is None else str(args.model_config),
        gpu=calibration.device,
        calibrated_gpu=calibration.gpu,
        efficiency=calibration.efficiency,
        dtype=calibration.dtype,
        kv_dtype=calibration.kv_dtype,
        preset=args.preset,
        speculation="none",
        duration_s=args.duration,
        warmup_s=args.warmup,
        seed=seed,
        agents=agents,
        answers="synthetic",
    )
    return dict(run_simulation(config).summary)


def _mean(values: list[float]) -> float | None:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.fmean(kept) if kept else None


def main() -> None:
    args = _args()
    agents = _agents(args)
    path = _calibration(args)
    calibration = Calibration.load(path)
    seeds = [int(s) for s in args.seeds.split(",")]
    measured, simulated = [], []
    for seed in seeds:
        print(f"seed {seed}: agents against {args.url}", file=sys.stderr)
        measured.append(_measured(args, agents, seed))
        print(f"seed {seed}: the simulator", file=sys.stderr)
        simulated.append(_simulated(args, agents, seed, calibration))
    rows: list[dict[str, Any]] = []
    for metric in METRICS:
        m = _mean([run.get(metric, math.nan) for run in measured])
        s = _mean([run.get(metric, math.nan) for run in simulated])
        error = None if m is None or s is None or m == 0 else s / m - 1
        rows.append(
            {
                "engine": args.engine,
                "load": args.load or f"agents={args.agents}",
                "metric": metric,
                "measured": m,
                "simulated": s,
                "error": error,
                "scored": False,
            }
        )
    report = {"calibration": str(path), "seeds": seeds, "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    for row in rows:
        err = "-" if row["error"] is None else f"{row['error']:+.1%}"
        print(f"{row['metric']:>24}  {row['measured']}  {row['simulated']}  {err}", file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
