"""TorchExecutor step times per batch size next to the cost model's prediction.

One command on a GPU machine (`--device cuda`, the default) or on this CPU (`--device cpu`):
decode steps of `--batches` requests at `--context` tokens each and single prefill chunks of
`--prefills` tokens, timed around `TorchExecutor.execute` (which synchronises CUDA) as
`hybridserve calibrate` times them (interleaved rounds, the median of each round's fastest
step). Each row carries the RooflineCostModel's prediction with the default (fitted)
efficiencies: the catalog datasheet of the GPU when its name is in the catalog (H200, H100-SXM,
...), else peaks measured here. The measured seconds are what `hybridserve calibrate` fits the
simulator's efficiencies on. Without CUDA, `--device cuda` prints a JSON line saying why it was
skipped and exits 0.

    .venv/bin/python benchmarks/executor_gpu.py [--device cuda] [--model smollm2 | PATH | --tiny]
        [--batches 1,8,32,64] [--context 1024] [--prefills 512,2048] [--compile]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise SystemExit(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"expected positive integers, got {text!r}")
    return values


def _device_gpu(device: str, dtype: str) -> tuple[Any, str]:
    from hybridserve.executor.torch.calibrate import measure_peaks
    from hybridserve.sim.calibration_fit import measured_gpu
    from hybridserve.sim.gpus import GPUS

    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        for key, gpu in GPUS.items():
            if key.split("-")[0] in name:
                return gpu, f"datasheet {key}"
    peaks = measure_peaks(device)
    gpu = measured_gpu(
        device,
        fp32_flops=peaks.fp32_flops,
        bf16_flops=peaks.bf16_flops,
        copy_bytes_per_s=peaks.copy_bytes_per_s,
        memory_bytes=peaks.memory_bytes,
    )
    return gpu, "measured peaks"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--model", default="smollm2", help="smollm2, gemma3-270m or a path")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead")
    parser.add_argument("--batches", type=_ints, default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefills", type=_ints, default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="CPU torch threads (0: all)")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the dense layers (MLP, norms)"
    )
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"executor_gpu: CUDA is not available here (torch {torch.__version__}); "
              "run with --device cpu", file=sys.stderr)  # fmt: skip
        print(json.dumps({"skipped": "CUDA is not available", "device": args.device}))
        return

    from hybridserve.executor.torch.calibrate import StepTimer, executor_for, measure_steps
    from hybridserve.executor.torch.checkpoints import resolve_model
    from hybridserve.executor.torch.executor import compile_dense_layers
    from hybridserve.executor.torch.loader import load_model
    from hybridserve.executor.torch.runtime import set_threads
    from hybridserve.sim.cost_model import RooflineCostModel, StepShape
    from hybridserve.sim.hf_config import profile_from_hf_config

    if args.device == "cpu":
        set_threads(args.threads or None)
    dtype = "fp32" if args.device == "cpu" else "bf16"
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            sys.path.insert(0, str(Path(__file__).parent))
            from executor_cpu import tiny_checkpoint

            tiny_checkpoint(Path(tmp))
            path = Path(tmp)
        else:
            path = resolve_model(args.model)
        torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
        model = load_model(path, dtype=torch_dtype)
    if args.compile:
        compile_dense_layers(model)
    profile = profile_from_hf_config(model.config, name=str(args.model))
    gpu, peaks = _device_gpu(args.device, dtype)
    cost = RooflineCostModel(gpu, profile, dtype=dtype, kv_dtype=dtype)
    batches, context = args.batches, args.context
    shapes = [[(1, context, 0)] * b for b in batches] + [[(n, 0, 0)] for n in args.prefills]
    steps = [StepShape.decode(batch=b, context_tokens=context) for b in batches]
    steps += [StepShape.prefill(n) for n in args.prefills]
    max_tokens = max(max(batches) * (context + 1), max(args.prefills))
    executor = executor_for(
        model, max_tokens=max_tokens, max_requests=max(batches), device=args.device
    )
    timer = StepTimer(executor, vocab_size=profile.vocab_size, seed=0)
    seconds = measure_steps(timer, shapes, rounds=args.rounds, repeats=args.repeats)
    rows = []
    for shape, step, measured in zip(shapes, steps, seconds, strict=True):
        predicted = cost.step_cost(step).total_s
        decode = shape[0][0] == 1
        rows.append(
            {
                "kind": "decode" if decode else "prefill",
                "batch": len(shape),
                "tokens": sum(n for n, _ in shape),
                "context_tokens": context if decode else 0,
                "measured_ms": round(measured * 1e3, 3),
                "predicted_ms": round(predicted * 1e3, 3),
                "measured_over_predicted": round(measured / predicted, 3),
                "tokens_per_s": round(sum(n for n, _ in shape) / measured, 1),
            }
        )
    device_name = (
        torch.cuda.get_device_name(torch.device(args.device))
        if args.device.startswith("cuda")
        else "cpu"
    )
    result = {
        "model": profile.name,
        "device": args.device,
        "device_name": device_name,
        "dtype": dtype,
        "torch": str(torch.__version__),
        "threads": torch.get_num_threads(),
        "compiled": args.compile,
        "cost_model_peaks": peaks,
        "rows": rows,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
