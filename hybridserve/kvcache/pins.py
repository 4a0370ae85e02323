"""Tool-call pins: the blocks a session's finished turn holds out of eviction until its TTL,
and with exact tails the turn's exact end (a partial last block and the running state).

`PinTable` owns the pins and the count of pins on each block, so that the pinned share of the
pool counts a block once; the cache manager decides what a pin holds (`pinned_blocks`,
`exact_tail`) and asks the table to hold it. Sessions are keyed by `Request.session_key`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

from hybridserve.kvcache.block_pool import Block, BlockPool
from hybridserve.kvcache.groups import GroupManager
from hybridserve.kvcache.groups.mamba import MambaManager
from hybridserve.kvcache.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class Tail:
    """A finished turn's exact end, held with its session's pin: every group's blocks for a
    resume at `num_tokens` (a partial last block and the running state as copy-on-write
    sources), and what a later prompt must start with to use them: the hash of the last whole
    hash block at or below `num_tokens` and the tokens after it."""

    num_tokens: int
    prefix_hash: BlockHash
    tail_tokens: tuple[int, ...]
    group_blocks: tuple[tuple[Block, ...], ...]
    cow_sources: tuple[Block | None, ...]

    def serves(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], hash_block: int
    ) -> bool:
        """Whether a prompt with these hashes and tokens starts with this turn's tokens."""
        return continues(self, block_hashes, token_ids, hash_block)


def continues(
    end: Tail | HostTail,
    block_hashes: Sequence[BlockHash],
    token_ids: Sequence[int],
    hash_block: int,
) -> bool:
    """Whether a prompt with these hashes and tokens starts with the tokens of a turn's end."""
    whole = end.num_tokens // hash_block
    return (
        len(block_hashes) >= whole
        and block_hashes[whole - 1] == end.prefix_hash
        and tuple(token_ids[whole * hash_block : end.num_tokens]) == end.tail_tokens
    )


@dataclass(frozen=True, slots=True)
class HostTail:
    """A released pin's exact end, kept for its session through the host tier: the pool key of
    every group's block (None: the null block) and copy-on-write source. Blocks that had no
    prefix hash (the partial last block, the running state) were saved under tail keys; the
    others are found under their hashes, on the device or the host, as any prefix."""

    num_tokens: int
    prefix_hash: BlockHash
    tail_tokens: tuple[int, ...]
    group_keys: tuple[tuple[bytes | None, ...], ...]
    cow_keys: tuple[bytes | None, ...]

    def serves(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], hash_block: int
    ) -> bool:
        return continues(self, block_hashes, token_ids, hash_block)


@dataclass(frozen=True, slots=True)
class Pin:
    """One session's pinned prefix: one extra reference on each block, until `deadline`; with
    exact tails, the turn's end as well (its blocks are among `blocks`)."""

    blocks: tuple[Block, ...]
    deadline: float
    tail: Tail | None = None


@dataclass(slots=True)
class PinStats:
    """Pins made, refused (over the pool fraction) and released, by cause."""

    pinned: int = 0
    refused: int = 0
    released_on_return: int = 0
    released_on_ttl: int = 0
    released_on_pressure: int = 0
    tails: int = 0  # pins that also hold their turn's exact end (exact tails)
    tail_hits: int = 0  # admissions that resumed at a pinned exact end
    tails_to_host: int = 0  # exact ends of released pins kept through the host tier
    host_tail_hits: int = 0  # admissions that resumed at an exact end the host tier kept


