"""Reload or recompute: what bringing a prefix back from the host tier costs against computing
it again, for every model profile on every GPU of the catalog. Prints one JSON object (and
writes it with --out).

For a prefix of about `--tokens` tokens (whole blocks of the model's largest group) after
`--context` cached tokens: `reload_ms`, every cache group's blocks of it over the host link at
its measured rate (`sim/host_link.py`: PCIe Gen5 at 50 of 64 GB/s, NVLink-C2C on GH200), one
way, none of it hidden beside a forward; `recompute_ms`, the cost model's prefill of those
tokens after the context, less the step's own fixed part (a prefill of one token after the
same context): the marginal compute, as if the step ran anyway. `ratio` = recompute / reload.
The host tier always reloads: this is the arithmetic that says so.

    python benchmarks/host_reload_vs_recompute.py --out docs/host_reload_vs_recompute.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.sim.cost_model import StepShape
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.gpus import GPUS
from hybridserve.sim.model_profiles import MODELS
from hybridserve.sim.run import resolve_deployment, simulated_cost_model, simulated_host_link


def _row(model: str, gpu: str, *, tokens: int, context: int) -> dict[str, Any] | None:
    """One model on one GPU (None where the catalog cannot serve it: fp8 on an A100)."""
    dtype = "bf16" if gpu == "A100-80G" else "fp8"
    config = SimConfig(
        model=model, gpu=gpu, dtype=dtype, preset="baseline", speculation="none", host_memory_gib=1
    )
    try:
        resolved = resolve_deployment(config)
        link, _ = simulated_host_link(resolved)
        cost = simulated_cost_model(resolved)
    except ConfigError:
        return None
    groups = resolved.model.cache_groups()
    unit = max(g.block_size for g in groups)
    n = -(-tokens // unit) * unit
    blocks = sum(-(-n // g.block_size) for g in groups)
    reload_s = blocks * link.bytes_per_block / (link.bytes_per_s * link.efficiency)
    step = cost.step_cost(StepShape.prefill(n, context_tokens=context)).total_s
    fixed = cost.step_cost(StepShape.prefill(1, context_tokens=context)).total_s
    recompute_s = step - fixed
    return {
        "model": model,
        "gpu": gpu,
        "dtype": dtype,
        "tokens": n,
        "context_tokens": context,
        "blocks": blocks,
        "reload_ms": round(reload_s * 1e3, 3),
        "recompute_ms": round(recompute_s * 1e3, 3),
        "ratio": round(recompute_s / reload_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2_048, help="Prefix tokens (rounded up).")
    parser.add_argument(
        "--contexts", default="0,32768", help="Cached tokens before the prefix, comma-separated."
    )
    parser.add_argument("--out", type=Path, help="Also write the JSON here.")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [
        row
        for model in MODELS
        for gpu in GPUS
        for context in contexts
        if (row := _row(model, gpu, tokens=args.tokens, context=context)) is not None
    ]
    lowest = min(rows, key=lambda r: r["ratio"])
    report = {"tokens": args.tokens, "contexts": contexts, "lowest": lowest, "rows": rows}
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
