"""Fit calibrations' measured steps again, without measuring them again: on another
calibration's peaks (`--peaks-from`), or with `hbm` pinned to the weight stream (`--pin`: the
calibration's own stream, `--peaks-from`'s, or `--fp32-stream` GB/s). The fit is `calibrate`'s
own (`fit_measurements`: the same held-out split, seed and starts). Used to ask whether a fit's
choice between its two minima (per-step overhead against weight reads, docs/fidelity.md) is
what scattered calibrations made minutes apart, by pinning the split on timings already taken.

Each input `DIR/NAME.json` is written to `OUT/NAME.json` (the folder layout `fidelity.py
--calibrations` and `trace_real.py --calibrations` read), and one JSON line per calibration
printed: the constants before and after, and the in-sample and held-out errors.

    python benchmarks/calibration_refit.py runs/cal/*.json --model-path models/smollm2 \\
        --pin --fp32-stream 20.6 --out-dir runs/cal-pinned
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from hybridserve.sim.calibration import Calibration
from hybridserve.sim.calibration_fit import fit_measurements
from hybridserve.sim.fit import CostSetup
from hybridserve.sim.gpus import Gpu
from hybridserve.sim.hf_config import load_model_profile


def refit(calibration: Calibration, gpu: Gpu, model_path: Path, *, pin: bool) -> Calibration:
    """`calibration` fitted again on `gpu`'s peaks, its measured steps as they were (`pin`:
    hbm kept at `gpu`'s weight stream)."""
    setup = CostSetup(
        gpu=gpu,
        model=load_model_profile(model_path),
        dtype=calibration.dtype,
        kv_dtype=calibration.kv_dtype,
    )
    timings = [(row.shape(), row.measured_s) for row in calibration.samples]
    fit = fit_measurements(
        timings,
        setup=setup,
        holdout_fraction=calibration.holdout_fraction,
        seed=calibration.seed,
        pin_hbm=pin,
    )
    return replace(
        calibration,
        gpu=gpu,
        efficiency=fit.efficiency,
        samples=fit.rows,
        in_sample=fit.in_sample,
        held_out=fit.held_out,
    )


def _constants(calibration: Calibration) -> dict[str, float]:
    eff = calibration.efficiency
    return {
        "gemm": round(eff.gemm, 4),
        "attention": round(eff.attention, 4),
        "hbm": round(eff.hbm, 4),
        "kv_hbm": round(eff.kv_bandwidth, 4),
        "step_overhead_ms": round(eff.step_overhead_s * 1e3, 3),
        "in_sample_median": round(calibration.in_sample.median, 4),
        "held_out_median": None
        if calibration.held_out is None
        else round(calibration.held_out.median, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("calibrations", nargs="+", type=Path)
    parser.add_argument("--model-path", type=Path, required=True, help="the checkpoint measured")
    parser.add_argument("--peaks-from", type=Path, help="a calibration whose peaks to fit on")
    parser.add_argument("--fp32-stream", type=float, help="the fp32 weight stream, GB/s")
    parser.add_argument("--pin", action="store_true", help="pin hbm to the weight stream")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    source = Calibration.load(args.peaks_from) if args.peaks_from else None
    for path in args.calibrations:
        calibration = Calibration.load(path)
        gpu = source.gpu if source is not None else calibration.gpu
        if args.fp32_stream is not None:
            gpu = replace(gpu, fp32_stream_bytes_per_s=args.fp32_stream * 1e9)
        again = refit(calibration, gpu, args.model_path, pin=args.pin)
        again.save(args.out_dir / path.name)
        print(
            json.dumps(
                {
                    "calibration": str(path),
                    "hbm_pinned": args.pin
                    and gpu.stream_bytes_per_s(calibration.dtype) is not None,
                    "before": _constants(calibration),
                    "after": _constants(again),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
