"""E1 as an experiment: configurations run on the same seeds (paired: every agent's jobs are the
same on a seed, hybridserve.sim.workload), per-seed ratios with a 95% t interval, and the upper
bounds (hybridserve.sim.bounds) as rows of their own.

`hybridserve bench`, benchmarks/e1_matrix.py and benchmarks/load_curves.py all run through
`run_configs` and summarise with `paired_report`.
"""

from __future__ import annotations

import json
import math
import signal
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.engine.settings import PRESETS
from hybridserve.metrics.report_keys import BREAKDOWN_KEYS, RUN_KEYS
from hybridserve.sim.bounds import BOUNDS
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.run import run_simulation
from hybridserve.sim.stats import paired_ratio
from hybridserve.sim.summary import SimRun

# `--baseline NAME` -> the preset that stands for it.
BASELINES = ("vllm", "vllm-tuned", "legacy", "vllm-offload", "vllm-tuned-offload")

# Metrics every configuration reports (means over seeds).
METRIC_KEYS = (*RUN_KEYS, "slo_attainment")
# The fleet report's numbers a bench averages over seeds (hybridserve.sim.fleet_report).
FLEET_MEAN_KEYS = (
    "hit_rate",
    "global_ideal_hit_rate",
    "hit_rate_of_ideal",
    "imbalance",
    "slo_requests_per_gpu_hour",
    "job_goodput_per_gpu_hour",
)
# ratio name -> metric: hybridserve / baseline per seed.
RATIOS = {
    "job_goodput": "job_goodput_per_hour",
    "itl_p99": "itl_p99_ms",
    "ttft_p99": "ttft_p99_ms",
    # The work done, beside the jobs: a window counts whole jobs, so a change in which jobs
    # finish inside it moves job goodput more than the engine's throughput.
    "output_tokens": "output_tokens_per_s",
}


def baseline_preset(name: str, *, field: str = "baseline") -> str:
    """The preset that `--baseline NAME` runs (`vllm-tuned` is the baseline preset with the tuned
    vLLM knobs on top, `tune_vllm`; `vllm-offload` is it with vLLM's own CPU offloading).
    Raises ConfigError naming `field` for an unknown name and for `legacy` while no such
    preset exists."""
    if name in ("vllm", "vllm-tuned", "vllm-offload", "vllm-tuned-offload"):
        return "baseline"
    if name == "legacy":
        if "legacy" not in PRESETS:
            raise ConfigError(field, name, f"no `legacy` preset in this build (presets: {PRESETS})")
        return "legacy"
    raise ConfigError(field, name, f"use one of {BASELINES}")


def tune_vllm(
    config: SimConfig, *, trials: int, itl_slo_ms: float, workers: int = 1, seed: int = 0
) -> tuple[SimConfig, dict[str, Any]]:
    """The `vllm-tuned` baseline: `config` on the baseline preset with the best vLLM setting
    (token budget, long-prefill threshold, batch limit, retention) that `trials` random draws
    find under the p99 ITL SLO (hybridserve.sim.sweep.vllm_sweep: as many trials as the
    hybridserve sweep), searched on `config`'s own seed. Returns the config and the search."""
    from hybridserve.sim.deployment import model_profile, state_quantum
    from hybridserve.sim.sweep import best, vllm_sweep

    quantum = state_quantum(model_profile(config))
    results = vllm_sweep(config, trials=trials, quantum=quantum, workers=workers, seed=seed)
    winner = best(results, itl_slo_ms=itl_slo_ms)
    chosen = tuned_config(config, dict(winner.overrides), winner.retention or "boundary")
    search = {
        "itl_slo_ms": itl_slo_ms,
        "trials": len(results),
        "best": {"controls": dict(winner.overrides), "retention": winner.retention},
        "best_metrics": {k: winner.metrics[k] for k in ("job_goodput_per_hour", "itl_p99_ms")},
    }
    return chosen, search


