"""Decodes that share KV blocks (a system prompt every agent's prompt begins with): the
simulator follows each request's block table from the plans and counts the shared reads of a
step's decodes; the cost model reads those once to the extent `Efficiency.shared_kv` says."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import ScheduledChunk, StepPlan
from hybridserve.engine.shared_kv import DecodeSharing
from hybridserve.kvcache.spec import FullAttentionSpec
from hybridserve.sim.cost_model import Efficiency, RooflineCostModel, StepShape
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.gpus import get_gpu
from hybridserve.sim.model_profiles import MODELS
from hybridserve.sim.run import run_simulation
from hybridserve.sim.workload import AgentParams


def _chunk(
    req: str, start: int, blocks: tuple[int, ...], *, tokens: int = 1, new: bool = False
) -> ScheduledChunk:
    """A chunk of one group (group 1 of two: group 0 stands for a sliding-window group)."""
    return ScheduledChunk(req, start, (7,) * tokens, ((99,), blocks), True, new_request=new)


def test_decodes_count_the_whole_blocks_they_share_once_per_extra_reader() -> None:
    sharing = DecodeSharing(group=1, block_size=16)
    first = StepPlan(
        1,
        (
            _chunk("a", 40, (1, 2, 3), new=True),  # blocks 1, 2 before position 40
            _chunk("b", 40, (1, 2, 4), new=True),
            _chunk("c", 50, (1, 2, 5, 6), new=True),  # blocks 1, 2, 5 before 50
            _chunk("p", 32, (1, 2, 8), tokens=64, new=True),  # a prefill chunk: not a decode
        ),
    )
    assert sharing.shared_kv_tokens(first) == 16 * (2 + 2)  # blocks 1 and 2, two extra readers
    # Later steps send only the blocks a step adds; a finished request's table is dropped.
    later = StepPlan(
        2,
        (_chunk("a", 48, ()), _chunk("b", 48, (9,)), _chunk("p", 96, (10,), tokens=64)),
        finished_req_ids=("c",),
    )
    assert sharing.shared_kv_tokens(later) == 16 * 2  # a and b: blocks 1, 2 (3 and 4 differ)
    # A resumed request's table (new_request again) replaces the old one.
    resumed = StepPlan(3, (_chunk("a", 48, (11, 12, 13), new=True), _chunk("b", 48, ())))
    assert sharing.shared_kv_tokens(resumed) == 0


def test_the_null_block_is_never_a_shared_read() -> None:
    sharing = DecodeSharing(group=1, block_size=16)
    plan = StepPlan(1, (_chunk("a", 40, (0, 2, 3), new=True), _chunk("b", 40, (0, 4, 5), new=True)))
    assert sharing.shared_kv_tokens(plan) == 0


def _decode_cost(shared_kv: float, shared_tokens: int) -> tuple[float, RooflineCostModel]:
    model = RooflineCostModel(
        get_gpu("H200"), MODELS["llama-3.1-8b"], efficiency=Efficiency(shared_kv=shared_kv)
    )
    shape = StepShape.decode(batch=8, context_tokens=4096, shared_tokens=shared_tokens)
    return model.step_cost(shape).attention_decode_s, model


def test_a_shared_prefix_is_read_once_as_far_as_shared_kv_says() -> None:
    unshared, model = _decode_cost(0.0, 0)
    assert _decode_cost(0.0, 2048)[0] == unshared  # 0: every decode reads all its KV
    kv_token = MODELS["llama-3.1-8b"].kv_bytes_per_token(
        FullAttentionSpec(block_size=16), dtype="bf16"
    )
    read_once = kv_token * 2048 * 7 / model._kv_read  # seven decodes read it again
    assert _decode_cost(1.0, 2048)[0] == pytest.approx(unshared - read_once, rel=1e-9)
    assert _decode_cost(0.5, 2048)[0] == pytest.approx(unshared - read_once / 2, rel=1e-9)


def test_shared_kv_outside_zero_to_one_names_the_field() -> None:
    with pytest.raises(ConfigError, match="shared_kv"):
        Efficiency(shared_kv=1.5)
    with pytest.raises(ConfigError, match="shared_kv"):
        Efficiency(shared_kv=-0.1)


def test_a_simulated_run_prices_its_agents_shared_system_prompt_only_when_asked() -> None:
    """Eight agents whose prompts begin with a 4,000-token system prompt: with shared_kv 1 the
    decodes read it once a step and decode faster; with 0 the run is the one without it."""
    agents = AgentParams(num_agents=8, system_prompt_tokens=4_000, context_limit=12_000)
    base = SimConfig(
        model="llama-3.1-8b", gpu="H200", dtype="bf16", preset="baseline", speculation="none",
        duration_s=40.0, warmup_s=5.0, agents=agents, seed=2,
    )  # fmt: skip
    off = run_simulation(base).summary
    on = run_simulation(replace(base, efficiency=Efficiency(shared_kv=1.0))).summary
    assert on["itl_p50_ms"] < 0.97 * off["itl_p50_ms"]
    assert run_simulation(replace(base, efficiency=Efficiency(shared_kv=0.0))).summary == off
