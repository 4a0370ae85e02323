"""A fleet sweep: the grid replicas x router x P:D x preset, each point one fleet run
(hybridserve.sim.fleet) of the same workload on the same seed.

Colocated points run each `replicas` count; a disaggregated point `P:D` runs at P + D replicas.
The points go through the sweep's machinery (`hybridserve.sim.sweep.run_map`): here, in local
worker processes, or as Ray tasks on a cluster. Each row is the fleet report's headline: the
goodput at the SLO per GPU (requests whose TTFT <= 15 s and p99 gap <= 100 ms, per GPU-hour;
jobs per GPU-hour), the hit rate against the global ideal and the load imbalance, beside the
fleet-wide latency and SLO attainment. Same seed, same rows.

With `agents_per_gpu`, the agents workload grows with the fleet (that many agents per GPU), so
a row says how well a fleet of that size serves its share; without it every point serves the
same agents, so the rows say how many GPUs that load needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.engine.settings import PRESETS
from hybridserve.sim.deployment import FleetConfig, SimConfig
from hybridserve.sim.routers import LOAD_WEIGHT, ROUTERS
from hybridserve.sim.run import run_simulation
from hybridserve.sim.summary import rounded
from hybridserve.sim.sweep import run_map

# From the fleet report (per GPU, hit rates, balance) and from the fleet-wide summary.
FLEET_KEYS = (
    "slo_requests_per_gpu_hour",
    "job_goodput_per_gpu_hour",
    "hit_rate",
    "global_ideal_hit_rate",
    "hit_rate_of_ideal",
    "imbalance",
)
SUMMARY_KEYS = (
    "requests_completed",
    "job_goodput_per_hour",
    "slo_attainment",
    "ttft_p50_ms",
    "itl_p99_ms",
)


@dataclass(frozen=True, slots=True)
class FleetPoint:
    """One fleet shape of the grid."""

    replicas: int
    router: str
    pd: tuple[int, int] | None  # None: colocated
    preset: str

    @property
    def layout(self) -> str:
        return "colocated" if self.pd is None else f"{self.pd[0]}:{self.pd[1]}"


@dataclass(frozen=True, slots=True)
class FleetOptions:
    """What every point shares: the router's view and load weight, the P/D link, and the
    agents per GPU (None: the base config's agents at every point)."""

    view: str = "precise"
    load_weight: float = LOAD_WEIGHT
    pd_link: str = "nvlink"
    agents_per_gpu: int | None = None


def fleet_grid(
    *,
    replicas: Sequence[int],
    routers: Sequence[str],
    pd: Sequence[tuple[int, int]] = (),
    presets: Sequence[str] = ("hybridserve",),
) -> list[FleetPoint]:
    """The grid, in a fixed order: preset, router, then colocated sizes and P:D splits as
    given (duplicates dropped). Raises ConfigError naming the flag of an empty or bad axis."""
    if not replicas and not pd:
        raise ConfigError(
            "replicas (--replicas)", "", "give colocated sizes (e.g. 1,2,4) or --pd splits"
        )
    for count in replicas:
        if count < 1:
            raise ConfigError("replicas (--replicas)", count, "use 1 or more replicas")
    _check_names("routers (--routers)", routers, ROUTERS)
    _check_names("presets (--presets)", presets, PRESETS)
    points: list[FleetPoint] = []
    for preset in dict.fromkeys(presets):
        for router in dict.fromkeys(routers):
            points += [FleetPoint(n, router, None, preset) for n in dict.fromkeys(replicas)]
            points += [FleetPoint(sum(s), router, s, preset) for s in dict.fromkeys(pd)]
    return points


def _check_names(flag: str, given: Sequence[str], known: Sequence[str]) -> None:
    if not given:
        raise ConfigError(flag, "", f"give one or more of {', '.join(known)}")
    for name in given:
        if name not in known:
            raise ConfigError(flag, name, f"use one of {', '.join(known)}")


def point_config(base: SimConfig, point: FleetPoint, options: FleetOptions) -> SimConfig:
    """`base` on the point's fleet and preset (and agents, with `agents_per_gpu`)."""
    fleet = FleetConfig(
        replicas=point.replicas,
        router=point.router,
        view=options.view,
        load_weight=options.load_weight,
        pd=point.pd,
        pd_link=options.pd_link,
    )
    config = replace(base, preset=point.preset, fleet=fleet)
    if options.agents_per_gpu is not None:
        if options.agents_per_gpu < 1:
            raise ConfigError(
                "agents_per_gpu (--agents-per-gpu)", options.agents_per_gpu, "use 1 or more"
            )
        agents = options.agents_per_gpu * point.replicas * base.tp
        config = replace(config, agents=replace(base.agents, num_agents=agents))
    return config


def _run_point(config: SimConfig) -> tuple[dict[str, float], dict[str, Any]]:
    run = run_simulation(config)
    assert run.fleet is not None  # every point's config has a fleet
    return run.summary, run.fleet


def fleet_sweep(
    base: SimConfig,
    points: Sequence[FleetPoint],
    options: FleetOptions,
    *,
    workers: int = 1,
    ray_address: str | None = None,
    on_point: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every point; one row per point, in the grid's order (see `row`). Every point's
    config is built (and checked) before the first one runs."""
    configs = [point_config(base, p, options) for p in points]
    done = None if on_point is None else (lambda _result: on_point())
    results = run_map(_run_point, configs, workers=workers, ray_address=ray_address, on_done=done)
    return [
        row(point, config, summary, fleet)
        for point, config, (summary, fleet) in zip(points, configs, results, strict=True)
    ]


def row(
    point: FleetPoint, config: SimConfig, summary: dict[str, float], fleet: dict[str, Any]
) -> dict[str, Any]:
    """A point's row: its shape, the fleet report's headline and the fleet-wide summary
    (rounded; an undefined value is None)."""
    values: dict[str, Any] = {
        "preset": point.preset,
        "router": point.router,
        "layout": point.layout,
        "replicas": point.replicas,
        "gpus": fleet["gpus"],
        "agents": config.agents.num_agents if config.workload == "agents" else None,
        **{key: fleet[key] for key in FLEET_KEYS},
        **{key: summary[key] for key in SUMMARY_KEYS},
    }
    if "pd" in fleet:
        values["transfer_ms_mean"] = fleet["pd"]["transfer_ms_mean"]
    out: dict[str, Any] = rounded(values)
    return out