def read_tuned(
    config: SimConfig, path: Path, *, field: str = "--tuned"
) -> tuple[SimConfig, dict[str, Any]]:
    """`config` as the vllm-tuned baseline of a stored search: the JSON of `sweep --space vllm`
    or a bench report that ran one. Returns the config and the search (with `from`). Raises
    ConfigError naming `field` for an unreadable file or one without a `best` setting."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(field, str(path), f"give a readable JSON file ({exc})") from None
    try:
        data = json.loads(text)
    except ValueError:
        try:  # a command's captured output: the JSON is its last line
            data = json.loads(text.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise ConfigError(field, str(path), f"give a readable JSON file ({exc})") from None
    setup = data.get("setup") if isinstance(data, dict) else None
    found = setup.get("vllm_tuned", data) if isinstance(setup, dict) else data
    need = 'it needs {"best": {"controls": {KNOB: integer, ...}, "retention": "..."}}'
    if not isinstance(found, dict) or not isinstance(found.get("best"), dict):
        raise ConfigError(field, str(path), need)
    best = found["best"]  # stored files name the scheduler overrides `controls`
    overrides, retention = best.get("controls", {}), best.get("retention") or "boundary"
    if not isinstance(overrides, dict) or not isinstance(retention, str):
        raise ConfigError(field, str(path), need)
    for knob, value in overrides.items():
        integer = isinstance(value, int) and not isinstance(value, bool)
        if not (integer or (isinstance(value, float) and value.is_integer())):
            raise ConfigError(f"{field} controls.{knob}", value, "use an integer")
    search = {k: v for k, v in found.items() if k != "trials"}
    if isinstance(found.get("trials"), list):
        search["trials"] = len(found["trials"])
    try:
        tuned = tuned_config(config, overrides, retention)
    except ConfigError as exc:
        raise ConfigError(f"{field} ({path})", exc.value, exc.fix) from None
    return tuned, {**search, "from": str(path)}


def tuned_config(config: SimConfig, overrides: Mapping[str, Any], retention: str) -> SimConfig:
    """`config` as the vllm-tuned baseline: the baseline preset, vLLM knobs only. Raises
    ConfigError for a knob that is not one of vLLM's."""
    from hybridserve.sim.sweep import VLLM_GRID

    unknown = sorted(set(overrides) - set(VLLM_GRID))
    if unknown:
        raise ConfigError("tuned.controls", unknown, f"vLLM's knobs are {sorted(VLLM_GRID)}")
    return replace(
        config,
        preset="baseline",
        overrides=tuple(sorted((k, int(v)) for k, v in overrides.items())),
        retention=retention,
    )


def _run_one(
    config: SimConfig, keep: bool
) -> tuple[dict[str, float], dict[str, Any] | None, SimRun | None]:
    run = run_simulation(config)
    return run.summary, run.fleet, (run if keep else None)


def run_configs(
    configs: Mapping[str, SimConfig],
    seeds: Sequence[int],
    *,
    workers: int = 1,
    keep_seed: int | None = None,
    log: Callable[[str], None] | None = None,
    finished: dict[str, dict[int, dict[str, float]]] | None = None,
    fleets: dict[str, dict[int, dict[str, Any]]] | None = None,
) -> tuple[dict[str, list[dict[str, float]]], dict[str, SimRun]]:
    """Every configuration on every seed. Returns, per label, the summaries in seed order, and
    the full runs of `keep_seed` (for plots). `workers` > 1 runs them in local processes (which
    ignore Ctrl-C; an interrupt cancels what has not run). `finished`, when given, is filled
    run by run (label -> seed -> summary), so an interrupted caller keeps what finished;
    `fleets`, when given, gets the fleet report (label -> seed -> report) of every run on a
    fleet (`SimConfig.fleet`)."""
    jobs = [(label, seed) for seed in seeds for label in configs]
    results = finished if finished is not None else {}
    for label in configs:
        results.setdefault(label, {})
    kept: dict[str, SimRun] = {}

    def record(
        label: str,
        seed: int,
        summary: dict[str, float],
        fleet: dict[str, Any] | None,
        run: SimRun | None,
    ) -> None:
        results[label][seed] = summary
        if fleets is not None and fleet is not None:
            fleets.setdefault(label, {})[seed] = fleet
        if run is not None:
            kept[label] = run
        if log is not None:
            log(f"{sum(map(len, results.values()))}/{len(jobs)} {label} seed={seed}")

    def args(label: str, seed: int) -> tuple[SimConfig, bool]:
        return replace(configs[label], seed=seed), seed == keep_seed

    if workers <= 1:
        for label, seed in jobs:
            record(label, seed, *_run_one(*args(label, seed)))
    else:
        pool = ProcessPoolExecutor(max_workers=workers, initializer=_ignore_sigint)
        try:
            futures = [
                (label, seed, pool.submit(_run_one, *args(label, seed))) for label, seed in jobs
            ]
            for label, seed, future in futures:
                record(label, seed, *future.result())
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    return {label: [results[label][s] for s in seeds] for label in configs}, kept


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def mean_metrics(summaries: Iterable[Mapping[str, float]], keys: Iterable[str]) -> dict[str, Any]:
    """Means over seeds, NaN-skipping (None where no seed defines the metric)."""
    rows = list(summaries)
    out: dict[str, Any] = {}
    for key in keys:
        values = [r[key] for r in rows if key in r and not math.isnan(r[key])]
        out[key] = round(statistics.fmean(values), 4) if values else None
    return out


