"""The host tier under random sessions: what moves between the device and the host is what the
cache says is there, and nothing is lost, read early or counted twice.

A shadow executor keeps a label per device block and per host slot: the cache key whose content
the block or slot holds. It runs each plan as the contract says (saves, then loads, then the
forward) and checks, every step:

* every loaded block now holds the key the cache registered it under (a promotion read the
  slot after its save, and no other save overwrote the slot first);
* every key the host holds is in its slot (no slot was reused while a load still needed it);
* every block the forward reads (a request's blocks below its chunk) holds its own key;
* `check_invariants()` of the pool, the groups and the host; the host never uses more slots
  than it has; and every block saved is, at any time, either loaded back, dropped by the host's
  LRU or still held (never two of them);
* with exact tails, a turn's end that has no prefix hash (a partial block, a running state) is
  labelled with the request that wrote it: a copy-on-write source, after a pin released for
  room sent it to the host and back, still holds what the session's last turn wrote.

Sessions extend their last prompt and answer (agent turns), other prompts share a system
prefix, and the pool is small, so blocks are evicted, saved and promoted all the time.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine, StepFailed
from hybridserve.executor.fake import FakeExecutor
from hybridserve.kvcache import (
    CacheLayout,
    FullAttentionSpec,
    GroupSpec,
    KVCacheManager,
    MambaSpec,
    SlidingWindowSpec,
)
from hybridserve.kvcache.block_pool import Block
from hybridserve.kvcache.hashing import is_tail_key
from hybridserve.scheduler import Scheduler

FAMILIES = ("full", "full+swa", "full+mamba")


class ShadowExecutor:
    """Runs a plan's transfers on labels and checks what the forward will read."""

    def __init__(self, cache: KVCacheManager) -> None:
        self.cache = cache
        # A block's content: its key, or ("w", request, group) for what a request wrote
        # where no prefix hash names it.
        self.device: dict[int, object] = {}
        self.host: dict[int, object] = {}
        self.tokens = FakeExecutor(lambda req_id, t: (t * 7 + len(req_id)) % 5)
        self.num_loads = 0
        self.previous: str | None = None  # the running session's last turn (exact tails)
        self.tail_copies = 0  # copy-on-write sources a request's last turn wrote

    def execute(self, plan: StepPlan) -> StepResult:
        blocks = self.cache.pool.blocks
        for copy in plan.host_saves:
            self.host[copy.slot] = self.device.get(copy.block_id)
        now = [c for c in plan.host_loads if not c.background]
        beside = [c for c in plan.host_loads if c.background]
        for copy in now:
            self._load(copy.block_id, copy.slot)
        self.num_loads += len(plan.host_loads)
        host = self.cache.host
        for key, entry in host._entries.items() if host is not None else ():
            if host is not None and host.is_saved(key):
                want = key if not is_tail_key(key) else self.host.get(entry.slot)
                assert isinstance(want, (bytes, tuple)), f"tail slot {entry.slot} holds nothing"
                assert self.host.get(entry.slot) == want, f"host slot {entry.slot} lost its content"
        for copy in plan.block_copies:
            self._copy(copy.group_id, copy.src_block_id, copy.dst_block_id)
        # Prefetches run beside the forward: what it reads must not depend on them.
        for copy in beside:
            self.device[copy.block_id] = None
        self._check_reads(plan)
        # The forward computes every block registered so far that holds nothing else yet.
        loading = {c.block_id for c in beside}
        for block in blocks[1:]:
            busy = block.block_id in loading or (
                host is not None and host.is_loading(block.block_id)
            )
            if block.key is not None and not is_tail_key(block.key) and not busy:
                self.device[block.block_id] = block.key
        for chunk in plan.chunks:
            for gid, group in enumerate(self.cache.groups):
                for block in group.tables.get(chunk.req_id, []):
                    plain = block.key is None or is_tail_key(block.key)
                    if block.block_id > 0 and plain and block.block_id not in loading:
                        self.device[block.block_id] = ("w", chunk.req_id, gid)
        for copy in beside:
            self._load(copy.block_id, copy.slot)
        return self.tokens.execute(plan)

    def _load(self, block_id: int, slot: int) -> None:
        self.device[block_id] = self.host.get(slot)
        key = self.cache.pool.blocks[block_id].key
        if key is not None and is_tail_key(key):
            return  # a turn's end: its copy-on-write read checks what it holds
        assert self.device[block_id] == key, (
            f"block {block_id} was loaded from slot {slot} without its content"
        )

    def _copy(self, group_id: int, src: int, dst: int) -> None:
        """A copy-on-write: a source no prefix hash names is the end of the running session's
        last turn, in this group."""
        label = self.device.get(src)
        key = self.cache.pool.blocks[src].key
        if key is None or is_tail_key(key):
            assert label == ("w", self.previous, group_id), (
                f"group {group_id} copies block {src} holding {label}, not the end "
                f"{self.previous} wrote"
            )
            self.tail_copies += 1
        else:
            assert label == key, f"group {group_id} copies block {src} holding other content"
        self.device[dst] = label

    def _check_reads(self, plan: StepPlan) -> None:
        """Blocks a chunk reads (wholly below its start) hold the key they are registered
        under; a block not registered has no key to compare (its content is the request's)."""
        for chunk in plan.chunks:
            for gid, group in enumerate(self.cache.groups):
                table = group.tables.get(chunk.req_id, [])
                for index, block in enumerate(table):
                    if (index + 1) * group.block_size > chunk.start:
                        break
                    if block.block_id > 0 and block.key is not None:
                        label = self.device.get(block.block_id)
                        want = block.key
                        if is_tail_key(want):  # a turn's end read in place (a state)
                            want = ("w", self.previous, gid)  # type: ignore[assignment]
                        assert label == want, (
                            f"{chunk.req_id} reads group {gid} block {block.block_id} holding "
                            "other content"
                        )


