"""Search the scheduler controls for the best job goodput under a p99 ITL SLO.

Trials are random draws (seeded) from a grid of control values, each a full simulated run on
the same workload and seed (on one engine, or on the fleet `SimConfig.fleet` names); they run
in local worker processes, or as Ray tasks on a cluster (`ray_address`; Ray is the optional
`ray` extra). The best trial is the one with the highest job goodput among those that meet the
SLO (if none does, the lowest p99 ITL). `run_map` is that machinery alone: the fleet sweep
(hybridserve.sim.fleet_sweep) runs its grid through it too.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from hybridserve.core.errors import ConfigError
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.run import run_simulation

R = TypeVar("R")

# Control values tried; Cp is counted in quanta (the state block size, 1 without one).
GRID: dict[str, tuple[float, ...]] = {
    "max_num_prefill_tokens_per_step": (0, 2, 4, 8, 16),
    "max_num_partial_prefills": (0, 1, 2, 4),
    "decode_prefill_min_decode_steps": (0, 1, 2, 4),
    "decode_prefill_max_wait_ms": (0.0, 500.0, 2_000.0),
    "target_mixed_step_ms": (0.0, 30.0, 60.0),
}


# The knobs a vLLM user has (`vllm-tuned`): the token budget, the long-prefill threshold, the
# batch limit and the Mamba state retention (boundary only, or every N tokens; N in quanta).
VLLM_GRID: dict[str, tuple[int, ...]] = {
    "max_num_batched_tokens": (1024, 2048, 4096, 8192, 16384),
    "long_prefill_token_threshold": (0, 512, 2048, 8192),
    "max_num_seqs": (64, 128, 256, 512),
}
VLLM_RETENTION_QUANTA = (0, 4, 16)  # 0 = `boundary`, else `interval:N*q`


@dataclass(frozen=True, slots=True)
class Trial:
    overrides: tuple[tuple[str, float], ...]
    metrics: dict[str, float]
    retention: str | None = None  # a retention override (the vLLM search), None = the preset's
    fleet: dict[str, Any] | None = None  # the fleet report, when the trial ran on a fleet

    def meets(self, itl_slo_ms: float) -> bool:
        return self.metrics["itl_p99_ms"] <= itl_slo_ms


def draw_controls(rng: random.Random, quantum: int) -> tuple[tuple[str, float], ...]:
    """One valid setting: D needs Cp, W needs D (SPEC.md 5.2 startup validation)."""
    pick = {name: rng.choice(values) for name, values in GRID.items()}
    pick["max_num_prefill_tokens_per_step"] = int(pick["max_num_prefill_tokens_per_step"]) * (
        quantum
    )
    if not pick["max_num_prefill_tokens_per_step"]:
        pick["decode_prefill_min_decode_steps"] = 0
    if not pick["decode_prefill_min_decode_steps"]:
        pick["decode_prefill_max_wait_ms"] = 0.0
    for name in (
        "max_num_prefill_tokens_per_step",
        "max_num_partial_prefills",
        "decode_prefill_min_decode_steps",
    ):
        pick[name] = int(pick[name])
    return tuple(sorted(pick.items()))


def _run_trial(config: SimConfig) -> Trial:
    run = run_simulation(config)
    return Trial(config.overrides, run.summary, config.retention, run.fleet)


def draw_vllm_setting(
    rng: random.Random, quantum: int
) -> tuple[tuple[tuple[str, float], ...], str]:
    """One vLLM setting: scheduler limits and a retention. The long-prefill threshold
    stays below the token budget (vLLM caps a long prefill's chunk at it)."""
    pick = {name: rng.choice(values) for name, values in VLLM_GRID.items()}
    if pick["long_prefill_token_threshold"] >= pick["max_num_batched_tokens"]:
        pick["long_prefill_token_threshold"] = 0
    quanta = rng.choice(VLLM_RETENTION_QUANTA)
    retention = f"interval:{quanta * quantum}" if quanta else "boundary"
    return tuple(sorted((k, float(v)) for k, v in pick.items())), retention


def vllm_sweep(
    base: SimConfig, *, trials: int, quantum: int, workers: int = 1, seed: int = 0
) -> list[Trial]:
    """`trials` distinct random vLLM settings plus vLLM's defaults, each a run of the baseline
    preset (every hybridserve control off) with only vLLM's knobs changed: the `vllm-tuned`
    search, with as many trials as `sweep`."""
    rng = random.Random(seed)
    settings: list[tuple[tuple[tuple[str, float], ...], str]] = [((), "boundary")]
    attempts = 0
    while len(settings) < trials + 1 and attempts < 100 * (trials + 1):
        candidate = draw_vllm_setting(rng, quantum)
        attempts += 1
        if candidate not in settings:
            settings.append(candidate)
    configs = [
        replace(
            base,
            preset="baseline",
            overrides=tuple((k, int(v)) for k, v in c),
            retention=r,
        )
        for c, r in settings
    ]
    return run_map(_run_trial, configs, workers=workers)


def sweep(
    base: SimConfig,
    *,
    trials: int,
    quantum: int,
    workers: int = 1,
    seed: int = 0,
    ray_address: str | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> list[Trial]:
    """Run `trials` distinct random control settings (plus all-off) on `base`.

    With `ray_address` ("auto", "ray://host:10001", or "local" for an in-process cluster, or
    "connected" when the caller already ran `ray.init`), each trial is a Ray task."""
    rng = random.Random(seed)
    settings: list[tuple[tuple[str, float], ...]] = [()]
    attempts = 0
    while len(settings) < trials + 1 and attempts < 100 * (trials + 1):
        # A draw with every control 0 is the all-off setting already in the list.
        candidate = tuple((k, v) for k, v in draw_controls(rng, quantum) if v)
        attempts += 1
        if candidate not in settings:
            settings.append(candidate)
    # Predecessor retention with controls off, plus each trial's controls.
    configs = [replace(base, preset="retention-only", overrides=c) for c in settings]
    return run_map(_run_trial, configs, workers=workers, ray_address=ray_address, on_done=on_trial)


def run_map(
    run: Callable[[SimConfig], R],
    configs: list[SimConfig],
    *,
    workers: int = 1,
    ray_address: str | None = None,
    on_done: Callable[[R], None] | None = None,
) -> list[R]:
    """`run` on every config, results in the order of `configs`: here (`workers` 1), in
    `workers` local processes, or as Ray tasks (`ray_address`, as `sweep` takes it). `run` must
    be a module-level function (it is pickled by name). `on_done` hears of each result as it
    finishes, so an interrupted caller still has the finished ones and can show progress."""
    if ray_address is not None:
        return _ray_map(run, configs, ray_address, on_done)
    return _local_map(run, configs, workers, on_done)


def _local_map(
    run: Callable[[SimConfig], R],
    configs: list[SimConfig],
    workers: int,
    on_done: Callable[[R], None] | None,
) -> list[R]:
    """Here or in `workers` processes, in order of `configs`. Workers ignore SIGINT (no
    tracebacks from them); leaving the pool terminates them."""
    results: list[R | None] = [None] * len(configs)

    def keep(index: int, result: R) -> None:
        results[index] = result
        if on_done is not None:
            on_done(result)

    if workers <= 1:
        for index, config in enumerate(configs):
            keep(index, run(config))
    else:
        items = [(run, index, config) for index, config in enumerate(configs)]
        with multiprocessing.Pool(workers, initializer=_ignore_sigint) as pool:
            for index, result in pool.imap_unordered(_run_indexed, items):
                keep(index, result)
    return [r for r in results if r is not None]


def _run_indexed(item: tuple[Callable[[SimConfig], R], int, SimConfig]) -> tuple[int, R]:
    run, index, config = item
    return index, run(config)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _ray_map(
    run: Callable[[SimConfig], R],
    configs: list[SimConfig],
    address: str,
    on_done: Callable[[R], None] | None,
) -> list[R]:
    """Each config as a Ray task; results gathered as they finish, kept in config order."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "ray", address, "install Ray: pip install 'hybridserve[ray]' (or drop --ray)"
        ) from None
    ray_mod: Any = ray
    if not ray_mod.is_initialized():
        if address == "connected":
            raise ConfigError("ray", address, "call ray.init() first, or give an address")
        _ray_connect(ray_mod, address)
    task = ray_mod.remote(run)
    refs = [task.remote(c) for c in configs]
    where = {ref: index for index, ref in enumerate(refs)}
    results: list[R | None] = [None] * len(configs)
    pending = list(refs)
    while pending:
        done, pending = ray_mod.wait(pending, num_returns=1)
        for ref in done:
            result: R = ray_mod.get(ref)
            results[where[ref]] = result
            if on_done is not None:
                on_done(result)
    return [r for r in results if r is not None]


def _ray_connect(ray_mod: Any, address: str) -> None:
    """ray.init, with Ray's failures to find or reach a cluster turned into ConfigErrors."""
    if address.startswith("ray://") and importlib.util.find_spec("grpc") is None:
        raise ConfigError(
            "ray_address (--ray)",
            address,
            "ray:// addresses need Ray Client (ray[client]), which the ray extra includes: "
            "pip install 'hybridserve[ray]'",
        )
    try:
        ray_mod.init(address=None if address == "local" else address, log_to_driver=False)
    except ConnectionError as exc:
        raise ConfigError(
            "ray_address (--ray)",
            address,
            f"no Ray cluster answered ({exc}); start one with `ray start --head`, give "
            "ray://HOST:10001, use --ray local for an in-process cluster, or drop --ray",
        ) from None
    except ValueError as exc:  # Ray's own complaint about the address or a missing package
        raise ConfigError("ray_address (--ray)", address, str(exc)) from None


def best(results: list[Trial], *, itl_slo_ms: float) -> Trial:
    meeting = [t for t in results if t.meets(itl_slo_ms)]
    if meeting:
        return max(
            meeting, key=lambda t: (t.metrics["job_goodput_per_hour"], -t.metrics["itl_p99_ms"])
        )
    return min(results, key=lambda t: t.metrics["itl_p99_ms"])
