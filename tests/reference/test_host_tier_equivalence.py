"""A conversation's next turn is the same whether its prefix stays on the device, comes back
from the host tier, or is recomputed.

For each layer kind (full attention, sliding window, Mamba2, gated delta net) a tiny random
model runs the first turn of a session, then the next turn (the first turn's prompt and answer
plus new tokens) three ways: (a) resumed with the first turn's blocks resident; (b) after other
requests filled a small pool, so that every cached block of the first turn went to the host
tier (at its eviction, or under write-through once computed), and promoted back for the next
turn; (c) recomputed from scratch (no prefix caching).
Its tokens are identical and its logits agree within 1e-5, and in (b) the host really served
the whole hit (the plan loaded blocks, the hit tokens are the host's).

With exact tails (full attention, Mamba2, gated delta net: a window keeps no tail) the session's
pin holds its turn's exact end: in (a) the pin holds it, in (b) the fillers need the room, the
pin goes and the end (the partial block, the running state) goes to the host, and the next turn
resumes at that exact end from there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine.engine import Engine
from hybridserve.executor.torch import TorchExecutor
from hybridserve.executor.torch.host_cache import HostCache
from hybridserve.executor.torch.loader import build_model
from hybridserve.executor.torch.models.base import CausalLM
from hybridserve.kvcache import KVCacheManager
from hybridserve.scheduler import Scheduler
from tests.reference.helpers import random_prompt
from tests.reference.test_bamba import _bamba_config
from tests.reference.test_qwen3_next import _qwen3_5_config
from tests.reference.test_reference_models import _gemma3_config, _llama_config

BLOCK = 4
FIRST_PROMPT, FIRST_ANSWER, NEW_TOKENS, NEXT_ANSWER = 18, 6, 5, 6
NUM_FILLERS, FILLER_PROMPT = 3, 30
# Small enough that the fillers evict every block of the first turn; the host keeps them all.
# A filler's prompt takes 8 blocks in every group while it prefills: Gemma 3's four groups of
# one layer each need 36.
SMALL_POOL, SMALL_POOL_PER_GROUP, HOST_BLOCKS = 20, 9, 96


def _perturbed(config: Any) -> CausalLM:
    """The model with seeded weights, a slow state decay and non-trivial norms and biases (a
    lost or stale state shows in the logits)."""
    torch.manual_seed(0)
    model = build_model(config.to_dict())
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=gen).mul(0.45).add(0.05).log())
            elif "norm" in name or name.endswith(("dt_bias", ".D")):
                param.add_(torch.randn(param.shape, generator=gen) * 0.2)
    return model


def _gemma3_groups_of_two_config() -> Any:
    """Gemma 3 with 4 sliding-window and 2 full layers: three cache groups of two layers
    sharing their tensors by position, the last layer full. (With a group that holds only the
    last layer, sliding, its promoted blocks lie outside the window of every sampled row, so
    skipping its loads could not show.)"""
    config = _gemma3_config()
    config.num_hidden_layers = 6
    config.layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return config


MODELS: dict[str, Callable[[], Any]] = {
    "full_attention": _llama_config,
    "sliding_window": _gemma3_groups_of_two_config,
    "mamba2": _bamba_config,
    "gated_delta_net": _qwen3_5_config,
}


@dataclass
class Turn:
    """One request's output, its recorded logits, its admission hit and the plans' loads."""

    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    hit_tokens: int = 0
    host_loads: int = 0


class Session:
    """An engine over the TorchExecutor that runs requests one after another."""

    def __init__(
        self,
        model: CausalLM,
        *,
        num_blocks: int,
        host_blocks: int = 0,
        write_through: bool = False,
        caching: bool = True,
        exact_tails: bool = False,
        pin_ttl_s: float = 30.0,
    ) -> None:
        self.executor = TorchExecutor(
            model, num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=4, host_blocks=host_blocks
        )
        self.executor.record_logits = True
        layout = self.executor.cache_layout(host_write_through=write_through)
        self.cache = KVCacheManager(layout, enable_caching=caching)
        pins: dict[str, object] = {}
        if exact_tails:
            pins = {
                "kv_pin_fraction": 0.5,
                "kv_pin_exact_tail": True,
                "kv_pin_max_ttl_s": pin_ttl_s,
            }
        config = SchedulerConfig(
            max_num_batched_tokens=64,
            max_num_seqs=4,
            max_model_len=256,
            **pins,  # type: ignore[arg-type]
        )
        self.engine = Engine(Scheduler(config, self.cache), self.executor)
        self.now = 0.0  # a step takes a second (pins expire on this clock)

    def run(self, req_id: str, prompt: list[int], sampling: SamplingParams) -> Turn:
        session = "agent" if req_id.startswith("turn") else None
        request = Request(
            req_id=req_id, prompt_token_ids=tuple(prompt), sampling=sampling, session_id=session
        )
        self.engine.add_request(request)
        turn = Turn()
        for _ in range(1000):
            if not self.engine.has_requests():
                break
            step = self.engine.step(self.now)
            self.now += 1.0
            turn.host_loads += len(step.scheduled.plan.host_loads)
            for admitted, hit in (*step.scheduled.new_reqs, *step.scheduled.resumed):
                if admitted == req_id:
                    turn.hit_tokens = hit
            for out in step.outputs:
                turn.tokens.extend(out.new_token_ids)
        else:
            raise AssertionError(f"{req_id} did not finish in 1000 steps")
        turn.logits = self.executor.recorded_logits.pop(req_id)
        return turn


def _greedy(max_tokens: int, **options: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **options)


def _next_turn(session: Session, *, fillers: int) -> Turn:
    """The first turn, `fillers` other requests, then the next turn: the next turn's output.
    The next turn's repetition penalty favours the tokens of its prompt: the token ids the
    executor keeps per block (read back after a prefix hit) count too."""
    first_prompt = random_prompt(FIRST_PROMPT, seed=1)
    first = session.run("turn-1", first_prompt, _greedy(FIRST_ANSWER))
    for i in range(fillers):
        session.run(f"filler-{i}", random_prompt(FILLER_PROMPT, seed=100 + i), _greedy(1))
    next_prompt = first_prompt + first.tokens + random_prompt(NEW_TOKENS, seed=2)
    return session.run("turn-2", next_prompt, _greedy(NEXT_ANSWER, repetition_penalty=0.05))


def _three_ways(model: CausalLM, **options: Any) -> tuple[Session, Turn, Session, Turn, Turn]:
    """The next turn resident (a large pool), promoted (a small pool, the fillers, a host
    tier) and recomputed (no prefix caching); `options` go to both caching sessions' setup
    but `write_through` and `pin_ttl_s`, the host session's alone."""
    host_only = {k: options.pop(k) for k in ("write_through", "pin_ttl_s") if k in options}
    resident_session = Session(model, num_blocks=256, **options)
    resident = _next_turn(resident_session, fillers=0)
    num_groups = len(resident_session.executor.groups.specs)
    host_session = Session(
        model,
        num_blocks=max(SMALL_POOL, SMALL_POOL_PER_GROUP * num_groups),
        host_blocks=HOST_BLOCKS,
        **options,
        **host_only,
    )
    promoted = _next_turn(host_session, fillers=NUM_FILLERS)
    recomputed = _next_turn(Session(model, num_blocks=256, caching=False), fillers=0)
    return resident_session, resident, host_session, promoted, recomputed