def _groups(family: str, block_size: int) -> tuple[GroupSpec, ...]:
    groups: list[GroupSpec] = [FullAttentionSpec(block_size=block_size)]
    if family == "full+swa":
        groups.append(SlidingWindowSpec(block_size=block_size, window=2 * block_size))
    if family == "full+mamba":
        groups.append(MambaSpec(block_size=block_size))
    return tuple(groups)


@st.composite
def _runs(draw: st.DrawFn) -> tuple[CacheLayout, list[tuple[str, int, int]], bool]:
    family = draw(st.sampled_from(FAMILIES))
    block_size = draw(st.sampled_from((4, 8)))
    layout = CacheLayout(
        groups=_groups(family, block_size),
        num_blocks=draw(st.integers(28, 40)),
        host_blocks=draw(st.integers(4, 40)),
        host_write_through=draw(st.booleans()),
        host_loads_per_step=draw(st.sampled_from((0, 1, 3))),
    )
    turns = draw(
        st.lists(
            st.tuples(
                st.sampled_from(("s0", "s1", "s2", "other", "other")),
                st.integers(3, 40),  # new prompt tokens
                st.integers(1, 6),  # answer tokens
            ),
            min_size=6,
            max_size=16,
        )
    )
    return layout, turns, draw(st.booleans())


def _drive(
    layout: CacheLayout, turns: Sequence[tuple[str, int, int]], exact_tails: bool = False
) -> ShadowExecutor:
    """Each turn runs alone to its end. With `exact_tails` a session's finished turn is pinned
    with its exact end (pins take up to half the pool and are released for room)."""
    cache = KVCacheManager(layout)
    pins = {"kv_pin_fraction": 0.5, "kv_pin_exact_tail": True} if exact_tails else {}
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, **pins)  # type: ignore[arg-type]
    scheduler = Scheduler(config, cache)
    shadow = ShadowExecutor(cache)
    engine = Engine(scheduler, shadow)
    contexts: dict[str, list[int]] = {}
    last: dict[str, str] = {}  # a session's last turn
    system = [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7]
    for n, (session, new, answer) in enumerate(turns):
        context = contexts.get(session, list(system)) if session != "other" else list(system)
        if len(context) + new > 56:  # the session starts over: every prompt fits the pool
            context = list(system)
        prompt = [*context, *[(n * 3 + i) % 4 for i in range(new)]]
        request = Request(
            req_id=f"r{n}",
            prompt_token_ids=tuple(prompt),
            sampling=SamplingParams(max_tokens=answer, ignore_eos=True),
            session_id=session if session != "other" else None,
        )
        shadow.previous = last.get(session)
        engine.add_request(request)
        outputs: list[int] = []
        for _ in range(400):
            if not engine.has_requests():
                break
            step = engine.step()
            for out in step.outputs:
                outputs.extend(out.new_token_ids)
            _check(cache)
        assert not engine.has_requests(), "the engine did not drain"
        if session != "other":
            contexts[session] = [*prompt, *outputs]
            last[session] = request.req_id
    return shadow


def _check(cache: KVCacheManager) -> None:
    cache.check_invariants()
    host = cache.host
    if host is None:
        return
    assert host.num_used <= host.num_slots
    queued = host._queued_blocks
    for block in cache.pool.free_queue:
        assert block.block_id not in queued, f"{block} is free while a load into it is queued"
    stats = host.stats
    if not host.write_through:
        # Every block saved is loaded back, dropped or still held: exactly one of them.
        assert stats.saved == stats.loaded + stats.dropped + len(host._entries)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_runs())
