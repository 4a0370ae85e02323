"""Cost-model scorecard: every row of data/gpu-measurements.json that the simulator can
express, run through the real engine on the simulated executor; prints one JSON object.

Per row: the measured figure, the simulated one and the relative error (simulated / measured - 1);
per regime (batch-1 latency, online serving, offline throughput) the median absolute relative
error; the rows it cannot express, each with the reason. Models come from the public config.json
values in benchmarks/configs/ (sources in each folder's SOURCE.md).

How the rows are run (docs/cost_model.md, "Scorecard"):
* batch-1 TTFT rows: `fixed:input=2048,output=1,concurrency=1,requests=2`, mean TTFT.
* online rows (Poisson 4 req/s over ShareGPT): fixed lengths at the ShareGPT means (231 input,
  194 output tokens: a public vLLM benchmark_serving run on ShareGPT_V3 with a Llama-3
  tokenizer reports 230,969 input and 194,523 output tokens for 1,000 prompts; M24's own
  tokens/requests ratio gives 194), 400 requests (100 s) instead of 1,200, medians.
* offline max-throughput rows: one closed-loop wave of B requests, B = the number of requests
  whose full length (input + output) fits the KV pool at once (TensorRT-LLM's default
  GUARANTEED_NO_EVICT admission), capped by the engine's batch limit; output tokens / run time.
  One wave instead of 1,000-5,000 requests keeps the run to a few minutes on one core; the
  published runs are several such waves back to back.

The hybrid rows (H1-H7, data/gpu-measurements-hybrid.json: Qwen3-Coder-Next FP8 on one H200,
Qwen3.5-35B-A3B on one H200) run their own fixed workloads and are not used by the fit: they
check the gated-delta-net state and chunked-scan terms, the MoE term and long-context attention.

Usage: .venv/bin/python benchmarks/cost_model_scorecard.py [--rows M1,H1] [--fitted]
(`--fitted` uses the constants benchmarks/fit_cost_model.py wrote to fitted_efficiency.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hybridserve.core.paths import data_path
from hybridserve.sim.cost_model import Efficiency, StepShape, kv_pool_blocks, shape_from_plan
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.fit import CostSetup, Sample
from hybridserve.sim.gpus import get_gpu
from hybridserve.sim.hf_config import load_model_profile
from hybridserve.sim.run import make_simulation, simulated_engine

ROOT = Path(__file__).resolve().parent
CONFIGS = ROOT / "configs"
MEASUREMENTS = data_path("gpu-measurements.json")
HYBRID_MEASUREMENTS = data_path("gpu-measurements-hybrid.json")
FITTED = ROOT / "fitted_efficiency.json"

BATCH1, ONLINE, OFFLINE = "batch-1 latency", "online serving", "offline throughput"
HYBRID = "hybrid models"  # gated-delta-net / Mamba rows: they check the state terms
SHAREGPT_INPUT, SHAREGPT_OUTPUT = 231, 194


@dataclass(frozen=True)
class Row:
    id: str
    regime: str
    model: str  # folder under benchmarks/configs
    gpu: str
    tp: int
    dtype: str
    kv_dtype: str
    isl: int
    osl: int
    # (published metric, simulated summary key, factor to the published unit, use in the fit)
    metrics: tuple[tuple[str, str, float, bool], ...]
    max_num_seqs: int = 1024
    rate: float | None = None  # online rows: Poisson rate
    note: str = ""
    derived: bool = False  # the published figure is under the row's "derived" key
    workload: str | None = None  # a fixed:... workload instead of the regime's default
    max_model_len: int | None = None  # the scheduler's, for prompts past the default 131,073


_TPUT = (("output_tok_s_total", "output_tokens_per_s", 1.0, True),)
_TTFT = (("ttft_ms", "ttft_mean_ms", 1.0, True),)
_TRT = 2048  # TensorRT-LLM runs: large max_batch_size (CUDA-graph batch sizes up to 8192)

ROWS: tuple[Row, ...] = (
    Row("M1", OFFLINE, "llama-3.1-8b", "H100-SXM", 1, "fp8", "fp8", 128, 2048, _TPUT, _TRT),
    Row("M2", OFFLINE, "llama-3.1-8b", "H200", 1, "fp8", "fp8", 128, 2048, _TPUT, _TRT),
    Row("M3", OFFLINE, "llama-3.1-8b", "H100-SXM", 1, "fp8", "fp8", 2048, 128, _TPUT, _TRT),
    Row("M4", OFFLINE, "llama-3.1-8b", "H100-SXM", 1, "fp8", "fp8", 20000, 2000, _TPUT, _TRT),
    Row("M5", OFFLINE, "llama-3.1-70b", "H100-SXM", 2, "fp8", "fp8", 1000, 1000, _TPUT, _TRT),
    Row("M6", OFFLINE, "llama-3.1-70b", "H200", 1, "fp8", "fp8", 1000, 1000, _TPUT, _TRT),
    Row("M7", OFFLINE, "llama-3.1-70b", "B200", 1, "fp4", "fp8", 1000, 1000, _TPUT, _TRT),
    Row("M8", OFFLINE, "llama-3.1-405b", "H200", 8, "fp8", "fp8", 1000, 1000, _TPUT, _TRT),
    Row("M11", BATCH1, "llama-2-70b", "H100-SXM", 4, "fp8", "bf16", 2048, 1, _TTFT),
    Row("M12", BATCH1, "llama-2-70b", "A100-80G", 4, "bf16", "bf16", 2048, 1, _TTFT),
    Row("M13", BATCH1, "llama-2-7b", "H100-SXM", 1, "fp8", "bf16", 2048, 1, _TTFT),
    Row(
        "M15",
        OFFLINE,
        "llama-2-70b",
        "H200",
        1,
        "fp8",
        "fp8",
        291,
        291,
        (("output_tok_s_per_gpu", "output_tokens_per_s", 1.0, True),),
        806,
        note="one TP1 replica of 8; OpenOrca input mean not in the row: taken as the output "
        "mean; max batch 806 (the row's gpu_batch_size)",
        derived=True,
    ),
    Row(
        "M17",
        OFFLINE,
        "llama-2-70b",
        "MI300X",
        1,
        "fp8",
        "fp8",
        293,
        293,
        (("output_tok_s_per_gpu", "output_tokens_per_s", 1.0, True),),
        note="one TP1 replica of 8; input mean taken as the output mean",
        derived=True,
    ),
    Row(
        "M22",
        ONLINE,
        "llama-3.1-8b",
        "A100-80G",
        1,
        "bf16",
        "bf16",
        SHAREGPT_INPUT,
        SHAREGPT_OUTPUT,
        (
            ("median_tpot_ms", "tpot_p50_ms", 1.0, True),
            ("median_itl_ms", "itl_p50_ms", 1.0, False),
            ("median_ttft_ms", "ttft_p50_ms", 1.0, False),
        ),
        rate=4.0,
        note="SGLang; fixed lengths at the ShareGPT means, so median end-to-end latency (set by "
        "the skewed output lengths) is not compared",
    ),
    Row(
        "M23",
        ONLINE,
        "llama-3.1-8b",
        "A100-80G",
        1,
        "bf16",
        "bf16",
        SHAREGPT_INPUT,
        SHAREGPT_OUTPUT,
        (("median_tpot_ms", "tpot_p50_ms", 1.0, True),),
        rate=4.0,
        note="vLLM 0.6.0 with 10-step scheduling: ITL and TTFT not compared",
    ),
    Row(
        "M24",
        OFFLINE,
        "llama-3.1-8b",
        "A100-80G",
        1,
        "bf16",
        "bf16",
        SHAREGPT_INPUT,
        SHAREGPT_OUTPUT,
        _TPUT,
        note="SGLang, 5000 ShareGPT prompts at once; fixed lengths at the ShareGPT means",
    ),
    Row(
        "M26",
        OFFLINE,
        "llama-3.1-70b",
        "H100-SXM",
        4,
        "bf16",
        "bf16",
        SHAREGPT_INPUT,
        SHAREGPT_OUTPUT,
        _TPUT,
        note="SGLang, 5000 ShareGPT prompts at once; fixed lengths at the ShareGPT means",
    ),
)

_QN = "qwen3-next-80b-a3b"  # Qwen3-Coder-Next has Qwen3-Next-80B-A3B's config
_Q35 = "qwen3.5-35b-a3b"
_PER_USER = (("per_user_tok_s", "per_user_tok_s", 1.0, False),)
_LONG = 262_145

# Hybrid-model rows (data/gpu-measurements-hybrid.json): not in the efficiency fit, a check of it.
HYBRID_ROWS: tuple[Row, ...] = (
    Row("H1", HYBRID, _QN, "H200", 1, "fp8", "bf16", 1024, 1024, _PER_USER,
        workload="fixed:input=1024,output=1024,concurrency=1,requests=1",
        note="per-user generation speed = 1000 / TPOT"),
    Row("H2", HYBRID, _QN, "H200", 1, "fp8", "bf16", 261_120, 1024, _PER_USER,
        workload="fixed:input=261120,output=1024,concurrency=1,requests=1",
        max_model_len=_LONG, note="per-user generation speed at 256K context"),
    Row("H3", HYBRID, _QN, "H200", 1, "fp8", "bf16", 1024, 1024,
        (("output_tok_s_total", "output_tokens_per_s", 1.0, False),),
        workload="fixed:input=1024,output=1024,concurrency=10,requests=10",
        note="10 requests in flight, output tokens per second of the run"),
    Row("H4", HYBRID, _QN, "H200", 1, "fp8", "bf16", 261_120, 1,
        (("ttft_ms", "ttft_mean_ms", 1.0, False),),
        workload="fixed:input=261120,output=1,concurrency=1,requests=1", max_model_len=_LONG,
        note="a 256K prompt's prefill: 12 attention layers quadratic, 36 GDN layers linear"),
    Row("H5", HYBRID, _QN, "H200", 1, "fp8", "bf16", 1024, 1,
        (("ttft_ms", "ttft_mean_ms", 1.0, False),),
        workload="fixed:input=1024,output=1,concurrency=1,requests=1",
        note="the published TTFT includes client/HTTP/queueing time the simulator does not model"),
    Row("H6", HYBRID, _Q35, "H200", 1, "bf16", "bf16", 32_000, 100,
        (("total_tok_s", "total_tokens_per_s", 1.0, False),
         ("ttft_mean_ms", "ttft_mean_ms", 1.0, False)),
        workload="fixed:input=32000,output=100,concurrency=100,requests=100",
        note="guidellm burst of 100 requests, max concurrency 100 (same as M35)"),
    Row("H7", HYBRID, _Q35, "H200", 1, "bf16", "bf16", 1024, 128,
        (("output_tok_s", "output_tokens_per_s", 1.0, False),),
        max_num_seqs=512,
        workload="fixed:input=1024,output=128,concurrency=512,requests=1000",
        note="guidellm burst of 1,000 requests, max concurrency 512 (same as M36)"),
)  # fmt: skip

NOT_EXPRESSIBLE = {
    "M9": "attention data parallelism + expert parallelism (DEP4): the model has TP only",
    "M10": "attention data parallelism + expert parallelism (DEP8): the model has TP only",
    "M29": "MTP speculative decoding with no published acceptance rate",
    "M30": "MTP speculative decoding with no published acceptance rate",
    "M31": "attention data parallelism + EP8 with per-rank batch limits: TP only here",
    "M32": "prefill/decode disaggregation over 72 GPUs with expert parallelism",
    "M33": "prefill/decode disaggregation over 32 GPUs with expert parallelism",
    "M34": "Nemotron-3-Nano (relu2 MoE experts) config values not collected; peak of a "
    "concurrency sweep with no batch size",
    "M35": "run as H6 of data/gpu-measurements-hybrid.json (the hybrid rows)",
    "M36": "run as H7 of data/gpu-measurements-hybrid.json (the hybrid rows)",
    "M37": "Qwen3.5-9B config values not collected; its per-token latencies are not physical",
    "M38": "the configuration (parallelism, engine) is not stated",
    "M39": "checkpoint, parallelism and workload not stated (multi-node wide-EP)",
}


@dataclass
class StepClass:
    """A sample of one class of a run's steps (every `stride`-th) and how many there were."""

    stride: int
    kept: list[StepShape] = field(default_factory=list)
    count: int = 0

    def add(self, shape: StepShape) -> None:
        if self.count % self.stride == 0:
            self.kept.append(shape)
        self.count += 1

    def weighted(self, keep: int, scale: float = 1.0) -> list[tuple[StepShape, float]]:
        """At most `keep` evenly spaced steps (centred in their strata), weighted so that they
        stand for all `count` steps, times `scale`."""
        if not self.kept:
            return []
        n = len(self.kept)
        picks = [self.kept[int((i + 0.5) * n / min(keep, n))] for i in range(min(keep, n))]
        return [(shape, self.count * scale / len(picks)) for shape in picks]


