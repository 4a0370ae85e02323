"""A real server's steps against the simulator's, step by step: where a fidelity error comes
from (docs/fidelity.md).

Input: an `e1_real.py` report (or a `trace_real.py` one: `--time-scale` picks its load), one of
its hybridserve runs (`--server`, `--seed`) whose server wrote a step log (`serve --step-log`;
e1_real.py writes `LOG_DIR/NAME-aN-sS.steps.jsonl`, trace_real.py `NAME-atsX-sS.steps.jsonl`),
and a calibration of that server (`fidelity.py --calibrations DIR`). The script

1. prices every real step with the calibrated cost model on the step's own shape (the same
   requests, new and context tokens): `per_step`, by kind (decode-only steps by batch size,
   mixed, prefill-only), the median of predicted / measured and the ratio of the sums. An
   error here is the cost model's, on the shapes the run really had;
2. runs the run's simulated twin (fidelity.py's or trace_real.py's: same workload, seed, pool
   and calibration)
   with a step log, and sets the two schedules beside each other: `schedule`, per kind the
   steps, their seconds (sum, p50), decode batch (p50, mean), context per decode (p50) and
   prefill tokens per step (mean), each over the measured window (the warm-up after the
   log's first step, to the run's end). An error here with
   none in 1 is the schedule's (different batches), not the step price's;
3. the server's time between steps (`gaps`): the engine clock not inside any step while
   steps ran back to back (gaps under 0.5 s), which the simulator charges as nothing.

Prints one JSON object on its last line (`--out` writes it too).

    python benchmarks/step_log_check.py --report R.json --server hybridserve --seed 0 \\
        --calibration DIR/torch-own.json [--steps LOG] [--out F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import sim_config
from hf_checkpoint import hf_checkpoint

from hybridserve.core.errors import ConfigError
from hybridserve.engine.step_log import StepLog, StepRecord, read_step_log
from hybridserve.sim.cost_model import RequestShape, RooflineCostModel, StepShape
from hybridserve.sim.run import run_simulation, simulated_cost_model

BATCH_BINS = ((1, 1), (2, 3), (4, 6), (7, 9), (10, 16), (17, 10**9))
BUSY_GAP_S = 0.5  # a longer pause between steps is the engine waiting for work


def shape_of(record: StepRecord) -> StepShape:
    requests = tuple(RequestShape(n, c, d) for n, c, d in record.chunks)
    return StepShape(requests, shared_kv_tokens=record.shared)


def _ratio(predicted: list[float], measured: list[float]) -> dict[str, Any]:
    ratios = [p / m for p, m in zip(predicted, measured, strict=True) if m > 0]
    return {
        "steps": len(ratios),
        "measured_s_p50": round(statistics.median(measured), 5),
        "predicted_s_p50": round(statistics.median(predicted), 5),
        "ratio_p50": round(statistics.median(ratios), 4),
        "ratio_of_sums": round(sum(predicted) / sum(measured), 4),
    }


def _bin(batch: int) -> str:
    for low, high in BATCH_BINS:
        if low <= batch <= high:
            return f"{low}" if low == high else f"{low}-{high if high < 10**9 else ''}"
    raise ValueError(batch)


def per_step(records: list[StepRecord], model: RooflineCostModel) -> dict[str, Any]:
    """Predicted against measured seconds of every step, by kind and decode batch."""
    groups: dict[str, tuple[list[float], list[float]]] = {}
    for record in records:
        predicted = model.step_cost(shape_of(record)).total_s
        keys = [record.kind, "all"]
        if record.kind == "decode":
            keys.append(f"decode batch {_bin(len(record.chunks))}")
        for key in keys:
            p, m = groups.setdefault(key, ([], []))
            p.append(predicted)
            m.append(record.s)
    return {key: _ratio(p, m) for key, (p, m) in sorted(groups.items())}


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 5) if values else None


def schedule(records: list[StepRecord], warmup_s: float, duration_s: float) -> dict[str, Any]:
    """Per kind of step, what the schedule ran in the measured window, [warmup, duration) after
    the log's first step."""
    if not records:
        return {}
    start, end = records[0].t + warmup_s, records[0].t + duration_s
    kept = [r for r in records if start <= r.t < end]
    span = (kept[-1].t + kept[-1].s - kept[0].t) if kept else 0.0
    out: dict[str, Any] = {"span_s": round(span, 2), "steps": len(kept)}
    for kind in ("decode", "mixed", "prefill"):
        mine = [r for r in kept if r.kind == kind]
        decodes = [r.num_decodes for r in mine]
        contexts = [c for r in mine for n, c, d in r.chunks if n <= 1 + d]
        out[kind] = {
            "steps": len(mine),
            "seconds": round(sum(r.s for r in mine), 2),
            "step_s_p50": _p50([r.s for r in mine]),
            "decode_batch_p50": _p50([float(b) for b in decodes]),
            "decode_batch_mean": round(statistics.fmean(decodes), 3) if decodes else None,
            "decode_context_p50": _p50([float(c) for c in contexts]),
            "prefill_tokens_mean": (
                round(statistics.fmean(r.num_prefill_tokens for r in mine), 1) if mine else None
            ),
            "decode_tokens": sum(decodes),
        }
    return out


