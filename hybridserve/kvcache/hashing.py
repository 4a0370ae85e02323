"""Chained block hashes over a canonical byte encoding (no pickle).

hash_i = D(hash_{i-1} or ROOT, tokens of block i, extra keys of block i). A match on hash i
therefore implies the whole prefix [0, (i+1)*H) matches. Only full blocks are hashed.
`cache_salt` is an extra key of block 0 only; the chain carries it to every later block.

With lookahead L > 0 (vLLM 0.33's lookahead block hashes under EAGLE/MTP) the hash of block i
also covers the L tokens after it, and it exists only once those tokens do.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

from hybridserve.core.errors import ConfigError

BlockHash = bytes
ExtraKey = str | int

_GROUP_ID = struct.Struct(">I")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    import xxhash  # optional dependency: the `fast` extra

    return bytes(xxhash.xxh3_128_digest(data))


def get_digest(algo: str) -> Callable[[bytes], bytes]:
    """The digest function for `algo` ('sha256' or 'xxh3_128')."""
    if algo == "sha256":
        return _sha256
    if algo == "xxh3_128":
        try:
            import xxhash  # noqa: F401
        except ImportError:
            raise ConfigError(
                "hash_algo", algo, "install the xxhash package (pip install 'hybridserve[fast]')"
            ) from None
        return _xxh3_128
    raise ConfigError("hash_algo", algo, "use sha256 or xxh3_128")


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Little-endian signed 64-bit ids: the same bytes on every machine."""
    encoded = array("q", token_ids)
    if sys.byteorder == "big":
        encoded.byteswap()
    return encoded.tobytes()


def encode_extra_keys(extra_keys: Sequence[ExtraKey]) -> bytes:
    """Tagged, length-prefixed encoding so that ('ab',) and ('a', 'b') never collide."""
    parts = [b"X", struct.pack("<I", len(extra_keys))]
    for key in extra_keys:
        if isinstance(key, str):
            raw = key.encode("utf-8")
            parts += [b"s", struct.pack("<I", len(raw)), raw]
        else:
            parts += [b"i", struct.pack("<q", key)]
    return b"".join(parts)


class BlockHasher:
    """Computes a request's chained hashes incrementally, H tokens per block."""

    def __init__(
        self,
        block_size: int,
        algo: str = "sha256",
        seed: bytes = b"hybridserve",
        *,
        lookahead: int = 0,
    ) -> None:
        if block_size < 1:
            raise ConfigError("hash_block_size", block_size, "use a positive block size")
        if lookahead < 0:
            raise ConfigError("hash_lookahead_tokens", lookahead, "use 0 or more tokens")
        self.block_size = block_size
        self.lookahead = lookahead
        self._digest = get_digest(algo)
        # A fixed root keeps hashes reproducible across processes (vLLM's NONE_HASH is random
        # unless PYTHONHASHSEED is set).
        self.root: BlockHash = self._digest(b"root:" + seed)

    def hash_block(
        self,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: Sequence[ExtraKey] = (),
    ) -> BlockHash:
        if len(token_ids) != self.block_size:
            raise ValueError(f"a block hash needs {self.block_size} tokens, got {len(token_ids)}")
        data = (parent or self.root) + encode_tokens(token_ids)
        if extra_keys:
            data += encode_extra_keys(extra_keys)
        return self._digest(data)

    def extend(
        self,
        hashes: list[BlockHash],
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        extra_keys: Sequence[ExtraKey] = (),
    ) -> list[BlockHash]:
        """Append the hashes of every newly full block of `token_ids` to `hashes` (in place).

        `extra_keys` (a LoRA name, say) go on every block; `cache_salt` on block 0 only.
        """
        size, lookahead = self.block_size, self.lookahead
        num_full = (len(token_ids) - lookahead) // size
        start = len(hashes)
        if start >= num_full:
            return hashes
        parent = hashes[-1] if hashes else self.root
        # Encode the new blocks once and slice the bytes: the hot path of a long prompt.
        raw = encode_tokens(token_ids[start * size : num_full * size])
        width = 8 * size
        digest = self._digest
        common = encode_extra_keys(extra_keys) if extra_keys else b""
        for index in range(start, num_full):
            offset = (index - start) * width
            data = parent + raw[offset : offset + width]
            if lookahead:
                end = (index + 1) * size
                data += b"L" + encode_tokens(token_ids[end : end + lookahead])
            if index == 0 and cache_salt is not None:
                data += encode_extra_keys((*extra_keys, "salt", cache_salt))
            elif common:
                data += common
            parent = digest(data)
            hashes.append(parent)
        return hashes

    def num_hashable(self, num_tokens: int) -> int:
        """How many block hashes a sequence of `num_tokens` tokens has."""
        return max(num_tokens - self.lookahead, 0) // self.block_size

    def hash_tokens(
        self, token_ids: Sequence[int], *, cache_salt: str | None = None
    ) -> list[BlockHash]:
        return self.extend([], token_ids, cache_salt=cache_salt)


def cache_key(block_hash: BlockHash, group_id: int) -> bytes:
    """The pool's map key: the hash followed by the group id as 4 big-endian bytes."""
    return block_hash + _GROUP_ID.pack(group_id)


# A turn's exact end saved to the host tier (a partial last block, a running state) has no
# prefix hash: it is kept under a tail key, 24 bytes before the group id, a length no block hash
# has (sha256 32, xxh3-128 16), so it never meets a prefix lookup and is never a KV event.
_TAIL_PREFIX = b"\x00tail\x00"
_TAIL_HASH_LEN = 24


def tail_key(
    session: str, num_tokens: int, prefix_hash: BlockHash, group_id: int, index: int
) -> bytes:
    """The pool key of one block of a session's exact turn end (`index`: its table position,
    -1 for a copy-on-write source)."""
    digest = hashlib.sha256(
        b"%s\x00%d\x00%d\x00" % (session.encode("utf-8", "surrogatepass"), num_tokens, index)
        + prefix_hash
    ).digest()
    return cache_key(_TAIL_PREFIX + digest[: _TAIL_HASH_LEN - len(_TAIL_PREFIX)], group_id)


def is_tail_key(key: bytes) -> bool:
    """Whether a pool key is a `tail_key` (not a prefix hash)."""
    return len(key) == _TAIL_HASH_LEN + _GROUP_ID.size and key.startswith(_TAIL_PREFIX)


def derived_hashes(base: Sequence[BlockHash], ratio: int) -> Sequence[BlockHash]:
    """Hashes at a unit of `ratio` hash blocks.

    Unit j covers base blocks [j*ratio, (j+1)*ratio). Because the chain makes the last base hash
    of a unit identify the whole prefix, that hash alone identifies the unit.
    """
    if ratio == 1:
        return base
    return base[ratio - 1 :: ratio]