class PinTable:
    """The pins of one cache, over its block pool (each pin holds one reference per block)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.stats = PinStats()
        self._pins: dict[str, Pin] = {}
        self._refs: dict[int, int] = {}  # block id -> pins holding it
        # Called with (session, tail) before a pin holding an exact end is released on its TTL
        # or for room (not on its session's return, nor when a newer turn replaces it).
        self.on_release: Callable[[str, Tail], object] | None = None

    def hold(
        self,
        session: str,
        blocks: Sequence[Block],
        *,
        deadline: float,
        tail: Tail | None,
        max_pinned_blocks: int,
    ) -> int:
        """Pin `blocks` (distinct, none the null block) for `session` until `deadline`, after
        releasing its earlier pin. Refused, holding nothing, when the distinct pinned blocks
        would exceed `max_pinned_blocks`. Returns the number of blocks pinned."""
        self.release(session)
        if not blocks:
            return 0
        new = sum(1 for b in blocks if b.block_id not in self._refs)
        if len(self._refs) + new > max_pinned_blocks:
            self.stats.refused += 1
            return 0
        self.pool.touch(blocks)
        for block in blocks:
            self._refs[block.block_id] = self._refs.get(block.block_id, 0) + 1
        self._pins[session] = Pin(tuple(blocks), deadline, tail)
        self.stats.pinned += 1
        if tail is not None:
            self.stats.tails += 1
        return len(blocks)

    def release(self, session: str) -> int:
        """Free the session's pin, if any (no cause counted). Returns the blocks it held."""
        pin = self._pins.pop(session, None)
        if pin is None:
            return 0
        for block in pin.blocks:
            left = self._refs[block.block_id] - 1
            if left:
                self._refs[block.block_id] = left
            else:
                del self._refs[block.block_id]
        self.pool.free(pin.blocks[::-1])  # deepest first, as a request's own free
        return len(pin.blocks)

    def unpin(self, session: str) -> int:
        """The session's next turn is back: release its pin. Returns the blocks it held."""
        released = self.release(session)
        if released:
            self.stats.released_on_return += 1
        return released

    def expire(self, now: float) -> int:
        """Release every pin whose TTL has run out by `now`. Returns how many."""
        if not self._pins:
            return 0
        expired = [sid for sid, pin in self._pins.items() if pin.deadline <= now]
        for sid in expired:
            self._let_go(sid)
        self.stats.released_on_ttl += len(expired)
        return len(expired)

    def release_soonest(self, *, keep: str | None = None) -> bool:
        """Memory pressure: release the pin that expires first (never `keep`'s). Returns False
        when there is none to release."""
        candidates = [(pin.deadline, sid) for sid, pin in self._pins.items() if sid != keep]
        if not candidates:
            return False
        self._let_go(min(candidates)[1])
        self.stats.released_on_pressure += 1
        return True

    def _let_go(self, session: str) -> None:
        """Release a pin its session has not come back for (its exact end offered first)."""
        tail = self._pins[session].tail
        if tail is not None and self.on_release is not None:
            self.on_release(session, tail)
        self.release(session)

    def claim(self, session: str) -> bool:
        """The session's next turn arrived: its pin no longer expires, and is held until that
        turn is admitted (`unpin`) or memory pressure releases it (claimed pins last)."""
        pin = self._pins.get(session)
        if pin is None:
            return False
        self._pins[session] = Pin(pin.blocks, math.inf, pin.tail)
        return True

    def deadline(self, session: str) -> float | None:
        pin = self._pins.get(session)
        return None if pin is None else pin.deadline

    def next_deadline(self) -> float | None:
        """The soonest TTL of any pin (claimed pins have none); None when no pin expires."""
        deadlines = [pin.deadline for pin in self._pins.values() if pin.deadline != math.inf]
        return min(deadlines, default=None)

    def tail(self, session: str) -> Tail | None:
        """The exact end the session's pin holds, if it holds one."""
        pin = self._pins.get(session)
        return pin.tail if pin is not None else None

    def held_blocks(self) -> Iterator[Block]:
        """Every block reference the pins hold (a block once per pin holding it)."""
        for pin in self._pins.values():
            yield from pin.blocks

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by pins."""
        return len(self._refs)

    @property
    def num_pins(self) -> int:
        return len(self._pins)


def exact_tail(
    groups: Sequence[GroupManager],
    full_groups: Collection[int],
    null: Block,
    *,
    hash_block: int,
    req_id: str,
    block_hashes: Sequence[BlockHash],
    token_ids: Sequence[int],
    num_tokens: int,
) -> Tail | None:
    """The blocks that resume a finishing request's sequence at exactly `num_tokens`, taken
    from its own tables; None where a group cannot give them (a kind other than full
    attention or an align-mode state, a missing block, or fewer tokens than one hash)."""
    whole = num_tokens // hash_block
    if whole == 0 or whole > len(block_hashes) or len(token_ids) < num_tokens:
        return None
    group_blocks: list[tuple[Block, ...]] = []
    cows: list[Block | None] = []
    for gid, group in enumerate(groups):
        table = group.tables.get(req_id, [])
        unit, partial = group.block_size, num_tokens % group.block_size
        if gid in full_groups:
            end = num_tokens // unit + (1 if partial else 0)
            if len(table) < end or any(b is null for b in table[:end]):
                return None
            group_blocks.append(tuple(table[: num_tokens // unit]))
            cows.append(table[end - 1] if partial else None)
        elif isinstance(group, MambaManager) and group.align:
            index = -(-num_tokens // unit) - 1
            if index >= len(table) or table[index] is null:
                return None
            state = table[index]
            group_blocks.append((null,) * index + (() if partial else (state,)))
            cows.append(state if partial else None)
        else:
            return None
    return Tail(
        num_tokens,
        block_hashes[whole - 1],
        tuple(token_ids[whole * hash_block : num_tokens]),
        tuple(group_blocks),
        tuple(cows),
    )