def test_host_transfers_carry_the_content_the_cache_says_they_do(
    run: tuple[CacheLayout, list[tuple[str, int, int]], bool],
) -> None:
    layout, turns, exact_tails = run
    _drive(layout, turns, exact_tails)


def test_a_session_evicted_from_the_device_comes_back_from_the_host() -> None:
    """A turn evicted by other prompts is promoted for its session's next turn: the hit is the
    host's, and the loads carry its content (the shadow checks every one)."""
    layout = CacheLayout(
        groups=_groups("full+mamba", 4), num_blocks=36, host_blocks=40, host_write_through=False
    )
    turns = [("s0", 20, 3), *[("other", 20, 2)] * 3, ("s0", 4, 2)]
    shadow = _drive(layout, turns)
    assert shadow.num_loads > 0
    snapshot = shadow.cache.metrics_snapshot()["host"]
    assert isinstance(snapshot, dict)
    assert snapshot["hit_tokens"] > 0 and snapshot["loaded"] > 0


def test_a_turn_end_released_for_room_comes_back_from_the_host_as_it_was_written() -> None:
    """Exact tails: another prompt needs the room a session's pin holds, so the pin goes and
    its turn's end (the partial block, the running state) is saved to the host; the session's
    next turn resumes there, and each group's copy-on-write reads what the last turn wrote."""
    layout = CacheLayout(groups=_groups("full+mamba", 4), num_blocks=24, host_blocks=40)
    turns = [("s0", 21, 3), *[("other", 30, 2)] * 2, ("s0", 4, 2)]
    shadow = _drive(layout, turns, exact_tails=True)
    stats = shadow.cache.pin_stats
    assert stats.released_on_pressure == 1 and stats.tails_to_host >= 1
    assert stats.host_tail_hits == 1
    assert shadow.tail_copies == 2  # the full-attention block and the state, both checked


def test_without_a_host_tier_nothing_is_saved_or_loaded() -> None:
    layout = CacheLayout(groups=_groups("full+mamba", 4), num_blocks=24)
    cache = KVCacheManager(layout)
    assert cache.host is None and "host" not in cache.metrics_snapshot()
    assert cache.take_host_transfers() == ((), ())
    plan_fields = {f.name for f in dataclasses.fields(StepPlan)}
    assert {"host_saves", "host_loads"} <= plan_fields
    assert Block(1).block_id == 1


class FlakyShadow(ShadowExecutor):
    """A shadow executor whose plans fail (before any copy runs) at the given step ids."""

    def __init__(self, cache: KVCacheManager, failing: set[int]) -> None:
        super().__init__(cache)
        self.failing = failing

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.step_id in self.failing:
            raise RuntimeError("device lost")
        return super().execute(plan)


@st.composite
def _busy_runs(draw: st.DrawFn) -> tuple[CacheLayout, list[list[int]], set[int], set[int]]:
    layout, _, _ = draw(_runs())
    waves = draw(
        st.lists(
            st.lists(st.integers(0, 5), min_size=1, max_size=3),  # prompts of a wave, by session
            min_size=3,
            max_size=8,
        )
    )
    failing = draw(st.sets(st.integers(1, 60), max_size=3))
    aborting = draw(st.sets(st.integers(1, 60), max_size=3))
    return layout, waves, failing, aborting


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_busy_runs())
def test_host_transfers_hold_with_requests_in_flight_aborts_and_failed_steps(
    run: tuple[CacheLayout, list[list[int]], set[int], set[int]],
) -> None:
    """Several requests at once share prefixes; some are aborted, some steps fail: every
    transfer still carries its content, and no prefetch leaks or outlives its request."""
    layout, waves, failing, aborting = run
    cache = KVCacheManager(layout)  # no exact tails: turns here share no session
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4), cache)
    engine = Engine(scheduler, FlakyShadow(cache, failing))
    system = [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7]
    step_no = 0
    for w, wave in enumerate(waves):
        for i, session in enumerate(wave):
            prompt = [*system, *[(session * 5 + k) % 4 for k in range(4 + 4 * session)], w % 4]
            request = Request(
                req_id=f"w{w}-{i}",
                prompt_token_ids=tuple(prompt),
                sampling=SamplingParams(max_tokens=1 + (w + i) % 4, ignore_eos=True),
            )
            engine.add_request(request)
        for _ in range(400):
            if not engine.has_requests():
                break
            step_no += 1
            if step_no in aborting and engine.request_ids():
                engine.abort(engine.request_ids()[-1])
            with contextlib.suppress(StepFailed):
                engine.step()
            _check(cache)
            assert set(cache._prefetch) <= set(engine.request_ids())
        assert not engine.has_requests(), "the engine did not drain"
    assert not cache._prefetch