def paired_report(
    results: Mapping[str, Sequence[Mapping[str, float]]],
    *,
    baseline: str,
    ours: str,
    bounds: Iterable[str] = BOUNDS,
) -> dict[str, Any]:
    """The report of one E1 comparison: each configuration's mean metrics and per-seed values,
    the paired ratios ours / baseline with 95% intervals, the bounds' job goodput (jobs/h) and
    each configuration's goodput as a fraction of each bound (mean of per-seed fractions)."""
    report: dict[str, Any] = {}
    for label, rows in results.items():
        groups = sorted({k for r in rows for k in r if k.startswith("group")})
        report[label] = mean_metrics(rows, (*METRIC_KEYS, *BREAKDOWN_KEYS, *groups))
        report[label]["per_seed_job_goodput_per_hour"] = [
            round(r["job_goodput_per_hour"], 4) for r in rows
        ]
    report["ratios"] = {
        name: paired_ratio([r[key] for r in results[ours]], [r[key] for r in results[baseline]])
        for name, key in RATIOS.items()
    }
    present = [b for b in bounds if b in results]
    report["bounds"] = {
        b: mean_metrics(results[b], ("job_goodput_per_hour",))["job_goodput_per_hour"]
        for b in present
    }
    fractions: dict[str, dict[str, Any]] = {}
    for label, rows in results.items():
        if label in BOUNDS:
            continue
        fractions[label] = {
            b: paired_ratio(
                [r["job_goodput_per_hour"] for r in rows],
                [r["job_goodput_per_hour"] for r in results[b]],
            )
            for b in present
        }
    report["fraction_of_bound"] = fractions
    return report


def goodput_ratios(report: Mapping[str, Any], baseline: str = "baseline") -> dict[str, Any]:
    """Per configuration of a paired report (bounds included) but `baseline`: the paired ratio
    of its per-seed job goodput to the baseline's (goodput.png's points and reference lines);
    empty without the baseline."""
    key = "per_seed_job_goodput_per_hour"
    base = report.get(baseline)
    if not isinstance(base, Mapping) or key not in base:
        return {}
    return {
        label: paired_ratio(m[key], base[key])
        for label, m in report.items()
        if label != baseline and isinstance(m, Mapping) and key in m
    }


def fleet_block(reports: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """A bench's `fleet`: the fleet every configuration ran on (replicas, GPUs, router, view,
    load weight, P:D) and, per configuration, the means over seeds of its fleet report's
    numbers (FLEET_MEAN_KEYS) and every seed's report, rounded."""
    from hybridserve.sim.summary import rounded

    first = next(iter(reports.values()))[0]
    pd = first.get("pd")
    return {
        **{k: first[k] for k in ("replicas", "gpus", "router", "router_view", "load_weight")},
        "pd": None if pd is None else {k: pd[k] for k in ("prefill", "decode", "link")},
        "configurations": {
            label: {**mean_metrics(rows, FLEET_MEAN_KEYS), "per_seed": rounded(list(rows))}
            for label, rows in reports.items()
        },
    }
