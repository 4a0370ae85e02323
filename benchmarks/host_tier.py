"""Jobs against host memory: hybridserve's host tier and vLLM 0.33's own CPU offloading at the
same host memory, on the agents workload, paired seeds. Prints one JSON object (and writes it
with --out).

For each host size S (GiB over the engine's TP ranks; 0 = no tier):

* `hybridserve@S`: the shipped preset with a host tier that keeps what the device evicts
  (every group: full-attention blocks and the states a turn resumes from);
* `vllm-tuned-offload@S`: the tuned vLLM (the stored `sweep --space vllm` result, `--tuned`)
  with vLLM's offloading connector modelled (every computed prompt block written through).

Both load the same way (prefetched beside the steps, a waiting request admitted once its
blocks are back): they differ in what they store. The free-prefill bound runs once (it does
not depend on the host). Per size, hybridserve's paired ratios to the vLLM side.

    python benchmarks/host_tier.py --agents 80 --sizes 0,64,256,1024 --seeds 2 \\
        --duration 2400 --warmup 600 --workers 2 --out docs/host_tier.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.experiment import paired_report, read_tuned, run_configs
from hybridserve.sim.stats import paired_ratio
from hybridserve.sim.workload import AgentParams

KEYS = (
    "job_goodput_per_hour",
    "slo_jobs_per_hour",
    "slo_attainment",
    "itl_p99_ms",
    "ttft_p50_ms",
    "prefix_hit_rate",
    "host_hit_rate",
    "recomputed_prompt_tokens_per_turn",
    "preemptions",
    "host_loaded",
    "host_saved",
)


def _configs(args: argparse.Namespace) -> dict[str, SimConfig]:
    base = SimConfig(
        agents=AgentParams(num_agents=args.agents),
        duration_s=args.duration,
        warmup_s=args.warmup,
    )
    configs: dict[str, SimConfig] = {}
    for size in args.sizes:
        configs[f"hybridserve@{size:g}"] = SimConfig(
            **{**_fields(base), "preset": "hybridserve", "host_memory_gib": size}
        )
        vllm = SimConfig(
            **{
                **_fields(base),
                "preset": "baseline",
                "host_memory_gib": size,
                "host_write_through": size > 0,
            }
        )
        configs[f"vllm-tuned-offload@{size:g}"] = read_tuned(vllm, args.tuned)[0]
    configs["free-prefill"] = SimConfig(
        **{**_fields(configs[f"vllm-tuned-offload@{args.sizes[0]:g}"]), "bound": "free-prefill"}
    )
    return configs


def _fields(config: SimConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def _means(runs: list[dict[str, float]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in KEYS:
        values = [r[key] for r in runs if key in r and not math.isnan(r[key])]
        out[key] = round(statistics.fmean(values), 4) if values else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=80)
    parser.add_argument(
        "--sizes", type=lambda t: [float(x) for x in t.split(",")], default=[0, 64, 256, 1024]
    )
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=2400.0)
    parser.add_argument("--warmup", type=float, default=600.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tuned", type=Path, default=Path("docs/sweep_vllm_e1_20_agents.json"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.seeds < 2:
        parser.error("--seeds: a paired interval needs at least 2 seeds")
    started = time.perf_counter()
    seeds = list(range(args.seeds))
    results, _ = run_configs(_configs(args), seeds, workers=args.workers)
    bound = statistics.fmean(r["job_goodput_per_hour"] for r in results["free-prefill"])
    rows = []
    for size in args.sizes:
        ours, theirs = f"hybridserve@{size:g}", f"vllm-tuned-offload@{size:g}"
        ratios = paired_report(
            {theirs: results[theirs], ours: results[ours]}, baseline=theirs, ours=ours, bounds=()
        )["ratios"]
        # Jobs whose turns all kept the SLO (the suite's goodput for agent rows).
        ratios["slo_jobs"] = paired_ratio(
            [r["slo_jobs_per_hour"] for r in results[ours]],
            [r["slo_jobs_per_hour"] for r in results[theirs]],
        )
        rows.append(
            {
                "host_memory_gib": size,
                "hybridserve": _means(results[ours]),
                "vllm_tuned_offload": _means(results[theirs]),
                "hybridserve_of_free_prefill": round(
                    statistics.fmean(r["job_goodput_per_hour"] for r in results[ours]) / bound, 4
                ),
                "ratios": ratios,
                "per_seed_jobs": {
                    "hybridserve": [r["job_goodput_per_hour"] for r in results[ours]],
                    "vllm_tuned_offload": [r["job_goodput_per_hour"] for r in results[theirs]],
                },
                "per_seed_slo_jobs": {
                    "hybridserve": [r["slo_jobs_per_hour"] for r in results[ours]],
                    "vllm_tuned_offload": [r["slo_jobs_per_hour"] for r in results[theirs]],
                },
            }
        )
    report = {
        "setup": {
            "agents": args.agents,
            "seeds": seeds,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "tuned": str(args.tuned),
            "model": "qwen3-next-80b-a3b on a simulated H200 (fp8, tp 1)",
        },
        "free_prefill_jobs_per_hour": round(bound, 4),
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(report)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
