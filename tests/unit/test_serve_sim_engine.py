"""`serve --executor sim` and `simulate` build one engine for one deployment: the same cache
groups, pool and speculation for every built-in model, under every preset."""

from __future__ import annotations

import pytest

from hybridserve.cli.serve_commands import build_app
from hybridserve.cli.sim_backend import SimServingBackend
from hybridserve.engine.settings import PRESETS
from hybridserve.server.app import ServerSettings
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.memory import kv_cache_tokens
from hybridserve.sim.model_profiles import MODELS
from hybridserve.sim.run import simulated_engine

# The tensor-parallel width each built-in model needs to fit one simulated H200 rank.
TP = {"deepseek-v3": 8}


def _engines(model: str, preset: str) -> tuple[object, object]:
    tp = TP.get(model, 1)
    simulated = simulated_engine(SimConfig(model=model, tp=tp, preset=preset)).layout
    backend = SimServingBackend(model_profile=model, tp=tp, speculation="auto", preset=preset)
    served = build_app(backend, ServerSettings(), preset_name=preset).state.hybridserve.parts
    return simulated, served.layout


@pytest.mark.parametrize("model", sorted(MODELS))
def test_serve_sim_and_simulate_build_the_same_cache_for_every_built_in_model(model: str) -> None:
    simulated, served = _engines(model, "hybridserve")
    assert served.groups == simulated.groups
    assert served.num_blocks == simulated.num_blocks
    assert served.speculative == simulated.speculative
    assert served.max_in_flight_tokens == simulated.max_in_flight_tokens > 0
    tokens = [kv_cache_tokens(x.num_blocks, x.groups, dcp=x.dcp) for x in (served, simulated)]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("preset", PRESETS)
def test_serve_sim_and_simulate_agree_under_every_preset(preset: str) -> None:
    simulated, served = _engines("qwen3-next-80b-a3b", preset)
    assert (served.groups, served.num_blocks, served.speculative, served.retention) == (
        simulated.groups,
        simulated.num_blocks,
        simulated.speculative,
        simulated.retention,
    )


def test_serve_sim_and_simulate_build_the_same_host_tier() -> None:
    config = SimConfig(host_memory_gib=64)
    simulated = simulated_engine(config).layout
    backend = SimServingBackend(model_profile=config.model, speculation="auto")
    app = build_app(backend, ServerSettings(), host_memory_gib=64)
    served = app.state.hybridserve.parts
    assert served.layout.host_blocks == simulated.host_blocks > 0
    assert served.layout.host_loads_per_step == simulated.host_loads_per_step > 0
    assert served.cache.host is not None and served.cache.host.num_slots == simulated.host_blocks
    plain = build_app(backend, ServerSettings()).state.hybridserve.parts
    assert plain.layout.host_blocks == 0 and plain.cache.host is None