def _same_tokens_and_logits(resident: Turn, promoted: Turn, recomputed: Turn) -> None:
    assert promoted.tokens == resident.tokens == recomputed.tokens
    want = torch.stack(resident.logits)
    torch.testing.assert_close(torch.stack(promoted.logits), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.stack(recomputed.logits), want, atol=1e-5, rtol=0)


def check_next_turn(model: CausalLM, *, write_through: bool = False) -> None:
    """The next turn resident, promoted from the host and recomputed: the same tokens, logits
    within 1e-5, and the host served the whole promoted hit."""
    _, resident, host_session, promoted, recomputed = _three_ways(
        model, write_through=write_through
    )

    # State and window groups keep the first prompt's boundary; full attention the whole turn.
    assert resident.hit_tokens >= FIRST_PROMPT // BLOCK * BLOCK
    assert recomputed.hit_tokens == 0
    host = host_session.cache.metrics_snapshot()["host"]
    assert promoted.host_loads > 0 and host["loaded"] > 0
    assert promoted.hit_tokens == resident.hit_tokens
    assert host["hit_tokens"] == promoted.hit_tokens, "the host must serve the whole hit"
    _same_tokens_and_logits(resident, promoted, recomputed)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> CausalLM:
    return _perturbed(MODELS[request.param]())


@pytest.mark.parametrize("write_through", [False, True], ids=["on_eviction", "write_through"])
def test_next_turn_is_the_same_resident_from_the_host_and_recomputed(
    model: CausalLM, write_through: bool
) -> None:
    check_next_turn(model, write_through=write_through)


def test_the_check_catches_a_group_whose_loads_do_not_run(
    model: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Skipping one group's loads (its promoted blocks keep what the fillers left there)
    fails the comparison, for every group of the model."""
    transfer = HostCache.transfer
    num_groups = len(TorchExecutor(model, num_blocks=2, block_size=BLOCK).groups.specs)
    for skipped in range(num_groups):

        def partial(self: HostCache, saves: Any, loads: Any, skipped: int = skipped) -> None:
            transfer(self, saves, tuple(c for c in loads if c.group_id != skipped))

        monkeypatch.setattr(HostCache, "transfer", partial)
        with pytest.raises(AssertionError):
            check_next_turn(model)


TAIL_MODELS = ("full_attention", "gated_delta_net", "mamba2")


@pytest.mark.parametrize("name", TAIL_MODELS)
def test_next_turn_resumes_at_the_exact_end_resident_from_the_host_and_recomputed(
    name: str,
) -> None:
    """The first turn ends inside a block (18 + 6 - 1 = 23 tokens computed): the next turn
    resumes at 23 with the end pinned, at 23 after the pin's TTL ran out during the fillers
    and the end went to the host and back, and is the same as recomputed."""
    model = _perturbed(MODELS[name]())
    end = FIRST_PROMPT + FIRST_ANSWER - 1
    resident_session, resident, host_session, promoted, recomputed = _three_ways(
        model, exact_tails=True, pin_ttl_s=5.0
    )

    assert resident.hit_tokens == end and resident_session.cache.pin_stats.tail_hits == 1
    stats = host_session.cache.pin_stats
    assert stats.released_on_ttl >= 1 and stats.host_tail_hits == 1
    assert promoted.hit_tokens == end and promoted.host_loads > 0
    _same_tokens_and_logits(resident, promoted, recomputed)