def gaps(records: list[StepRecord]) -> dict[str, Any]:
    """The engine clock between one step's end and the next one's start, back to back."""
    between = [b.t - (a.t + a.s) for a, b in itertools.pairwise(records)]
    busy = [g for g in between if 0 <= g < BUSY_GAP_S]
    steps = sum(r.s for r in records)
    return {
        "back_to_back": len(busy),
        "gap_s_p50": _p50(busy),
        "gap_s_sum": round(sum(busy), 3),
        "share_of_step_time": round(sum(busy) / steps, 4) if steps else None,
    }


def simulated_steps(config: Any) -> list[StepRecord]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "sim.steps.jsonl"
        with StepLog(path) as log:
            run_simulation(config, step_log=log)
        return read_step_log(path)


def twin_config(
    report: dict[str, Any], checkpoint: Path, server: str, load: float, seed: int, cal: Path
) -> Any:
    """The run's simulated twin: fidelity.py's for an E1 report, trace_real.py's for a trace."""
    if "trace" not in report["setup"]:
        return sim_config(report, checkpoint, server, int(load), seed, cal)
    from trace_real import sim_config as trace_twin

    runs = [
        r
        for r in report["runs"]
        if (r["server"], r["time_scale"], r["seed"]) == (server, load, seed)
    ]
    if not runs:
        raise SystemExit(f"--report: no {server} run at time scale {load:g}, seed {seed}")
    return trace_twin(report["setup"], report["pool"], runs[0], cal, checkpoint)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--server", default="hybridserve", choices=("baseline", "hybridserve"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--agents", type=int, default=None, help="default: the report's first")
    parser.add_argument(
        "--time-scale", type=float, default=None, help="a trace report's load (default: its first)"
    )
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--steps", type=Path, default=None, help="default: from the log dir")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = json.loads(args.report.read_text())
    setup = report["setup"]
    checkpoint = hf_checkpoint(setup["model"])
    if "trace" in setup:  # a trace_real.py report: its load is a time scale
        load = args.time_scale if args.time_scale is not None else setup["time_scales"][0]
        name = f"{args.server}-ats{load:g}-s{args.seed}"
    else:
        load = args.agents if args.agents is not None else setup["agents"][0]
        name = f"{args.server}-a{load}-s{args.seed}"
    steps = args.steps or Path(setup["log_dir"]) / f"{name}.steps.jsonl"
    try:
        real = read_step_log(steps)
    except ConfigError as exc:
        raise SystemExit(f"--steps: {exc} (give the run's log with --steps)") from None
    if not real:
        raise SystemExit(f"--steps {steps}: no steps logged")
    config = twin_config(report, checkpoint, args.server, load, args.seed, args.calibration)
    model = simulated_cost_model(config)
    print(f"{len(real)} real steps; simulating the twin", file=sys.stderr, flush=True)
    twin = simulated_steps(config)
    out = {
        "report": str(args.report),
        "server": args.server,
        ("time_scale" if "trace" in setup else "agents"): load,
        "seed": args.seed,
        "calibration": str(args.calibration),
        "per_step": per_step(real, model),
        "per_step_simulated": per_step(twin, model),
        "schedule": {
            "real": schedule(real, setup["warmup"], setup["duration"]),
            "simulated": schedule(twin, setup["warmup"], setup["duration"]),
        },
        "gaps": gaps(real),
    }
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