@dataclass
class RowRun:
    summary: dict[str, float]
    prefill: StepClass = field(default_factory=lambda: StepClass(stride=1))  # steps with prefill
    decode_only: StepClass = field(default_factory=lambda: StepClass(stride=8))
    with_decode: StepClass = field(default_factory=lambda: StepClass(stride=4))  # any decode
    seconds: float = 0.0


def sim_config(row: Row, efficiency: Efficiency) -> SimConfig:
    if row.workload is not None:
        workload, duration = row.workload, 3_600.0
    elif row.regime == BATCH1:
        workload, duration = f"fixed:input={row.isl},output=1,concurrency=1,requests=2", 60.0
    elif row.rate is not None:
        workload = f"fixed:input={row.isl},output={row.osl},rate={row.rate},requests=400"
        duration = 400 / row.rate + 120
    else:
        batch = offline_batch(row)
        workload = f"fixed:input={row.isl},output={row.osl},concurrency={batch},requests={batch}"
        duration = 3_600.0
    overrides: tuple[tuple[str, Any], ...] = (("max_num_seqs", row.max_num_seqs),)
    if row.max_model_len is not None:
        overrides += (("max_model_len", row.max_model_len),)
    return SimConfig(
        model_config=str(CONFIGS / row.model),
        gpu=row.gpu,
        tp=row.tp,
        dtype=row.dtype,
        kv_dtype=row.kv_dtype,
        speculation="none",
        preset="baseline",
        workload=workload,
        duration_s=duration,
        warmup_s=0.0,
        overrides=overrides,
        efficiency=efficiency,
    )


