"""Search the scheduler controls for the best job goodput under a p99 ITL SLO.

Trials are random draws (seeded) from a grid of control values, each a full simulated run on
the same workload and seed; they run in local worker processes, or as Ray tasks on a cluster
(`ray_address`; Ray is the optional `ray` extra). The best trial is the one with the highest
job goodput among those that meet the SLO (if none does, the lowest p99 ITL).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.sim.run import SimConfig, simulate

# Control values tried; Cp is counted in quanta (the state block size, 1 without one).
GRID: dict[str, tuple[float, ...]] = {
    "max_num_prefill_tokens_per_step": (0, 2, 4, 8, 16),
    "max_num_partial_prefills": (0, 1, 2, 4),
    "decode_prefill_min_decode_steps": (0, 1, 2, 4),
    "decode_prefill_max_wait_ms": (0.0, 500.0, 2_000.0),
    "target_mixed_step_ms": (0.0, 30.0, 60.0),
}


@dataclass(frozen=True, slots=True)
class Trial:
    controls: tuple[tuple[str, float], ...]
    metrics: dict[str, float]

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
    return Trial(config.controls, simulate(config))


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
    configs = [replace(base, preset="retention-only", controls=c) for c in settings]
    if ray_address is not None:
        return _ray_map(configs, ray_address)
    return _local_map(configs, workers, on_trial)


def _local_map(
    configs: list[SimConfig], workers: int, on_trial: Callable[[Trial], None] | None
) -> list[Trial]:
    """Run the trials here or in `workers` processes, in order of `configs`; `on_trial` hears of
    each as it finishes, so an interrupted sweep still has its finished trials. Workers ignore
    SIGINT (no tracebacks from them); leaving the pool terminates them."""
    results: list[Trial | None] = [None] * len(configs)

    def keep(index: int, trial: Trial) -> None:
        results[index] = trial
        if on_trial is not None:
            on_trial(trial)

    if workers <= 1:
        for index, config in enumerate(configs):
            keep(index, _run_trial(config))
    else:
        with multiprocessing.Pool(workers, initializer=_ignore_sigint) as pool:
            for index, trial in pool.imap_unordered(_run_indexed, enumerate(configs)):
                keep(index, trial)
    return [t for t in results if t is not None]


def _run_indexed(item: tuple[int, SimConfig]) -> tuple[int, Trial]:
    return item[0], _run_trial(item[1])


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _ray_map(configs: list[SimConfig], address: str) -> list[Trial]:
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
    task = ray_mod.remote(_run_trial)
    results: list[Trial] = ray_mod.get([task.remote(c) for c in configs])
    return results


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
