"""The bursty and agents+rag workloads: arrivals only inside bursts, a tenant that never
disturbs the agents' own draws, and clean errors for bad workload strings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.core.errors import ConfigError
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.mixed_workload import BurstyWorkload, RagTenant
from hybridserve.sim.run import run_simulation
from hybridserve.sim.workload import AgentParams


@settings(max_examples=40, deadline=None)
@given(
    rate=st.floats(0.5, 50),
    on=st.floats(1, 30),
    off=st.floats(0, 60),
    seed=st.integers(0, 1000),
)
def test_bursty_arrivals_fall_inside_bursts_in_order(
    rate: float, on: float, off: float, seed: int
) -> None:
    workload = BurstyWorkload(rate_per_s=rate, on_s=on, off_s=off, input_tokens=8, output_tokens=2)
    times = list(workload.arrival_times(seed=seed, until_s=300))
    assert times == sorted(times)
    assert all(0 < t <= 300 for t in times)
    period = on + off
    assert all(t % period <= on + 1e-9 for t in times)


def test_bursty_mean_rate_is_the_burst_rate_times_the_duty_cycle() -> None:
    workload = BurstyWorkload(rate_per_s=12, on_s=20, off_s=40, input_tokens=8, output_tokens=2)
    times = list(workload.arrival_times(seed=3, until_s=6_000))
    assert len(times) / 6_000 == pytest.approx(12 * 20 / (20 + 40), rel=0.05)


def test_bursty_parse_and_errors_name_the_field() -> None:
    parsed = BurstyWorkload.parse("rate=14,on=20,off=40,input=8192,output=128,requests=5")
    assert (parsed.rate_per_s, parsed.on_s, parsed.off_s) == (14.0, 20.0, 40.0)
    assert len(list(parsed.arrival_times(seed=0, until_s=1e9))) == 5
    with pytest.raises(ConfigError, match="off"):
        BurstyWorkload.parse("rate=1,on=2,input=8,output=2")
    with pytest.raises(ConfigError, match=r"workload\.rate"):
        BurstyWorkload.parse("rate=0,on=2,off=1,input=8,output=2")
    with pytest.raises(ConfigError, match="burst=1"):
        BurstyWorkload.parse("burst=1")


def test_rag_tenant_parse_errors_name_the_field() -> None:
    assert RagTenant.parse("rate=0.5,input=16384,output=256").input_tokens == 16_384
    with pytest.raises(ConfigError, match="output"):
        RagTenant.parse("rate=0.5,input=16384")
    with pytest.raises(ConfigError, match="input=x"):
        RagTenant.parse("rate=0.5,input=x,output=2")


def _run(workload: str, **options: object) -> dict[str, float]:
    config = SimConfig(
        preset="baseline",
        workload=workload,
        duration_s=60.0,
        warmup_s=0.0,
        agents=AgentParams(num_agents=3),
        **options,  # type: ignore[arg-type]
    )
    return run_simulation(config).summary


def test_a_bursty_run_serves_its_requests_and_repeats_on_its_seed() -> None:
    spec = "bursty:rate=4,on=5,off=10,input=512,output=8"
    first, again = _run(spec), _run(spec)
    assert first["requests_completed"] > 0
    assert first == again


def test_agents_with_rag_serves_both_tenants() -> None:
    config = SimConfig(
        preset="baseline",
        workload="agents+rag:rate=0.5,input=4096,output=16",
        duration_s=60.0,
        warmup_s=0.0,
        agents=AgentParams(num_agents=3),
    )
    run = run_simulation(config)
    requests = run.recorder.requests
    rag = [r for name, r in requests.items() if name.startswith("rag")]
    turns = [r for r in requests.values() if r.job_id is not None]
    assert len(rag) >= 10  # 0.5/s for 60 s
    assert all(r.job_id is None and r.prompt_tokens == 4096 for r in rag)
    assert sum(r.finish_s is not None for r in rag) >= len(rag) - 2
    assert turns and sum(r.finish_s is not None for r in turns) > 0


def test_unknown_workload_error_lists_the_new_kinds() -> None:
    with pytest.raises(ConfigError, match="agents\\+rag"):
        _run("burst:rate=1")