def offline_batch(row: Row) -> int:
    """Requests whose full length fits the KV pool at once, capped by the batch limit. The pool
    is the engine's own: sized for the row's batch limit (vLLM's profile run samples
    max_num_seqs rows of logits), without MTP layers (the rows do not speculate)."""
    model = load_model_profile(CONFIGS / row.model).loaded(mtp=False)
    blocks = kv_pool_blocks(
        get_gpu(row.gpu),
        model,
        tp=row.tp,
        dtype=row.dtype,
        kv_dtype=row.kv_dtype,
        max_num_seqs=row.max_num_seqs,
    )
    groups = model.kv_cache_groups()
    tokens = blocks // len(groups) * groups[0].block_size
    return max(1, min(row.max_num_seqs, tokens // (row.isl + row.osl + 16)))


def run_row(row: Row, efficiency: Efficiency) -> RowRun:
    """Simulate `row`, keeping a sample of its step shapes for the fit."""
    config = sim_config(row, efficiency)
    engine = simulated_engine(config).engine
    result = RowRun(summary={})

    def on_step(step: Any) -> None:
        shape = shape_from_plan(step.scheduled.plan)
        scheduled = step.scheduled
        (result.prefill if scheduled.num_prefill_tokens else result.decode_only).add(shape)
        if scheduled.num_decode_tokens:
            result.with_decode.add(shape)

    start = time.perf_counter()
    sim = make_simulation(config, engine, on_step)
    recorder = sim.run(config.duration_s)
    result.summary = recorder.summary(window_start_s=0.0, window_end_s=sim.now)
    result.summary["simulated_s"] = sim.now
    done = recorder.finished_in(0.0, sim.now)
    tokens = sum(r.prompt_tokens + r.output_tokens for r in done)
    result.summary["total_tokens_per_s"] = tokens / sim.now if sim.now else 0.0
    tpot = result.summary["tpot_mean_ms"]
    result.summary["per_user_tok_s"] = 1000.0 / tpot if tpot and tpot == tpot else 0.0
    result.seconds = time.perf_counter() - start
    return result


def measured_values(row: Row, data: dict[str, dict[str, Any]]) -> dict[str, float]:
    entry = data[row.id]
    source = entry.get("derived", {}) if row.derived else entry["metrics"]
    values = {k: float(v) for k, v in source.items() if isinstance(v, int | float)}
    values.update({k: float(v) for k, v in entry["metrics"].items() if isinstance(v, int | float)})
    return values


def fit_samples(
    row: Row, run: RowRun, measured: dict[str, float], *, keep: int = 8
) -> list[Sample]:
    """The row as fit samples: measured seconds for a weighted set of modelled steps (at most
    `keep` per class of step: with prefill, decode only)."""
    setup = CostSetup(
        gpu=get_gpu(row.gpu),
        model=load_model_profile(CONFIGS / row.model),
        tp=row.tp,
        dtype=row.dtype,
        kv_dtype=row.kv_dtype,
    )
    samples = []
    for name, key, factor, use in row.metrics:
        if not use or name not in measured:
            continue
        if key == "output_tokens_per_s":  # all the run's steps
            steps = run.prefill.weighted(keep) + run.decode_only.weighted(keep)
            tokens = run.summary["output_tokens_per_s"] * run.summary["simulated_s"]
            seconds = tokens / measured[name]
        elif key == "ttft_mean_ms":  # one request's prefill steps
            steps = run.prefill.weighted(keep, 1 / run.summary["requests_completed"])
            seconds = measured[name] / 1000
        else:  # a per-token latency: the mean step that decodes
            steps = run.with_decode.weighted(keep, 1 / max(run.with_decode.count, 1))
            seconds = measured[name] / 1000 / factor
        samples.append(
            Sample(
                setup=setup,
                steps=tuple(steps),
                measured_s=seconds,
                label=f"{row.id}:{name}",
            )
        )
    return samples


def scorecard(
    rows: tuple[Row, ...], efficiency: Efficiency, *, log: bool = True
) -> tuple[dict[str, Any], list[Sample]]:
    data = {r["id"]: r for r in json.loads(MEASUREMENTS.read_text())}
    data.update({r["id"]: r for r in json.loads(HYBRID_MEASUREMENTS.read_text())})
    results, samples = [], []
    for row in rows:
        run = run_row(row, efficiency)
        measured = measured_values(row, data)
        if log:
            print(f"{row.id}: {run.seconds:.1f} s", file=sys.stderr)
        samples += fit_samples(row, run, measured)
        for name, key, factor, use in row.metrics:
            simulated = run.summary[key] * factor
            results.append(
                {
                    "id": row.id,
                    "regime": row.regime,
                    "setup": f"{row.model} {row.dtype} on {row.gpu} TP{row.tp}, "
                    f"{row.isl}/{row.osl}" + (f" at {row.rate} req/s" if row.rate else ""),
                    "metric": name,
                    "measured": measured[name],
                    "simulated": round(simulated, 3),
                    "relative_error": round(simulated / measured[name] - 1, 4),
                    "in_fit": use,
                    "note": row.note,
                }
            )
    return summarise(results), samples


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    per_regime: dict[str, Any] = {}
    for regime in (BATCH1, ONLINE, OFFLINE, HYBRID):
        errors = [abs(r["relative_error"]) for r in results if r["regime"] == regime]
        if errors:
            per_regime[regime] = {
                "median_abs_relative_error": round(statistics.median(errors), 4),
                "max_abs_relative_error": round(max(errors), 4),
                "comparisons": len(errors),
            }
    worst = sorted(results, key=lambda r: -abs(r["relative_error"]))[:3]
    return {
        "rows": results,
        "per_regime": per_regime,
        "worst": [f"{r['id']} {r['metric']}: {r['relative_error']:+.1%}" for r in worst],
        "not_expressible": NOT_EXPRESSIBLE,
    }


def load_fitted() -> Efficiency:
    return Efficiency(**json.loads(FITTED.read_text())["efficiency"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row ids (default: all)")
    parser.add_argument("--fitted", action="store_true", help="use fitted_efficiency.json")
    args = parser.parse_args()
    rows = ROWS + HYBRID_ROWS
    if args.rows:
        wanted = set(args.rows.split(","))
        rows = tuple(r for r in ROWS + HYBRID_ROWS if r.id in wanted)
    efficiency = load_fitted() if args.fitted else Efficiency()
    report, _ = scorecard(rows, efficiency)
    report["efficiency"] = {k: getattr(efficiency, k) for k in efficiency.__slots__}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()


__all__ = ["HYBRID_ROWS", "ROWS", "Row", "replace", "scorecard"]
