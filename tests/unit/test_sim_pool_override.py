"""A simulated engine with a real server's pages and pool: `block_size` (vLLM's --block-size)
and `num_gpu_blocks_override` (--num-gpu-blocks-override), what the real-engine comparison
sets so that the simulator caches in the same blocks from the same pool."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.sim.deployment import SimConfig, resolve_deployment
from hybridserve.sim.run import pool_report, run_simulation, simulated_pool_blocks
from hybridserve.sim.workload import AgentParams

AGENTS = AgentParams(num_agents=2, system_prompt_tokens=1_000, context_limit=3_000)


def _config(**kw: object) -> SimConfig:
    base = dict(
        model="llama-3.1-8b", dtype="bf16", preset="baseline", speculation="none",
        duration_s=30.0, warmup_s=0.0, agents=AGENTS,
    )  # fmt: skip
    return SimConfig(**(base | kw))  # type: ignore[arg-type]


def test_block_size_sets_every_attention_group_page() -> None:
    deployment = resolve_deployment(_config(block_size=32))
    assert {g.block_size for g in deployment.model.kv_cache_groups()} == {32}
    assert {g.block_size for g in resolve_deployment(_config()).model.kv_cache_groups()} == {16}


def test_the_block_override_is_the_pool_and_its_token_count() -> None:
    config = _config(block_size=32, num_gpu_blocks_override=384)
    deployment = resolve_deployment(config)
    assert simulated_pool_blocks(deployment, deployment.settings.scheduler) == 384
    assert pool_report(config)["kv_cache_tokens"] == 384 * 32
    assert simulated_pool_blocks(resolve_deployment(_config()), deployment.settings.scheduler) > 384


def test_cached_prompt_tokens_follow_the_block_size() -> None:
    # Hits are whole blocks: at 32-token pages every turn's hit is a multiple of 32 tokens, at
    # 16-token pages some are not.
    def hits(block: int) -> set[int]:
        run = run_simulation(_config(block_size=block, seed=3))
        records = run.recorder.requests.values()
        return {r.hit_tokens % 32 for r in records if r.hit_tokens}

    assert hits(32) == {0}
    assert hits(16) != {0}


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [("block_size", 0, "1 or more"), ("num_gpu_blocks_override", 1, "2 or more")],
)
def test_bad_page_or_pool_names_the_field(field: str, value: int, fix: str) -> None:
    with pytest.raises(ConfigError, match=fix) as err:
        _config(**{field: value})
    assert field in str(err.value)


def test_a_block_size_on_a_model_with_state_groups_is_refused() -> None:
    with pytest.raises(ConfigError, match="attention-only"):
        resolve_deployment(_config(model="qwen3-next-80b-a3b", block_size=32))


def _hits_past_the_last_prompt(answers: str) -> list[int]:
    """Per turn after the first: hit tokens minus the previous turn's prompt length."""
    fast, slow = AGENTS.tool_time_fast, AGENTS.tool_time_slow
    quick = replace(  # tool times / 100: many turns in a short run
        AGENTS,
        tool_time_fast=replace(fast, median=fast.median / 100, high=fast.high / 100),
        tool_time_slow=replace(slow, median=slow.median / 100, high=slow.high / 100),
    )
    run = run_simulation(_config(answers=answers, seed=1, agents=quick))
    records = run.recorder.requests
    over = []
    for req_id, record in records.items():
        job, _, turn = req_id.rpartition(".t")
        previous = records.get(f"{job}.t{int(turn) - 1}")
        if previous is not None and record.first_token_s is not None:
            over.append(record.hit_tokens - previous.prompt_tokens)
    return over


def test_synthetic_answers_stop_every_hit_at_the_last_prompt() -> None:
    # The load generator appends fresh answer tokens, so a turn reuses its last prompt at most;
    # with the engine's own answers the hit runs into the answer.
    synthetic, engine = (
        _hits_past_the_last_prompt("synthetic"),
        _hits_past_the_last_prompt("engine"),
    )
    assert synthetic and max(synthetic) <= 0
    assert max(engine) > 0
    with pytest.raises(ConfigError, match="engine or synthetic"):
        _config(answers="server")
