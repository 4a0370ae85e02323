"""Exact tails past their pins: a session's turn end, kept through the host tier.

With exact tails a finished turn's pin holds its exact end (the partial last block of each
full-attention group, each state group's running state) so that its next turn resumes there
rather than at the last boundary the cache kept. When the pin is released before the session
comes back (its TTL ran out, or an admission needed the room) and the cache has a host tier,
the end is not dropped: the blocks that have no prefix hash are saved to the host under tail
keys (`hashing.tail_key`; the save runs before the step that may reuse them), and the session
keeps a `HostTail` naming every block's key. Its next turn's lookup (`session_hit`) finds those
blocks on the device or the host like any cached block: a prefetch loads what is on the host,
and the turn resumes at the exact end. Used or superseded, the tail keys leave both tiers.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridserve.kvcache.block_pool import Block, BlockPool
from hybridserve.kvcache.hashing import BlockHash, is_tail_key, tail_key
from hybridserve.kvcache.host_tier import HostTier
from hybridserve.kvcache.pins import HostTail, PinStats, Tail

# Sessions are swept for ends whose blocks are gone once there are this many, or twice as many
# as the last sweep left.
_FIRST_SWEEP = 64


class HostTails:
    """The exact ends the host tier keeps, one per session."""

    def __init__(self, pool: BlockPool, host: HostTier, stats: PinStats) -> None:
        self.pool = pool
        self.host = host
        self.stats = stats
        self._tails: dict[str, HostTail] = {}
        self._sweep_at = _FIRST_SWEEP

    def keep(self, session: str, tail: Tail) -> bool:
        """A pin holding `tail` is being released: save its blocks that have no prefix hash
        to the host, and keep the keys of all of them for the session. False, keeping nothing,
        when the host could not take them."""
        self.forget(session)
        null = self.pool.null_block
        saved: list[bytes] = []

        def key_of(block: Block, group_id: int, index: int) -> bytes | None:
            if block.key is not None:
                return block.key
            key = tail_key(session, tail.num_tokens, tail.prefix_hash, group_id, index)
            if not self.host.save_as(block, key, group_id):
                return None
            saved.append(key)
            return key

        group_keys: list[tuple[bytes | None, ...]] = []
        cow_keys: list[bytes | None] = []
        for gid, (blocks, cow) in enumerate(zip(tail.group_blocks, tail.cow_sources, strict=True)):
            keys = [None if b is null else key_of(b, gid, i) for i, b in enumerate(blocks)]
            cow_key = None if cow is None else key_of(cow, gid, -1)
            missing = sum(k is None for k in keys) != sum(b is null for b in blocks)
            if missing or (cow is not None and cow_key is None):
                self._drop(saved)
                return False
            group_keys.append(tuple(keys))
            cow_keys.append(cow_key)
        if any(key not in self.host for key in saved):  # a later save took an earlier slot
            self._drop(saved)
            return False
        self._tails[session] = HostTail(
            tail.num_tokens, tail.prefix_hash, tail.tail_tokens, tuple(group_keys), tuple(cow_keys)
        )
        self.stats.tails_to_host += 1
        if len(self._tails) > self._sweep_at:
            self._sweep()
        return True

    def find(
        self,
        session: str,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        hash_block: int,
    ) -> tuple[int, tuple[tuple[Block, ...], ...], tuple[Block | None, ...]] | None:
        """The session's kept end, if this prompt (its hashes and tokens) starts with it and
        every block of it is cached on the device or the host: its length, every group's
        blocks and copy-on-write sources (host blocks among them). Does not mutate."""
        tail = self._tails.get(session)
        if (
            tail is None
            or tail.num_tokens > len(token_ids) - 1
            or not tail.serves(block_hashes, token_ids, hash_block)
        ):
            return None
        group_blocks: list[tuple[Block, ...]] = []
        for keys in tail.group_keys:
            found = [self._block(key) for key in keys]
            blocks = tuple(b for b in found if b is not None)
            if len(blocks) != len(found):
                return None
            group_blocks.append(blocks)
        cows = tuple(None if key is None else self._block(key) for key in tail.cow_keys)
        if sum(c is None for c in cows) != sum(key is None for key in tail.cow_keys):
            return None
        return tail.num_tokens, tuple(group_blocks), cows

    def holds(self, session: str) -> bool:
        return session in self._tails

    def forget(self, session: str) -> None:
        """The session came back, or has a newer end: its tail keys leave both tiers."""
        tail = self._tails.pop(session, None)
        if tail is not None:
            self._drop([k for keys in (*tail.group_keys, tail.cow_keys) for k in keys if k])

    def _block(self, key: bytes | None) -> Block | None:
        return self.pool.null_block if key is None else self.pool.get_cached(key)

    def _drop(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if is_tail_key(key):
                self.pool.unregister_key(key)
                self.host.forget_key(key)

    def _sweep(self) -> None:
        """Forget the ends some block of which is cached nowhere any more."""
        for session, tail in list(self._tails.items()):
            keys = [k for keys in (*tail.group_keys, tail.cow_keys) for k in keys if k]
            if any(self.pool.get_cached(k) is None for k in keys):
                self.forget(session)
        self._sweep_at = max(_FIRST_SWEEP, 2 * len(self._tails))

    def __len__(self) -> int:
        return len(self._tails)
