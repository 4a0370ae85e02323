"""The agent-aware controls on paired seeds: each one added to a reference preset, with the
paired ratios (control / reference, geometric mean of per-seed ratios, 95% t interval on the
log scale), preemptions, hit rates and the pin counters. Prints one JSON object.

The controls only matter under memory pressure: at the default pool (`--gmu 0.9`) 20 and 40
agents see no preemption, and pinning changes nothing measurable. `--gmu 0.66` shrinks the pool
until the baseline preempts:

    python benchmarks/agent_controls.py --agents 40 --seeds 2 --duration 360 --warmup 90 \\
        --gmu 0.66 --workers 2

`--tuned FILE` makes the reference the vllm-tuned baseline (the baseline preset with the vLLM
setting of a stored `sweep --space vllm` search); each control is added on top of its knobs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.experiment import paired_report, read_tuned, run_configs
from hybridserve.sim.workload import AgentParams

CONTROLS: dict[str, dict[str, Any]] = {
    "pin": {"kv_pin_fraction": 0.3},
    "pin-tail": {"kv_pin_fraction": 0.5, "kv_pin_exact_tail": True},
    "kv-admission": {"kv_aware_admission": True},
    "plas": {"program_priority": "plas"},
    "program-fcfs": {"program_priority": "fcfs"},
}
KEYS = ("job_goodput_per_hour", "itl_p99_ms", "ttft_p99_ms", "prefix_hit_rate", "preemptions")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="baseline")
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=360.0)
    parser.add_argument("--warmup", type=float, default=90.0)
    parser.add_argument("--gmu", type=float, default=0.9, help="gpu_memory_utilization")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=list(CONTROLS), choices=list(CONTROLS))
    parser.add_argument(
        "--tuned",
        type=Path,
        default=None,
        help="reference = vllm-tuned: the vLLM setting of this search (sweep --space vllm --json)",
    )
    args = parser.parse_args()
    if args.seeds < 2:
        parser.error("--seeds: a paired interval needs at least 2 seeds")
    if args.tuned is not None and args.preset != "baseline":
        parser.error("--tuned: the vllm-tuned reference is the baseline preset; drop --preset")
    base = SimConfig(
        preset=args.preset,
        duration_s=args.duration,
        warmup_s=args.warmup,
        agents=AgentParams(num_agents=args.agents),
        gpu_memory_utilization=args.gmu,
    )
    reference, search = args.preset, None
    if args.tuned is not None:
        base, search = read_tuned(base, args.tuned)
        reference = "vllm-tuned"
    configs = {reference: base}
    for label in args.only:
        overrides = {**dict(base.overrides), **CONTROLS[label]}
        configs[label] = replace(base, overrides=tuple(sorted(overrides.items())))
    seeds = list(range(args.seeds))
    results, _ = run_configs(configs, seeds, workers=args.workers)
    out: dict[str, Any] = {"preset": args.preset, "agents": args.agents, "seeds": seeds}
    out["gmu"] = args.gmu
    out["reference"] = reference
    out["vllm_tuned"] = search
    for label, rows in results.items():
        report = paired_report(
            {reference: results[reference], label: rows},
            baseline=reference,
            ours=label,
            bounds=(),
        )
        entry: dict[str, Any] = {key: report[label][key] for key in KEYS}
        if label != reference:
            entry["ratios"] = report["ratios"]
        pins = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k.startswith("kv_pins")}
        if pins:
            entry["pins"] = pins
        out[label] = entry
    print(json.dumps(out))


if __name__ == "__main__":
    main()
