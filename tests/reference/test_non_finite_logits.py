"""A request whose logits are not finite fails alone: the sampler never raises on its row, the
engine fails that request through its per-request path, and its co-batched neighbours get the
tokens they get without it (no StepFailed, no cached block lost)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.errors import RequestError
from hybridserve.core.request import (
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    Request,
    SamplingParams,
)
from hybridserve.engine.engine import Engine
from hybridserve.executor.torch import TorchExecutor, load_model
from hybridserve.executor.torch.logits import PenaltyRow, apply_penalties
from hybridserve.executor.torch.sampler import verify, verify_batch
from hybridserve.kvcache import KVCacheManager
from hybridserve.scheduler import Scheduler
from tests.reference.helpers import make_checkpoint

VOCAB = 64
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.7, top_k=5, top_p=0.9, seed=3, ignore_eos=True)
# -inf is a token masked out (a grammar, min_tokens), not a poison: see the test below.
POISONS = [float("nan"), float("inf")]


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


# ----- the sampler --------------------------------------------------------------------------


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize(
    ("params", "drafts"),
    [(GREEDY, ()), (SAMPLED, ()), (SAMPLED, (5, 9)), (GREEDY, (5, 9))],
    ids=["greedy", "sampled", "sampled-drafts", "greedy-drafts"],
)
def test_a_non_finite_row_gets_no_tokens_and_its_neighbours_sample_as_without_it(
    poison: float, params: SamplingParams, drafts: tuple[int, ...]
) -> None:
    neighbours = [((), GREEDY, 4), ((7, 8), SAMPLED, 11)]  # 1 row, then 3 rows
    clean = _logits(4, seed=0)
    alone = verify_batch(clean, neighbours)
    bad = _logits(len(drafts) + 1, seed=1)
    bad[-1, 17] = poison  # the last row: every earlier draft row is fine
    batch = [neighbours[0], (drafts, params, 20), neighbours[1]]
    logits = torch.cat([clean[:1], bad, clean[1:]])
    out = verify_batch(logits, batch)
    assert out == [alone[0], (), alone[1]]
    assert verify(bad, drafts, params, first_position=20) == ()


@pytest.mark.parametrize(("params", "drafts"), [(GREEDY, ()), (SAMPLED, ()), (SAMPLED, (5, 9))])
def test_a_minus_inf_logit_is_a_masked_token_and_the_row_still_samples(
    params: SamplingParams, drafts: tuple[int, ...]
) -> None:
    logits = _logits(len(drafts) + 1, seed=1)
    top = int(logits[-1].argmax())
    masked = logits.clone()
    masked[-1, top] = float("-inf")
    out = verify(masked, drafts, params, first_position=20)
    assert out and out[-1] != top
    if params is GREEDY:
        runner_up = int(logits[-1].topk(2).indices[1])
        assert out == (runner_up,)


def test_logits_that_overflow_at_the_temperature_get_no_tokens() -> None:
    """Finite logits over 3.4e33 overflow float32 when divided by a temperature of 1e-5."""
    huge = _logits(1, seed=2)
    huge[0, 3] = 1e34
    params = SamplingParams(temperature=1e-5, seed=1)
    assert torch.isfinite(huge).all()
    neighbour = ((), SAMPLED, 4)
    alone = verify_batch(_logits(1, seed=3), [neighbour])
    assert verify_batch(torch.cat([huge, _logits(1, seed=3)]), [((), params, 4), neighbour]) == [
        (),
        alone[0],
    ]


@pytest.mark.parametrize("scale", [1.0, 1e30, 3e38])
@pytest.mark.parametrize("temperature", [0.0, 1e-5, 0.5, 2.0, 100.0])
@pytest.mark.parametrize("top_k", [0, 1, 5])
@pytest.mark.parametrize("top_p", [1e-300, 0.5, 1.0])
def test_no_accepted_setting_makes_the_sampler_raise_on_extreme_logits(
    scale: float, temperature: float, top_k: int, top_p: float
) -> None:
    logits = (_logits(3, seed=4) * scale).clamp(-3.4e38, 3.4e38)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=2)
    (emitted,) = verify_batch(logits, [((6, 9), params, 3)])
    assert emitted == () or (1 <= len(emitted) <= 3 and all(0 <= t < VOCAB for t in emitted))
    if scale == 1.0:
        assert emitted  # realistic logits always sample


# ----- the repetition penalty's bound --------------------------------------------------------


@pytest.mark.parametrize("value", [5e-324, 1e-38, 0.0099, 100.5, 1e39, math.nan, -1.0])
def test_repetition_penalties_that_would_overflow_are_refused_naming_the_range(
    value: float,
) -> None:
    with pytest.raises(RequestError, match=r"repetition_penalty=.*\[0\.01, 100\]"):
        SamplingParams(repetition_penalty=value)


@pytest.mark.parametrize("penalty", [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY])
def test_repetition_penalties_at_the_bounds_keep_large_logits_finite(penalty: float) -> None:
    logits = torch.tensor([[3e36, -3e36, 1.0, -1.0]])
    params = SamplingParams(repetition_penalty=penalty)
    scores = apply_penalties(logits, [PenaltyRow(0, (0, 1, 2, 3), (), params)])
    assert torch.isfinite(scores).all()


# ----- through the engine --------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("non-finite-llama")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        architectures=["LlamaForCausalLM"],
    )
    make_checkpoint(config, path)
    return path


def _engine(folder: Path, drafts: int) -> tuple[Engine, Scheduler]:
    speculative = SpeculativeConfig.from_name("ngram", drafts) if drafts else None
    executor = TorchExecutor(
        load_model(folder),
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        speculative=speculative or SpeculativeConfig(),
    )
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512)
    cache = KVCacheManager(executor.cache_layout())
    scheduler = Scheduler(config, cache, num_speculative_tokens=drafts)
    return Engine(scheduler, executor, vocab_size=VOCAB), scheduler


NEIGHBOURS = {
    "greedy": ((1, 2, 3, 4, 5, 6, 7, 8, 9), GREEDY),
    "sampled": ((9, 8, 7, 6, 5, 4, 3, 2), SAMPLED),
}


def _drain(engine: Engine, tokens: dict[str, list[int]]) -> list[str]:
    """Step until idle; the ids the engine failed, in order. A StepFailed propagates."""
    failed: list[str] = []
    for _ in range(200):
        if not engine.has_requests():
            return failed
        step = engine.step()
        failed += [f.req_id for f in step.failed]
        for out in step.outputs:
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    raise AssertionError("the engine did not drain")


def _overflowing(temperature: float) -> SamplingParams:
    """Settings with a repetition penalty that float32 rounds to 0 (so seen tokens' positive
    logits turn to inf), as a caller that skips validation would build them."""
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=5, ignore_eos=True)
    object.__setattr__(params, "repetition_penalty", 5e-324)
    return params


@pytest.mark.parametrize(
    ("temperature", "drafts"),
    [(1.0, 0), (0.0, 0), (1.0, 2)],
    ids=["sampled", "greedy", "sampled-ngram-drafts"],
)
def test_an_overflowing_request_fails_alone_and_its_batch_completes_as_without_it(
    folder: Path, temperature: float, drafts: int
) -> None:
    engine, _ = _engine(folder, drafts)
    for req_id, (prompt, params) in NEIGHBOURS.items():
        engine.add_request(Request(req_id=req_id, prompt_token_ids=prompt, sampling=params))
    expected: dict[str, list[int]] = {}
    assert _drain(engine, expected) == []

    engine, scheduler = _engine(folder, drafts)
    hostile = Request(
        req_id="hostile", prompt_token_ids=(5, 6, 5, 6), sampling=_overflowing(temperature)
    )
    for req_id, (prompt, params) in NEIGHBOURS.items():
        engine.add_request(Request(req_id=req_id, prompt_token_ids=prompt, sampling=params))
    engine.add_request(hostile)
    first = engine.step()  # every prompt in one step: the hostile one samples beside them
    assert {c.req_id for c in first.scheduled.plan.chunks if c.sample} == {*NEIGHBOURS, "hostile"}
    assert [f.req_id for f in first.failed] == ["hostile"]
    assert "no token" in first.failed[0].reason
    tokens = {out.req_id: list(out.new_token_ids) for out in first.outputs}
    assert _drain(engine, tokens) == []
    assert tokens == expected
    cache = scheduler.cache
    cache.check_invariants()
    assert cache.num_free_blocks == cache.layout.num_blocks - 1
    # The neighbours' full prompt blocks stay cached: a repeat of one hits them.
    prompt, params = NEIGHBOURS["greedy"]
    engine.add_request(Request(req_id="again", prompt_token_ids=prompt, sampling=params))
    assert engine.step().scheduled.new_reqs == (("again", 8),)
