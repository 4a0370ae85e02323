"""A stateful property test of the KV cache: block pool, group managers and coordinator.

A Hypothesis `RuleBasedStateMachine` plays a scheduler against one `KVCacheManager`: it admits
requests (lookup, then allocation of a first chunk), advances them by random chunks, decodes,
finishes, preempts and re-admits them, and throws oversized requests at a small pool. Prompts
come from a four-token alphabet and extend earlier prompts, so prefixes are shared; some carry a
`cache_salt`. Every machine run draws one layout of a family (full attention; + sliding window;
+ Mamba; + Mamba + draft KV), block sizes of 4 or 8 tokens, an alignment unit A that the layout
accepts, a speculative method (none, EAGLE, DFlash), a retention and a 24-64 block pool.

Align-mode Mamba layouts are chunked as the scheduler chunks them (a prefill chunk that does
not finish the known tokens ends on the state block grid), mostly also at the checkpoints the
cache asks for (`planned_checkpoints`, then `checkpoint_positions`).

Checked after every rule: `check_invariants()`, pool conservation, per-request tables (running
requests hold blocks, others hold none; a registered block sits at or below the computed tokens
and carries the request's own hash), and the admission metrics (one sample per admission, none
for a failed one). Checked at every allocation: a Mamba state is registered only where one was
materialised; a failed admission leaves the pool exactly as it was. Checked at every lookup: the
hit is capped, aligned, isolated per salt, does not mutate the pool, is the largest length every
group can serve (an oracle written from SPEC.md 2.1-2.4, not from the group code), does not
depend on group order, and is not ready when it needs a Mamba state registered in the same step.
Freeing follows SPEC.md 1.2's free-queue order exactly. A prefilled prompt untouched by eviction
is hit again by an identical resend and by an extending sibling (SPEC.md 8.8). Under DFlash a
shadow manager without speculation replays the same calls and must agree exactly (SPEC.md 8.7).

Deterministic regression tests at the end pin four defects this machine found, all fixed:
retention with A finer than a state or window block, align-mode Mamba with lookahead slots, a
copy-on-write target taken from another group's hit, and `boundary` retention with A finer than
the full-attention block.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hybridserve.core.config import SpeculativeConfig
from hybridserve.kvcache import (
    Allocation,
    CacheHit,
    CacheLayout,
    DraftSpec,
    FullAttentionSpec,
    GroupSpec,
    KVCacheManager,
    MambaSpec,
    Retention,
    SlidingWindowSpec,
)
from hybridserve.kvcache.coordinator import reconcile
from hybridserve.kvcache.hashing import BlockHash, cache_key, derived_hashes
from hybridserve.kvcache.retention import RetentionKind
from hybridserve.kvcache.spec import MambaCacheMode

ALPHABET = 4  # token ids 0..3: unrelated prompts rarely collide, extensions share prefixes
MAX_PROMPT = 48
MAX_TOKENS = 64  # prompt plus output; a request at this length stops decoding
MAX_WAITING = 4
MAX_RUNNING = 6
SALTS = (None, None, "tenant-a", "tenant-b")
FAMILIES = ("full", "full+swa", "full+mamba", "full+mamba+draft")

PoolState = tuple[tuple[int, ...], tuple[tuple[int, bytes | None], ...], int]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pool_state(manager: KVCacheManager) -> PoolState:
    """Everything a lookup must leave alone: free-queue order, ref counts, keys, evictions."""
    pool = manager.pool
    return (
        tuple(pool.free_queue.block_ids()),
        tuple((b.ref_cnt, b.key) for b in pool.blocks),
        pool.num_evictions,
    )


def metrics_state(manager: KVCacheManager) -> tuple[object, ...]:
    """The admission counters (a deep copy), without registration or eviction counts."""
    return dataclasses.astuple(manager.metrics)


@dataclass
class Req:
    rid: str
    tokens: list[int]
    salt: str | None
    hashes: list[BlockHash]
    num_prompt: int
    computed: int = 0  # tokens computed, hit included (0 while waiting)
    running: bool = False
    resumed: bool = False  # preempted at least once: its next admission is a resumption
    admitted_hit: int = 0
    evictions_at_admission: int = 0
    checkpoints_honoured: bool = True
    failed_admissions: int = 0


@dataclass
class ExpectedMetrics:
    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    preempted_requests: int = 0
    preempted_queried_tokens: int = 0
    preempted_hit_tokens: int = 0


def draw_tokens(data: st.DataObject, min_size: int, max_size: int) -> list[int]:
    """Token ids from the small alphabet, drawn as one byte string (one draw, not one each)."""
    raw = data.draw(st.binary(min_size=min_size, max_size=max_size), label="tokens")
    return [byte % ALPHABET for byte in raw]


def draw_layout(data: st.DataObject, family: str) -> CacheLayout:
    def block_size() -> int:
        return data.draw(st.sampled_from((4, 8)), label="block_size")

    groups: list[FullAttentionSpec | SlidingWindowSpec | MambaSpec | DraftSpec] = [
        FullAttentionSpec(block_size=block_size(), mla=data.draw(st.booleans(), label="mla"))
    ]
    if family == "full+swa":
        window = data.draw(st.integers(1, 20), label="window")
        groups.append(SlidingWindowSpec(block_size=block_size(), window=window))
    if "mamba" in family:
        mode = data.draw(
            st.sampled_from((MambaCacheMode.ALIGN, MambaCacheMode.ALIGN, MambaCacheMode.ALL)),
            label="mamba_mode",
        )
        checkpoint = mode is MambaCacheMode.ALIGN and data.draw(st.booleans(), label="ckpt")
        groups.append(MambaSpec(block_size=block_size(), mode=mode, prefill_checkpoint=checkpoint))
    if family.endswith("draft"):
        groups.append(
            DraftSpec(
                block_size=block_size(),
                window=data.draw(st.integers(1, 16), label="draft_window"),
                extra_tokens=data.draw(st.integers(0, 8), label="draft_extra"),
            )
        )
    units = [g.block_size for g in groups]
    page = math.lcm(*units)
    hash_block = data.draw(st.sampled_from(sorted({math.gcd(*units), 4})), label="H")
    alignment = data.draw(
        st.sampled_from([a for a in (4, 8) if a % hash_block == 0 and page % a == 0]),
        label="A",
    )
    # EAGLE with vLLM 0.33's lookahead block hashes, and on the legacy one-block-drop path.
    method = data.draw(st.sampled_from(("none", "eagle", "eagle-legacy", "dflash")), label="method")
    num_drafts = 0 if method == "none" else data.draw(st.integers(1, 3), label="num_drafts")
    # A retention interval is a multiple of the scheduler block, on layouts with a state or
    # window group (CacheLayout rejects anything else).
    interval = data.draw(st.sampled_from((page, 2 * page, 3 * page)), label="interval")
    kinds = ["dense", "boundary", "boundary+predecessor"]
    if any(not isinstance(g, FullAttentionSpec) for g in groups):
        kinds.append(f"interval:{interval}")
    retention = data.draw(st.sampled_from(kinds), label="retention")
    return CacheLayout(
        groups=tuple(groups),
        # Mostly small: eviction and allocation failure must happen within a short run.
        num_blocks=data.draw(st.one_of(st.integers(24, 32), st.integers(24, 64)), label="blocks"),
        hash_block_size=hash_block,
        alignment_tokens=alignment,
        speculative=SpeculativeConfig.from_name(method, num_drafts),
        retention=Retention.parse(retention),
    )


class CacheMachine(RuleBasedStateMachine):
    """One manager driven like a scheduler would drive it (see the module docstring)."""

    family = "full"  # set per subclass: which layouts `build` draws

    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager | None = None
        self.shadow: KVCacheManager | None = None  # DFlash only: the same layout, no speculation
        self.waiting: dict[str, Req] = {}
        self.running: dict[str, Req] = {}
        self.corpus: list[tuple[list[int], str | None]] = []
        self.scheduled: set[str] = set()  # requests scheduled in the current step
        self.fresh: set[tuple[int, bytes]] = set()  # Mamba (block id, key) registered this step
        self.expected = ExpectedMetrics()
        self.next_id = 0
        self.next_salt = 0

    # ----- helpers ------------------------------------------------------------------------------

    @property
    def m(self) -> KVCacheManager:
        assert self.manager is not None
        return self.manager

    def _mamba_groups(self) -> list[int]:
        return [g for g, s in enumerate(self.m.layout.groups) if isinstance(s, MambaSpec)]

    def _keyed_mamba_blocks(self) -> set[tuple[int, bytes]]:
        gids = set(self._mamba_groups())
        return {
            (b.block_id, b.key)
            for b in self.m.pool.blocks
            if b.key is not None and b.group_id in gids
        }

    def _new_step(self) -> None:
        self.m.new_step()
        if self.shadow is not None:
            self.shadow.new_step()
        self.scheduled.clear()
        self.fresh.clear()

    def _schedule(self, rid: str) -> None:
        """A request is scheduled at most once per step: open a new step if it already was."""
        if rid in self.scheduled:
            self._new_step()
        self.scheduled.add(rid)

    def _fresh_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _hash(self, tokens: Sequence[int], salt: str | None) -> list[BlockHash]:
        return self.m.hasher.hash_tokens(tokens, cache_salt=salt)

    def _sources(self) -> list[tuple[list[int], str | None]]:
        live = [(r.tokens, r.salt) for r in (*self.waiting.values(), *self.running.values())]
        return self.corpus + live

    def _draw_prompt(self, data: st.DataObject) -> tuple[list[int], str | None]:
        """A prompt: a prefix of an earlier sequence (or nothing) plus fresh tokens."""
        sources = self._sources()
        tokens: list[int] = []
        salt = data.draw(st.sampled_from(SALTS), label="salt")
        if sources and data.draw(st.integers(0, 3), label="extend") != 0:
            base, base_salt = sources[data.draw(st.integers(0, len(sources) - 1), label="src")]
            keep = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))), label="keep")
            tokens = list(base[:keep])
            if data.draw(st.integers(0, 4), label="resalt") != 0:
                salt = base_salt
        size = data.draw(st.integers(0 if tokens else 1, 32), label="size")
        tokens = (tokens + draw_tokens(data, size, size))[:MAX_PROMPT]
        return tokens or [0], salt

    # ----- mirrored manager calls ---------------------------------------------------------------

    def _find_hit(
        self, hashes: Sequence[BlockHash], num_tokens: int, *, resumed: bool = False
    ) -> tuple[CacheHit, CacheHit | None]:
        """find_hit with every lookup property checked (and mirrored on the shadow)."""
        m = self.m
        before = pool_state(m)
        hit = m.find_hit(hashes, num_tokens, resumed=resumed)
        assert pool_state(m) == before, "find_hit mutated the pool"
        a, cap = m.layout.alignment_tokens, num_tokens - 1
        assert 0 <= hit.num_tokens <= max(cap, 0), (hit.num_tokens, num_tokens)
        assert hit.num_tokens % a == 0, (hit.num_tokens, a)
        assert hit.num_tokens <= m.cacheable_tokens(num_tokens)
        if hit.sample is not None:
            assert hit.sample.queried_tokens == num_tokens
            assert hit.sample.hit_tokens == hit.num_tokens
            assert hit.sample.resumed == resumed
            assert len(hit.sample.group_offered_tokens) == m.layout.num_groups
        if cap >= a:
            self._check_reconciliation(hashes, num_tokens, hit)
        else:
            assert hit.num_tokens == 0
        self._check_readiness(hit)
        assert pool_state(m) == before, "checking the lookup mutated the pool"
        shadow_hit = None
        if self.shadow is not None:
            shadow_hit = self.shadow.find_hit(hashes, num_tokens, resumed=resumed)
            assert shadow_hit.num_tokens == hit.num_tokens, "DFlash lost a target hit"
            assert shadow_hit.ready == hit.ready
            assert shadow_hit.sample == hit.sample
            assert [[b.block_id for b in bl] for bl in shadow_hit.group_blocks] == [
                [b.block_id for b in bl] for bl in hit.group_blocks
            ]
        return hit, shadow_hit

    def _allocate(
        self,
        rid: str,
        hashes: Sequence[BlockHash],
        hits: tuple[CacheHit, CacheHit | None] | None,
        *,
        num_tokens: int,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        num_prompt_tokens: int | None = None,
        full_sequence_must_fit: bool = False,
    ) -> Allocation | None:
        """allocate, mirrored; records the Mamba states it registered as fresh this step."""
        m, mamba = self.m, self._mamba_groups()
        before = self._keyed_mamba_blocks()
        # A free cached state block handed out again is evicted; if this request registers
        # the same key into it, only the eviction tells that it was registered anew.
        free_cached = {
            b.block_id
            for b in m.pool.blocks
            if b.ref_cnt == 0 and b.key is not None and b.group_id in mamba
        }
        results = []
        calls = [(m, hits[0] if hits else None)]
        if self.shadow is not None:
            calls.append((self.shadow, hits[1] if hits else None))
        for manager, hit in calls:
            results.append(
                manager.allocate(
                    rid,
                    hashes,
                    num_tokens=num_tokens,
                    num_computed_tokens=num_computed_tokens,
                    num_new_tokens=num_new_tokens,
                    num_lookahead_tokens=num_lookahead_tokens,
                    hit=hit,
                    num_prompt_tokens=num_prompt_tokens,
                    full_sequence_must_fit=full_sequence_must_fit,
                )
            )
            if manager is self.m and results[0] is not None:
                touched = {b.block_id for g in mamba for b in (hit.group_blocks[g] if hit else ())}
                recycled = {
                    (b.block_id, b.key)
                    for g in mamba
                    for b in m.groups[g].tables.get(rid, [])
                    if b.key is not None and b.block_id in free_cached - touched
                }
                new_states = (self._keyed_mamba_blocks() - before) | recycled
                self.fresh |= new_states
                computed = num_computed_tokens + (hit.num_tokens if hit is not None else 0)
                self._check_new_states(
                    rid, new_states, computed, computed + num_new_tokens, num_tokens
                )
        if len(results) == 2:
            assert results[1] == results[0], "DFlash allocated differently from no speculation"
        return results[0]

    def _check_new_states(
        self,
        rid: str,
        new_states: set[tuple[int, bytes]],
        computed: int,
        chunk_end: int,
        num_tokens: int,
    ) -> None:
        """A state is registered only where one was materialised (SPEC.md 2.4): in align mode
        at the end of the chunk just scheduled, or at the last block boundary of a final chunk
        that starts on the grid when the group writes a prefill checkpoint; in `all` mode at
        any block end the chunk computed."""
        m = self.m
        ids = {block_id for block_id, _ in new_states}
        for g in self._mamba_groups():
            spec = m.layout.groups[g]
            assert isinstance(spec, MambaSpec)
            unit = spec.block_size
            for index, block in enumerate(m.groups[g].tables.get(rid, [])):
                if block.block_id not in ids or block is m.pool.null_block:
                    continue
                position = (index + 1) * unit
                if spec.mode is MambaCacheMode.ALL:
                    # Every block end holds a state once computed; registration may lag a chunk
                    # (vLLM rounds the cached length down to the scheduler block).
                    assert 0 < position <= chunk_end, (position, computed, chunk_end)
                    continue
                # A prefill checkpoint holds one block end strictly inside a chunk that starts
                # on the grid and spans a block (vLLM's num_prefill_checkpoint_blocks = 1).
                checkpoint = (
                    spec.prefill_checkpoint
                    and computed % unit == 0
                    and chunk_end - computed >= unit
                    and computed < position < chunk_end
                )
                assert position == chunk_end or checkpoint, (
                    f"group {g} registered a state at {position}, but the chunk "
                    f"[{computed}, {chunk_end}) of {num_tokens} tokens materialised none there"
                )

    def _free(self, rid: str) -> None:
        """free, with the exact free-queue order of SPEC.md 1.2 checked."""
        m = self.m
        queue = m.pool.free_queue.block_ids()
        refs = {b.block_id: b.ref_cnt for b in m.pool.blocks}
        null = m.pool.null_block
        for group in m.groups:
            head: list[int] = []
            tail: list[int] = []
            for block in reversed(group.tables.get(rid, [])):
                if block is null:
                    continue
                refs[block.block_id] -= 1
                if refs[block.block_id] == 0:
                    (tail if block.key is not None else head).append(block.block_id)
            queue = head + queue + tail
        m.free(rid)
        assert m.pool.free_queue.block_ids() == queue, "freed blocks entered in the wrong order"
        assert all(not t for t in m.block_ids(rid))
        if self.shadow is not None:
            self.shadow.free(rid)

    # ----- lookup properties ----------------------------------------------------------------------

    def _serves(self, gid: int, cached: Sequence[bool], length: int, cap: int, reach: int) -> bool:
        """Whether group `gid` can resume at `length`, by SPEC.md 2.1, 2.2, 2.4 and 3.2.

        `cached[i]`: whether the pool holds the group's block i of the request. A dropping
        group may read its margin up to `reach` (vLLM's hybrid coordinator: the hashed length)."""
        if length == 0:
            return True
        m = self.m
        spec, unit, a = m.layout.groups[gid], m.layout.units[gid], m.layout.alignment_tokens
        margin = a if m.layout.drops_tail(gid) else 0
        if margin and isinstance(spec, SlidingWindowSpec | DraftSpec) and a % unit == 0:
            top = max(reach, cap)
            return length % a == 0 and _window_serves_after_drop(spec, unit, a, cached, length, top)
        if margin:
            cap = reach
        if length % a or length + margin > cap:
            return False
        end = cdiv(length + margin, unit)  # blocks up to the end of the content needed
        if end > len(cached):
            return False
        if isinstance(spec, FullAttentionSpec):
            # k consecutive blocks from block 0, at most cap // U of them.
            return end <= cap // unit and all(cached[:end])
        if isinstance(spec, SlidingWindowSpec | DraftSpec):
            first = max(length - spec.lookback_tokens, 0) // unit
            return all(cached[first:end])
        assert isinstance(spec, MambaSpec)
        return length % unit == 0 and cached[length // unit - 1]

    def _check_reconciliation(
        self, hashes: Sequence[BlockHash], num_tokens: int, hit: CacheHit
    ) -> None:
        m = self.m
        a, cap, n = m.layout.alignment_tokens, num_tokens - 1, m.layout.num_groups
        per_group = [derived_hashes(hashes, g.ctx.hash_ratio) for g in m.groups]
        cached = [
            [m.pool.get_cached(cache_key(h, g)) is not None for h in per_group[g]] for g in range(n)
        ]
        drops = [m.layout.drops_tail(g) for g in range(n)]
        reach = len(hashes) * m.layout.hash_block_size if n > 1 else cap
        lookups = [
            g.lookup(h, reach if drops[i] else cap, base=hashes)
            for i, (g, h) in enumerate(zip(m.groups, per_group, strict=True))
        ]
        margins = [g.eagle_margin for g in m.groups]
        rec = reconcile(lookups, drops, alignment=a, cap=cap, reach=reach, margins=margins)
        length = rec.num_tokens
        assert length == hit.num_tokens
        assert hit.sample is None or hit.sample.group_offered_tokens == rec.offered
        # Group order does not matter: permuted lookups reconcile to the same length.
        for perm in itertools.permutations(range(n)):
            other = reconcile(
                [lookups[i] for i in perm],
                [drops[i] for i in perm],
                alignment=a,
                cap=cap,
                reach=reach,
                margins=[margins[i] for i in perm],
            )
            assert other.num_tokens == length, (perm, other, rec)
            assert other.offered == tuple(rec.offered[i] for i in perm)
        # Every group serves the reconciled length, queried as the coordinator queries it ...
        for g, lookup in enumerate(lookups):
            limit = min(length + margins[g], max(reach, cap)) if drops[g] else length
            assert lookup.serve(limit, drops[g]) >= length, (g, limit, length)
            assert self._serves(g, cached[g], length, cap, reach), (g, length)
        # ... and no longer aligned length up to the cap is served by every group. (Group 0 is
        # full attention in every layout here; it serves nothing past its run of cached blocks.)
        run = next((i for i, hit_i in enumerate(cached[0]) if not hit_i), len(cached[0]))
        longest = min(cap, run * m.layout.units[0])
        for longer in range(length + a, longest + 1, a):
            assert not all(self._serves(g, cached[g], longer, cap, reach) for g in range(n)), (
                f"reconciled {length} but every group serves {longer}"
            )
        # Block lists: L // U entries (null padding only before a window or state), the right
        # content in each, and a copy-on-write source exactly when L ends inside a block.
        null = m.pool.null_block
        for g, blocks in enumerate(hit.group_blocks):
            unit, spec = m.layout.units[g], m.layout.groups[g]
            assert len(blocks) == length // unit, (g, len(blocks), length, unit)
            if isinstance(spec, FullAttentionSpec):
                assert null not in blocks
            for index, block in enumerate(blocks):
                if block is not null:
                    assert block.key == cache_key(per_group[g][index], g)
            cow = hit.cow_sources[g]
            if isinstance(spec, MambaSpec) or length % unit == 0:
                assert cow is None
            else:
                assert cow is not None and cow.key == cache_key(per_group[g][length // unit], g)

    def _check_readiness(self, hit: CacheHit) -> None:
        """A Mamba state registered in this step is never served: such a hit is not ready."""
        null = self.m.pool.null_block
        fresh_keys = {key for _, key in self.fresh}
        uses_fresh_block = uses_fresh_key = False
        for g in self._mamba_groups():
            blocks = hit.group_blocks[g]
            if blocks and blocks[-1] is not null:
                last = blocks[-1]
                assert last.key is not None
                uses_fresh_block |= (last.block_id, last.key) in self.fresh
                uses_fresh_key |= last.key in fresh_keys
        if uses_fresh_block:
            assert not hit.ready, "a Mamba state registered this step was offered as ready"
        if not hit.ready:
            assert uses_fresh_key, "a hit was held back with no state registered this step"

    # ----- rules ------------------------------------------------------------------------------

    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        layout = draw_layout(data, self.family)
        self.manager = KVCacheManager(layout)
        if layout.speculative.method.value == "dflash":
            self.shadow = KVCacheManager(
                CacheLayout(
                    groups=layout.groups,
                    num_blocks=layout.num_blocks,
                    hash_block_size=layout.hash_block_size,
                    alignment_tokens=layout.alignment_tokens,
                    retention=layout.retention,
                )
            )
        self._new_step()

    @precondition(lambda self: len(self.waiting) < MAX_WAITING)
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        tokens, salt = self._draw_prompt(data)
        rid = self._fresh_id()
        self.waiting[rid] = Req(rid, tokens, salt, self._hash(tokens, salt), len(tokens))

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def scheduler_step(self, data: st.DataObject) -> None:
        """A new step: most running requests advance by a chunk, then waiters are admitted."""
        self._new_step()
        for rid in sorted(self.running):
            if data.draw(st.integers(0, 4), label="skip") != 0:
                self._advance(data, rid)
        for rid in sorted(self.waiting):
            if len(self.running) < MAX_RUNNING and data.draw(st.booleans(), label="admit"):
                self._admit(data, rid)

    @precondition(lambda self: self.waiting and len(self.running) < MAX_RUNNING)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """Lookup, then allocate a first chunk (in the current step)."""
        self._admit(data, data.draw(st.sampled_from(sorted(self.waiting)), label="rid"))

    def _admit(self, data: st.DataObject, rid: str) -> None:
        """Lookup, then allocate a first chunk; a failure leaves everything as it was."""
        req = self.waiting[rid]
        self._schedule(rid)
        m = self.m
        num_tokens = len(req.tokens)
        hits = self._find_hit(req.hashes, num_tokens, resumed=req.resumed)
        hit = hits[0]
        end, honoured = self._chunk_end(data, req, hit.num_tokens, hit)
        before, metrics = pool_state(m), metrics_state(m)
        evictions = m.pool.num_evictions
        lookahead = self._lookahead(data)
        allocation = self._allocate(
            rid,
            req.hashes,
            hits,
            num_tokens=num_tokens,
            num_computed_tokens=0,
            num_new_tokens=end - hit.num_tokens,
            num_lookahead_tokens=lookahead,
            num_prompt_tokens=req.num_prompt,
            full_sequence_must_fit=data.draw(st.booleans(), label="must_fit"),
        )
        if not hit.ready:
            assert allocation is None, "allocate accepted a hit that is not ready"
        if allocation is None:
            event("admit: not ready" if not hit.ready else "admit: allocation failed")
            assert pool_state(m) == before, "a failed admission changed the pool"
            assert metrics_state(m) == metrics, "a failed admission committed metrics"
            assert all(not t for t in m.block_ids(rid))
            req.failed_admissions += 1
            return
        self._check_new_tables(rid, hit, allocation)
        if req.resumed:
            self.expected.preempted_requests += 1
            self.expected.preempted_queried_tokens += num_tokens
            self.expected.preempted_hit_tokens += hit.num_tokens
        else:
            self.expected.requests += 1
            self.expected.queried_tokens += num_tokens
            self.expected.hit_tokens += hit.num_tokens
        if req.failed_admissions:
            event("admit: admitted after failing")
        event(f"admit: hit {'> 0' if hit.num_tokens else '= 0'}")
        del self.waiting[rid]
        self.running[rid] = req
        req.running = True
        req.admitted_hit = hit.num_tokens
        req.evictions_at_admission = evictions
        req.checkpoints_honoured = honoured
        self._completed_chunk(data, req, end)

    def _lookahead(self, data: st.DataObject) -> int:
        k = self.m.layout.speculative.num_speculative_tokens
        return data.draw(st.sampled_from((0, k)), label="lookahead") if k else 0

    def _chunk_end(
        self, data: st.DataObject, req: Req, position: int, hit: CacheHit | None
    ) -> tuple[int, bool]:
        """Where a chunk from `position` ends: random, cut as an align-mode scheduler cuts it
        (a prefill chunk that does not finish the known tokens ends on the state grid), and
        mostly also at the next checkpoint the cache asks for. Also: whether it was."""
        num_tokens = len(req.tokens)
        end = min(position + data.draw(st.integers(1, 24), label="chunk"), num_tokens)
        grid = self._align_block()
        free_chunking = data.draw(st.integers(0, 3), label="free") == 0
        if grid and end < num_tokens and not free_chunking:
            if position % grid:
                end = min(end, (position // grid + 1) * grid)
            else:
                end = max(end // grid * grid, min(position + grid, num_tokens))
        honour = data.draw(st.integers(0, 9), label="honour") != 0
        if honour:
            m = self.m
            if req.running:
                positions = m.checkpoint_positions(req.rid)
            else:
                positions = m.planned_checkpoints(req.num_prompt, hit)
            end = min([p for p in positions if position < p < end] + [end])
        return end, honour

    def _align_block(self) -> int:
        """The block of align-mode state groups (their chunk grid), or 0."""
        sizes = [
            s.block_size
            for s in self.m.layout.groups
            if isinstance(s, MambaSpec) and s.mode is MambaCacheMode.ALIGN
        ]
        return max(sizes, default=0)

    def _completed_chunk(self, data: st.DataObject, req: Req, end: int) -> None:
        """Record a successful step; a step reaching the end samples one output token."""
        req.computed = end
        self._check_table(req)
        if end == len(req.tokens) and len(req.tokens) < MAX_TOKENS:
            req.tokens.append(data.draw(st.integers(0, ALPHABET - 1), label="sampled"))
            self.m.hasher.extend(req.hashes, req.tokens, cache_salt=req.salt)

    def _check_new_tables(self, rid: str, hit: CacheHit, allocation: Allocation) -> None:
        """A new table starts with the hit's blocks; a copy-on-write tail is copied once."""
        m = self.m
        tables = m.block_ids(rid)
        for g, blocks in enumerate(hit.group_blocks):
            assert tables[g][: len(blocks)] == tuple(b.block_id for b in blocks)
        copies = {c.group_id: c for c in allocation.block_copies}
        for g, cow in enumerate(hit.cow_sources):
            if cow is None:
                assert g not in copies
                continue
            copy = copies[g]
            unit = m.layout.units[g]
            assert copy.src_block_id == cow.block_id
            assert copy.dst_block_id == tables[g][len(hit.group_blocks[g])]
            assert copy.num_tokens == hit.num_tokens % unit

    def _check_table(self, req: Req) -> None:
        """Registered blocks sit below the computed tokens and carry the request's own hash."""
        m = self.m
        null = m.pool.null_block
        for g, group in enumerate(m.groups):
            unit = m.layout.units[g]
            hashes = derived_hashes(req.hashes, group.ctx.hash_ratio)
            table = group.tables.get(req.rid, [])
            if isinstance(m.layout.groups[g], FullAttentionSpec):
                assert null not in table and len(table) >= cdiv(req.computed, unit)
            for index, block in enumerate(table):
                if block is null or block.key is None:
                    continue
                assert (index + 1) * unit <= req.computed, "registered past the computed tokens"
                assert block.key == cache_key(hashes[index], g), "registered the wrong content"

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """One chunk of prefill, or one decode step (in the current step)."""
        self._advance(data, data.draw(st.sampled_from(sorted(self.running)), label="rid"))

    def _advance(self, data: st.DataObject, rid: str) -> None:
        """One chunk of prefill, or one decode step; a failure releases at most."""
        req = self.running[rid]
        if req.computed >= len(req.tokens):
            return  # at MAX_TOKENS: nothing left to compute
        self._schedule(rid)
        m = self.m
        end, honoured = self._chunk_end(data, req, req.computed, None)
        lookahead = self._lookahead(data)
        before = pool_state(m)
        metrics = metrics_state(m)
        allocation = self._allocate(
            rid,
            req.hashes,
            None,
            num_tokens=len(req.tokens),
            num_computed_tokens=req.computed,
            num_new_tokens=end - req.computed,
            num_lookahead_tokens=lookahead,
        )
        assert metrics_state(m) == metrics, "a running request committed admission metrics"
        if allocation is None:
            event("advance: allocation failed")
            after = pool_state(m)
            assert len(after[0]) >= len(before[0])
            for (ref_before, key_before), (ref_after, key_after) in zip(
                before[1], after[1], strict=True
            ):
                assert ref_after <= ref_before, "a failed allocation took a block"
                assert key_after == key_before, "a failed allocation registered or evicted"
            return
        assert not allocation.block_copies
        req.checkpoints_honoured &= honoured
        self._completed_chunk(data, req, end)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        req = self.running.pop(rid)
        self._free(rid)
        req.running = False
        self.corpus = [*self.corpus, (req.tokens, req.salt)][-16:]

    @precondition(lambda self: self.running and len(self.waiting) < MAX_WAITING)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """Free everything; the request comes back later through a fresh lookup."""
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        req = self.running.pop(rid)
        self._free(rid)
        req.running = False
        req.resumed = True
        req.computed = 0
        req.checkpoints_honoured = True
        self.waiting[rid] = req

    @precondition(lambda self: self.corpus or self.running)
    @rule(data=st.data())
    def pressure(self, data: st.DataObject) -> None:
        """A request too large for the pool fails and leaves the pool exactly as it was."""
        m = self.m
        if data.draw(st.booleans(), label="new_step"):
            self._new_step()
        base, salt = self._draw_prompt(data)
        widest = max(m.layout.units)
        length = 2 * (m.layout.num_blocks + 1) * widest
        filler = data.draw(st.integers(0, ALPHABET - 1), label="filler")
        tokens = base + [filler] * (length - len(base))
        hashes = self._hash(tokens, salt)
        rid = self._fresh_id()
        hits = self._find_hit(hashes, len(tokens))
        hit = hits[0]
        must_fit = data.draw(st.booleans(), label="must_fit")
        chunk = data.draw(st.integers(1, 8), label="chunk") if must_fit else length - hit.num_tokens
        before, metrics = pool_state(m), metrics_state(m)
        free = m.num_free_blocks
        allocation = self._allocate(
            rid,
            hashes,
            hits,
            num_tokens=len(tokens),
            num_computed_tokens=0,
            num_new_tokens=chunk,
            num_prompt_tokens=len(tokens),
            full_sequence_must_fit=must_fit,
        )
        assert allocation is None, "an oversized request was admitted"
        assert m.num_free_blocks == free
        assert pool_state(m) == before
        assert metrics_state(m) == metrics
        assert all(not t for t in m.block_ids(rid))

    @precondition(lambda self: self.corpus or self.running or self.waiting)
    @rule(data=st.data())
    def lookups_alone(self, data: st.DataObject) -> None:
        """Lookups with no allocation: a known sequence's prefix plus a few tokens, and the
        whole sequence under a salt never used before, which shares no block: its hit is 0."""
        sources = self._sources()
        base, salt = sources[data.draw(st.integers(0, len(sources) - 1), label="src")]
        tokens = list(base[: data.draw(st.integers(1, len(base)), label="keep")])
        tokens += draw_tokens(data, 0, 8)
        self._find_hit(self._hash(tokens, salt), len(tokens))
        self.next_salt += 1
        hit, _ = self._find_hit(self._hash(base, f"fresh-{self.next_salt}"), len(base))
        assert hit.num_tokens == 0, "a hit crossed cache salts"

    @precondition(lambda self: self.scheduled & set(self.running))
    @rule(data=st.data())
    def sibling_in_same_step(self, data: st.DataObject) -> None:
        """A sibling of a request scheduled in this step looks up (and tries to allocate)
        in the same step: a Mamba state registered in this step must not be served."""
        rid = data.draw(st.sampled_from(sorted(self.scheduled & set(self.running))), label="rid")
        req = self.running[rid]
        keep = data.draw(st.integers(1, req.computed), label="keep") if req.computed else 1
        tokens = req.tokens[:keep] + draw_tokens(data, 0, 6)
        hashes = self._hash(tokens, req.salt)
        hits = self._find_hit(hashes, len(tokens))
        if hits[0].ready:
            return
        m = self.m
        before, metrics = pool_state(m), metrics_state(m)
        sibling = self._fresh_id()
        allocation = self._allocate(
            sibling,
            hashes,
            hits,
            num_tokens=len(tokens),
            num_computed_tokens=0,
            num_new_tokens=len(tokens) - hits[0].num_tokens,
            num_prompt_tokens=len(tokens),
        )
        assert allocation is None, "allocate accepted a hit that is not ready"
        assert pool_state(m) == before and metrics_state(m) == metrics

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def resend_of_untouched_prompt_hits(self, data: st.DataObject) -> None:
        """SPEC.md 8.8: an identical resend and an extending sibling of a prefilled prompt hit
        something, provided nothing was evicted since its admission, whenever the prompt is long
        enough: cap >= 2A when A is the page; in general, the full-attention match floor(cap/U)*U
        less the EAGLE drop must reach the page P, the first position every group can serve."""
        m = self.m
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        req = self.running[rid]
        layout = m.layout
        a = layout.alignment_tokens
        cap = req.num_prompt - 1
        unit = max(
            u
            for spec, u in zip(layout.groups, layout.units, strict=True)
            if isinstance(spec, FullAttentionSpec)
        )
        drop = a if layout.speculative.drops_target_tail else 0
        if (
            req.resumed
            or req.admitted_hit
            or req.computed < req.num_prompt
            or not req.checkpoints_honoured
            or m.pool.num_evictions != req.evictions_at_admission
            or cap < 2 * a
            or cap // unit * unit - drop < layout.page_tokens
            or (
                layout.retention.kind is RetentionKind.BOUNDARY
                and layout.speculative.drops_target_tail
            )
        ):
            # `boundary` keeps no predecessor: under EAGLE the lookup lands one A below what it
            # keeps and hits 0 (SPEC.md 3.4); that is the rule, not a defect.
            return
        event("resend: checked")
        self._new_step()  # states registered so far are final now
        prompt = req.tokens[: req.num_prompt]
        resend, _ = self._find_hit(self._hash(prompt, req.salt), len(prompt))
        extended = [*prompt, data.draw(st.integers(0, ALPHABET - 1), label="next")]
        sibling, _ = self._find_hit(self._hash(extended, req.salt), len(extended))
        assert resend.num_tokens > 0, "an identical resend of a retained prompt missed"
        assert sibling.num_tokens > 0, "an extending sibling of a retained prompt missed"

    # ----- invariants -------------------------------------------------------------------------

    @invariant()
    def cache_invariants_hold(self) -> None:
        if self.manager is None:
            return
        m = self.m
        m.check_invariants()
        pool = m.pool
        referenced = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert pool.num_free_blocks + referenced + 1 == pool.num_blocks

    @invariant()
    def requests_hold_blocks_iff_running(self) -> None:
        if self.manager is None:
            return
        m = self.m
        assert not set(self.running) & set(self.waiting)
        for rid in self.waiting:
            assert all(not t for t in m.block_ids(rid)), f"waiting {rid} holds blocks"
        for rid, req in self.running.items():
            # A window-1 group may hold only null entries (nothing before the next token).
            assert all(rid in group.tables for group in m.groups), f"running {rid} holds nothing"
            self._check_table(req)
        known = set(self.running)
        owner: dict[int, int] = {}  # block id -> the one group whose tables hold it
        null = m.pool.null_block
        for g, group in enumerate(m.groups):
            assert set(group.tables) <= known, "a freed or unknown request holds blocks"
            blocks = [b for table in group.tables.values() for b in table if b is not null]
            for block in [*blocks, *group.cow_holds]:
                assert owner.setdefault(block.block_id, g) == g, (
                    f"block {block.block_id} is held by groups {owner[block.block_id]} and {g}"
                )

    @invariant()
    def admissions_are_counted_once(self) -> None:
        if self.manager is None:
            return
        metrics = self.m.metrics
        assert metrics.requests == self.expected.requests
        assert metrics.queried_tokens == self.expected.queried_tokens
        assert metrics.hit_tokens == self.expected.hit_tokens
        assert metrics.preempted_requests == self.expected.preempted_requests
        assert metrics.preempted_queried_tokens == self.expected.preempted_queried_tokens
        assert metrics.preempted_hit_tokens == self.expected.preempted_hit_tokens

    @invariant()
    def dflash_matches_no_speculation(self) -> None:
        if self.shadow is None:
            return
        assert pool_state(self.shadow) == pool_state(self.m)
        assert self.shadow.metrics_snapshot() == self.m.metrics_snapshot()


MACHINE_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _window_serves_after_drop(
    spec: SlidingWindowSpec | DraftSpec,
    unit: int,
    a: int,
    cached: Sequence[bool],
    length: int,
    top: int,
) -> bool:
    """SPEC.md 2.2 under the EAGLE drop with A on the block grid (vLLM): the window before L
    and the block after it are cached, that block inside the margin read min(L + U, top);
    below one window, the cached run from block 0 hits at its last block starting on the A
    grid, rounded down to A, less one block rounded down to A again."""
    limit_blocks = min(length + unit, top) // unit
    if length >= spec.lookback_tokens:
        last = length // unit
        first = (length - spec.lookback_tokens) // unit
        return last < min(limit_blocks, len(cached)) and all(cached[first : last + 1])
    run = 0
    while run < min(limit_blocks, len(cached)) and cached[run]:
        run += 1
    if run == 0:
        return False
    edge = (run - 1) * unit // a * a
    kept = (edge + unit) // a * a
    return kept > 0 and (kept - unit) // a * a >= length


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_keeps_invariants_and_lookup_properties_under_random_scheduling(
    family: str,
) -> None:
    machine = type(f"CacheMachine[{family}]", (CacheMachine,), {"family": family})
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)


# ----- alignment finer than a state or window group's block ---------------------------------


def _prefill_then_resend(layout: CacheLayout, num_tokens: int) -> tuple[int, int]:
    """Prefill a prompt of `num_tokens` distinct tokens in chunks ending at the checkpoints
    the manager plans, free it; return the hits of an identical resend and of a sibling that
    extends it by one token."""
    manager = KVCacheManager(layout)
    prompt = list(range(num_tokens))
    hashes = manager.hasher.hash_tokens(prompt)
    manager.new_step()
    hit = manager.find_hit(hashes, num_tokens)
    assert hit.num_tokens == 0
    position = 0
    for end in sorted({*manager.planned_checkpoints(num_tokens, hit), num_tokens}):
        allocation = manager.allocate(
            "producer",
            hashes,
            num_tokens=num_tokens,
            num_computed_tokens=position,
            num_new_tokens=end - position,
            hit=hit if position == 0 else None,
            num_prompt_tokens=num_tokens,
        )
        assert allocation is not None
        position = end
        manager.new_step()
    manager.free("producer")
    manager.new_step()
    resend = manager.find_hit(hashes, num_tokens).num_tokens
    sibling_hashes = manager.hasher.hash_tokens([*prompt, num_tokens])
    sibling = manager.find_hit(sibling_hashes, num_tokens + 1).num_tokens
    return resend, sibling


FINE_ALIGNMENT_CASES = {
    # Mamba states exist only at multiples of 8: the boundary 36 on the A grid must fall to 32.
    "mamba-block-8-A-4": (
        (FullAttentionSpec(block_size=4), MambaSpec(block_size=8)),
        "none",
        37,
    ),
    # EAGLE lands the full-attention lookup on 28 = 32 - A, where Mamba holds no state: 24.
    "mamba-block-8-A-4-eagle": (
        (FullAttentionSpec(block_size=8), MambaSpec(block_size=8)),
        "eagle-legacy",
        33,
    ),
    # The draft window (block 8) can serve 16 but not 20 (its block 2 is not full): the
    # Mamba state must be kept at 16 as well as at 20.
    "draft-block-8-A-4": (
        (
            FullAttentionSpec(block_size=4),
            MambaSpec(block_size=4),
            DraftSpec(block_size=8, window=9),
        ),
        "dflash",
        21,
    ),
}


@pytest.mark.parametrize("case", sorted(FINE_ALIGNMENT_CASES))
def test_resend_of_a_prefilled_prompt_hits_when_alignment_is_finer_than_a_group_block(
    case: str,
) -> None:
    groups, method, num_tokens = FINE_ALIGNMENT_CASES[case]
    layout = CacheLayout(
        groups=groups,
        num_blocks=64,
        hash_block_size=4,
        alignment_tokens=4,
        speculative=SpeculativeConfig.from_name(method),
        retention=Retention.parse("boundary+predecessor"),
    )
    assert num_tokens - 1 >= 2 * layout.alignment_tokens
    resend, sibling = _prefill_then_resend(layout, num_tokens)
    assert resend > 0 and sibling > 0, (resend, sibling)


@pytest.mark.parametrize("case", sorted(FINE_ALIGNMENT_CASES))
def test_resend_of_a_prefilled_prompt_hits_when_alignment_is_the_page(case: str) -> None:
    """The same prompts with A left at the page (the coarse geometry) hit as well."""
    groups, method, num_tokens = FINE_ALIGNMENT_CASES[case]
    layout = CacheLayout(
        groups=groups,
        num_blocks=64,
        speculative=SpeculativeConfig.from_name(method),
        retention=Retention.parse("boundary+predecessor"),
    )
    resend, sibling = _prefill_then_resend(layout, num_tokens)
    assert resend > 0 and sibling > 0, (resend, sibling)


# ----- align-mode Mamba with lookahead slots ----------------------------------------------


def test_align_mode_registers_no_state_at_a_block_end_no_chunk_ended_on() -> None:
    """The calls the in-tree scheduler makes under EAGLE (one draft token, retention
    `boundary`): prefill [0, 16) (its last-block stop, one block back), [16, 26), then decode
    one token a step. A sibling sharing 33 tokens must not restore a state at 24."""
    layout = CacheLayout(
        groups=(FullAttentionSpec(block_size=8), MambaSpec(block_size=8)),
        num_blocks=64,
        speculative=SpeculativeConfig.from_name("eagle-legacy", 1),
        retention=Retention.parse("boundary"),
    )
    manager = KVCacheManager(layout)
    tokens = list(range(26))
    hashes = manager.hasher.hash_tokens(tokens)
    manager.new_step()
    hit = manager.find_hit(hashes, len(tokens))
    chunks = [(0, 16), (16, 26)] + [(n, n + 1) for n in range(26, 34)]
    for start, end in chunks:
        allocation = manager.allocate(
            "producer",
            hashes,
            num_tokens=len(tokens),
            num_computed_tokens=start,
            num_new_tokens=end - start,
            num_lookahead_tokens=1,
            hit=hit if start == 0 else None,
            num_prompt_tokens=26,
        )
        assert allocation is not None
        if end == len(tokens):  # sampled one token
            tokens.append(1000 + len(tokens))
            manager.hasher.extend(hashes, tokens)
        manager.new_step()
    manager.free("producer")
    manager.new_step()
    # Chunks ended at 16, 26, 27, ..., 34: no Mamba state was ever computed at 24.
    sibling = [*tokens[:33], 5000]
    hit = manager.find_hit(manager.hasher.hash_tokens(sibling), len(sibling))
    assert hit.num_tokens != 24, "restored block as the state at 24; it holds the state at 16"


def test_eagle_resend_reuses_the_predecessor_state_with_lookahead_slots() -> None:
    _eagle_resend_with_lookahead(1)


def test_eagle_resend_reuses_the_predecessor_state_without_lookahead_slots() -> None:
    _eagle_resend_with_lookahead(0)


def _eagle_resend_with_lookahead(lookahead: int) -> None:
    """The calls the in-tree scheduler makes for a 40-token prompt under EAGLE (retention
    boundary+predecessor, blocks of 8): chunks end at the checkpoints 24 and 32, then 40."""
    layout = CacheLayout(
        groups=(FullAttentionSpec(block_size=8), MambaSpec(block_size=8)),
        num_blocks=64,
        speculative=SpeculativeConfig.from_name("eagle-legacy", 1),
        retention=Retention.parse("boundary+predecessor"),
    )
    manager = KVCacheManager(layout)
    prompt = list(range(40))
    hashes = manager.hasher.hash_tokens(prompt)
    manager.new_step()
    hit = manager.find_hit(hashes, len(prompt))
    assert manager.planned_checkpoints(len(prompt), hit) == (24, 32)
    for start, end in ((0, 24), (24, 32), (32, 40)):
        allocation = manager.allocate(
            "producer",
            hashes,
            num_tokens=len(prompt),
            num_computed_tokens=start,
            num_new_tokens=end - start,
            num_lookahead_tokens=lookahead,
            hit=hit if start == 0 else None,
            num_prompt_tokens=len(prompt),
        )
        assert allocation is not None
        manager.new_step()
    manager.free("producer")
    manager.new_step()
    # The hybrid coordinator reads the EAGLE margin up to the hashed length (40): full attention
    # matches 40 and drops one A, and the state at 32 serves the resend (vLLM 0.33).
    assert manager.find_hit(hashes, len(prompt)).num_tokens == 32
    # A sibling sharing 33 tokens: full attention matches 32, drops to 24, where the
    # predecessor state serves it.
    sibling = [*prompt[:33], 5000]
    assert manager.find_hit(manager.hasher.hash_tokens(sibling), len(sibling)).num_tokens == 24


# ----- regression tests for defects this machine found (fixed) -------------------------------


def test_copy_on_write_target_is_never_another_groups_hit_block() -> None:
    """A hit at 12 with full-attention blocks of 8 (so a copy-on-write tail) and a Mamba state
    block at 12 that sits free at the head of the free queue (after the full hit blocks)."""
    layout = CacheLayout(
        groups=(FullAttentionSpec(block_size=8), MambaSpec(block_size=4, mode=MambaCacheMode.ALL)),
        num_blocks=15,
        hash_block_size=4,
        alignment_tokens=4,
        retention=Retention.parse("boundary"),
    )
    manager = KVCacheManager(layout)

    def run(req_id: str, tokens: list[int], *, free: bool) -> None:
        hashes = manager.hasher.hash_tokens(tokens)
        manager.new_step()
        hit = manager.find_hit(hashes, len(tokens))
        allocation = manager.allocate(
            req_id,
            hashes,
            num_tokens=len(tokens),
            num_computed_tokens=0,
            num_new_tokens=len(tokens) - hit.num_tokens,
            hit=hit,
            num_prompt_tokens=len(tokens),
        )
        assert allocation is not None
        if free:
            manager.free(req_id)

    # The producer: a 13-token prompt (its Mamba state at 12 is kept), then three decode steps
    # so that full attention caches [0, 16).
    producer = list(range(13))
    hashes = manager.hasher.hash_tokens(producer)
    manager.new_step()
    hit = manager.find_hit(hashes, 13)
    assert manager.allocate(
        "producer",
        hashes,
        num_tokens=13,
        num_computed_tokens=0,
        num_new_tokens=13,
        hit=hit,
        num_prompt_tokens=13,
    )
    for n in range(13, 16):
        producer.append(100 + n)
        manager.hasher.extend(hashes, producer)
        manager.new_step()
        assert manager.allocate(
            "producer", hashes, num_tokens=n + 1, num_computed_tokens=n, num_new_tokens=1
        )
    manager.free("producer")
    run("filler-freed", [500 + i for i in range(24)], free=True)  # cached blocks behind it
    run("filler-running", [700 + i for i in range(12)], free=False)  # takes what is before it
    consumer = [*producer[:16], 999, 999]
    hashes = manager.hasher.hash_tokens(consumer)
    manager.new_step()
    hit = manager.find_hit(hashes, len(consumer))
    assert hit.num_tokens == 12 and hit.cow_sources[0] is not None
    state_block = hit.group_blocks[1][-1].block_id
    queue = manager.pool.free_queue.block_ids()
    full_hit = {hit.group_blocks[0][0].block_id, hit.cow_sources[0].block_id}
    assert set(queue[:2]) == full_hit and queue[2] == state_block, queue
    allocation = manager.allocate(
        "consumer",
        hashes,
        num_tokens=len(consumer),
        num_computed_tokens=0,
        num_new_tokens=len(consumer) - 12,
        hit=hit,
        num_prompt_tokens=len(consumer),
    )
    assert allocation is not None
    full, mamba = manager.block_ids("consumer")
    assert mamba[2] == state_block
    assert state_block not in full, f"block {state_block} is both a KV copy target and a state"


@pytest.mark.parametrize("second", ["mamba-all", "mamba-align", "swa"])
def test_boundary_retention_keeps_a_position_full_attention_reaches(second: str) -> None:
    specs: dict[str, GroupSpec] = {
        "mamba-all": MambaSpec(block_size=4, mode=MambaCacheMode.ALL),
        "mamba-align": MambaSpec(block_size=4),
        "swa": SlidingWindowSpec(block_size=4, window=4),
    }
    layout = CacheLayout(
        groups=(FullAttentionSpec(block_size=8), specs[second]),
        num_blocks=64,
        hash_block_size=4,
        alignment_tokens=4,
        retention=Retention.parse("boundary"),
    )
    resend, sibling = _prefill_then_resend(layout, 31)
    assert resend == sibling == 24, (resend, sibling)
