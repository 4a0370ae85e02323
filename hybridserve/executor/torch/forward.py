"""ForwardContext: a step's view of the paged KV and recurrent state, handed to the model.

Attention metadata is built once per cache group per step and shared by the group's layers.
A batch is the plan's chunks concatenated (one flat token batch, each chunk's rows at an
offset). Attention packs it as variable-length sequences: per layer, one `index_select` gathers
every key the step needs, then one SDPA call runs per set of chunks with the same number of
queries (all the decodes together, each prefill chunk alone), so no chunk is padded to another's
query count and keys only to the longest chunk of its own call (`MAX_KEY_PADDING`). Chunks whose
block tables begin with the same blocks (a shared prompt prefix) attend to those keys in one
`PrefixCall`, gathered once, and merge it with their own keys by log-sum-exp (cascade
attention).

Under decode context parallelism (a `DcpGroup` of N > 1 ranks) a full-attention or MLA group's
KV is sharded by token: one block id covers `block_size * N` tokens, `block_size` of them on each
rank. Such a group gets `AttentionRows` (every row's position and block table) instead of SDPA
metadata, and its layers attend with `hybridserve.parallel`: write the owned rows, attend over
the local shard, merge across the group by log-sum-exp. MLA groups always take that path (with
N = 1 it is plain absorbed MLA). Sliding-window and recurrent groups are replicated on every
rank and run as without DCP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridserve.executor.torch import cpu_kernels
from hybridserve.executor.torch.cache import DeviceCache
from hybridserve.parallel.attention import partial_attention_chunks, write_owned_slots
from hybridserve.parallel.group import DcpGroup, all_gather_heads, merge_across_ranks
from hybridserve.parallel.layer import AttentionRows
from hybridserve.parallel.sharding import global_positions
from hybridserve.parallel.sparse import select_top_k

# Chunks with the same number of queries share one attention call, their keys padded to the
# longest of them; a new call starts where that padding would pass this share of the keys.
MAX_KEY_PADDING = 0.125
# Chunks whose block tables start with the same blocks attend to those shared keys in one call
# (cascade attention: gathered and read once, then merged by log-sum-exp with each chunk's own
# keys) when that saves at least this many gathered keys per layer.
MIN_SHARED_KEYS = 512
# ... and at least this share of the keys those chunks would gather alone. The merge runs the
# attention by hand (scores, log-sum-exp) where SDPA runs it fused: on a 2-core CPU (SmolLM2,
# 2 threads, a 992-token shared prefix) 32 decodes at 300 tokens of their own gained (138 ms a
# step against 162; 74% of the keys saved), while 12 decodes at 3,500 lost (650 ms against 423;
# 26% saved) and 4 at 3,500 too (219 against 145; 21% saved).
MIN_SHARED_FRACTION = 0.5
# ... and only for chunks of at most this many queries. The hand-run attention costs more per
# score than SDPA's fused kernel, and a chunk's scores grow with its queries while the gather
# it saves does not: 12 chunks after a shared 992-token prefix (SmolLM2, 2 threads) took the
# same with and without the merge at 16 queries each (2.02 against 2.03 s a step, the first
# prompt's whole prefill included), and lost at 32 (2.56-2.78 against 2.16-2.23), 64 (5.36
# against 3.11) and 256 (10.5 against 7.5); E1's first wave (a 1,182-token prompt and 11 more
# of 156-1,843 tokens after its 992-token system prompt) took 29.0 s against 17.5.
MAX_SHARED_QUERIES = 16


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """One attention call of a step: `num_seqs` chunks of `num_queries` queries each, over a
    `[num_seqs, num_keys]` region of the step's gathered keys. No query is padded; a chunk's
    keys are padded (and masked) only up to the longest chunk of the same call."""

    rows: torch.Tensor  # [B * Q]: rows of the flat batch, chunk after chunk
    first_row: int | None  # rows are first_row, first_row + 1, ... (a slice, no gather)
    num_seqs: int
    num_queries: int
    key_offset: int  # where the call's keys start in the gathered keys
    num_keys: int
    q_pos: torch.Tensor  # [B, Q]: position of each query
    k_pos: torch.Tensor  # [B, K]: position of each key, -1 for padding
    mask: torch.Tensor | None  # [B, 1, Q, K] bool, True = may attend; None: every key
    causal: bool  # every chunk from position 0 with Q == K: SDPA's causal mask, no tensor
    partial: bool = False  # the chunks' keys after a shared prefix: merged with a PrefixCall

    @property
    def computed(self) -> int:
        """Score elements per head the call computes (padding included)."""
        return self.num_seqs * self.num_queries * self.num_keys


@dataclass(frozen=True, slots=True)
class PrefixCall:
    """The first `num_keys` keys, the same blocks for every chunk of `rows` (a shared prompt
    prefix that every one of their queries sees whole): attended once for all of them."""

    rows: torch.Tensor  # [R]: rows of the flat batch of every chunk sharing the prefix
    key_offset: int
    num_keys: int

    @property
    def computed(self) -> int:
        return int(self.rows.numel()) * self.num_keys


@dataclass(frozen=True, slots=True)
class PagedDecodes:
    """The step's one-query chunks, attended by the CPU paged kernel (`cpu_kernels`) straight
    from the cache: no gather, no call."""

    rows: torch.Tensor  # [B]: row of the flat batch of each
    first_row: int | None  # rows are first_row, first_row + 1, ... (a slice, no gather)
    tables: torch.Tensor  # [B, W]: block tables, padded with 0
    lows: torch.Tensor  # [B]: first position each attends to (after a window)
    ends: torch.Tensor  # [B]: one past its query's position
    order: torch.Tensor  # [B]: the chunks longest first (the kernel's job order)
    num_keys: int  # keys attended, all of them together (the score elements per head)
    block_size: int


@dataclass(frozen=True, slots=True)
class AttentionMeta:
    """One attention group's step: where the new K/V go, which cache slots to gather (one
    `index_select` per layer), the attention calls over the gathered keys, and the decodes the
    paged kernel attends in place (`decodes`; then absent from the calls)."""

    slot_mapping: torch.Tensor  # [T]: flat cache slot of each new token
    key_slots: torch.Tensor  # [S]: cache slot of each gathered key, call regions in order
    calls: tuple[AttentionCall, ...]
    num_rows: int  # T
    prefix_calls: tuple[PrefixCall, ...] = ()
    decodes: PagedDecodes | None = None

    @property
    def computed_elements(self) -> int:
        """Attention score elements per head and layer computed this step."""
        paged = self.decodes.num_keys if self.decodes is not None else 0
        return (
            sum(c.computed for c in self.calls) + sum(c.computed for c in self.prefix_calls) + paged
        )


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Where one request's chunk lies: rows of the flat batch and positions."""

    row_start: int
    num_tokens: int
    start: int  # position of the first token
    table: Sequence[int]  # the group's block table (mirrored by the executor)


@dataclass(frozen=True, slots=True)
class StateChunk:
    """One request's chunk as a recurrent layer sees it."""

    index: int  # chunk index in the step
    rows: slice  # rows of the flat batch
    read_slot: int | None  # state slot to start from; None = zero state
    snapshots: tuple[int, ...]  # save the state after this many tokens of the chunk (ascending)
    slots: tuple[tuple[int, ...], ...]  # per snapshot, the state slots receiving it


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (built on the host) on `device`: on CUDA through pinned memory (PyTorch's caching
    host allocator reuses the pinned blocks between steps) with an asynchronous copy; a CPU
    tensor is returned as it is."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _call_groups(
    spans: Sequence[ChunkSpan], num_keys: Sequence[int], partial: Sequence[bool]
) -> list[list[int]]:
    """Chunk indices per attention call: equal query counts (and both after a shared prefix or
    neither), keys within MAX_KEY_PADDING of the call's longest."""
    by_queries: dict[tuple[int, bool], list[int]] = {}
    for i, span in enumerate(spans):
        by_queries.setdefault((span.num_tokens, partial[i]), []).append(i)
    groups: list[list[int]] = []
    for members in by_queries.values():
        members.sort(key=lambda i: -num_keys[i])
        group: list[int] = []
        longest = total = 0
        for i in members:
            if group and longest * (len(group) + 1) > (1 + MAX_KEY_PADDING) * (total + num_keys[i]):
                groups.append(group)
                group, total = [], 0
            if not group:
                longest = num_keys[i]
            group.append(i)
            total += num_keys[i]
        groups.append(group)
    # Batch order within a call: a step of decodes alone is then one call over rows 0..T-1.
    groups = [sorted(g, key=lambda i: spans[i].row_start) for g in groups]
    groups.sort(key=lambda g: spans[g[0]].row_start)
    return groups


def _shared_prefixes(spans: Sequence[ChunkSpan], block_size: int) -> list[tuple[list[int], int]]:
    """(chunk indices, shared tokens) per set of chunks whose tables begin with the same blocks
    and whose queries all come after them; only chunks of at most MAX_SHARED_QUERIES queries,
    and only sets that save MIN_SHARED_KEYS keys and MIN_SHARED_FRACTION of the keys their
    chunks would gather alone."""
    by_first: dict[int, list[int]] = {}
    for i, span in enumerate(spans):
        if (
            span.start >= block_size
            and span.table
            and span.table[0] != 0
            and span.num_tokens <= MAX_SHARED_QUERIES
        ):
            by_first.setdefault(span.table[0], []).append(i)
    shared = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        limit = min(spans[i].start // block_size for i in members)
        first = spans[members[0]].table
        length = 0
        while length < limit and all(spans[i].table[length] == first[length] for i in members):
            length += 1
        saved = length * block_size * (len(members) - 1)
        keys = sum(spans[i].start + spans[i].num_tokens for i in members)
        if saved >= MIN_SHARED_KEYS and saved >= MIN_SHARED_FRACTION * keys:
            shared.append((members, length * block_size))
    return shared


def _padded_tables(spans: Sequence[ChunkSpan]) -> torch.Tensor:
    width = max(1, max(len(s.table) for s in spans))
    return torch.tensor(
        [[*s.table, *([0] * (width - len(s.table)))] for s in spans], dtype=torch.long
    )


def window_pieces(spans: Sequence[ChunkSpan], window: int) -> list[ChunkSpan]:
    """Each chunk split into pieces of at most `window_piece(window)` queries (in row order). A
    piece's queries see only the `window` positions up to each, so a piece of P queries attends
    over at most window + P - 1 keys: a long prefill computes O(tokens * window) scores, not
    O(tokens^2) (the whole chunk would attend every query over its window plus all the chunk's
    tokens). Pieces of half a window compute 1.5x the scores the window needs, where pieces of
    a whole window computed 2x (a 2,048-token prefill of Gemma 3's 512-token window: 22.8 ms
    a layer against 30.1 for the attention, 2 threads); smaller pieces gain little more and
    gather more keys. The new tokens' K/V are all written before any piece gathers, so a piece
    sees the earlier pieces' tokens."""
    size = window_piece(window)
    pieces = []
    for span in spans:
        for offset in range(0, span.num_tokens, size):
            count = min(size, span.num_tokens - offset)
            pieces.append(
                ChunkSpan(span.row_start + offset, count, span.start + offset, span.table)
            )
    return pieces


def window_piece(window: int) -> int:
    """Queries per piece of a chunk under a sliding `window` (half the window)."""
    return max(1, (window + 1) // 2)


def build_attention_meta(
    spans: Sequence[ChunkSpan],
    *,
    block_size: int,
    window: int | None,
    device: torch.device,
    share_prefixes: bool = True,
    paged_decodes: bool = False,
) -> AttentionMeta:
    """Gather indices and attention calls for the chunks of one group (`window=None`: full
    attention). Built with vectorised index ops: the cost grows with the tokens, not with a
    Python loop over them. With `share_prefixes`, chunks of full attention that begin with
    the same blocks attend to them in one `PrefixCall`. Under a window, chunks longer than it
    attend in pieces of `window` queries, each gathering only its own window. With
    `paged_decodes`, the one-query chunks go to `PagedDecodes` (the CPU paged kernel) and the
    gathers and calls cover only the others."""
    if window is not None:
        spans = window_pieces(spans, window)
    tables = _padded_tables(spans)  # [N, W]
    starts = torch.tensor([s.start for s in spans], dtype=torch.long)
    counts = torch.tensor([s.num_tokens for s in spans], dtype=torch.long)
    ends = starts + counts
    lows = starts - window + 1 if window is not None else torch.zeros_like(starts)
    lows = lows.clamp(min=0)
    num_rows = int(counts.sum())
    # The new tokens' slots, in flat-batch order (chunks are laid out in span order).
    owner = torch.repeat_interleave(torch.arange(len(spans)), counts)
    row_starts = torch.tensor([s.row_start for s in spans], dtype=torch.long)
    positions = starts[owner] + torch.arange(num_rows) - row_starts[owner]
    slot_mapping = tables[owner, positions // block_size] * block_size + positions % block_size
    decodes = None
    if paged_decodes and bool((counts == 1).any()):
        single = (counts == 1).nonzero().flatten()
        decodes = _paged_decodes(spans, single, tables, lows, ends, block_size, device)
        rest = [i for i in range(len(spans)) if spans[i].num_tokens != 1]
        spans = [spans[i] for i in rest]
        tables, starts, counts, ends, lows, row_starts = (
            t[rest] for t in (tables, starts, counts, ends, lows, row_starts)
        )
    shared = _shared_prefixes(spans, block_size) if share_prefixes and window is None else []
    partial = [False] * len(spans)
    for members, length in shared:
        for i in members:
            partial[i] = True
            lows[i] = length
    num_keys = (ends - lows).tolist()
    calls, key_slots, offset = [], [], 0
    prefix_calls = []
    for members, length in shared:
        table = tables[members[0]]
        key_pos = torch.arange(length)
        key_slots.append(table[key_pos // block_size] * block_size + key_pos % block_size)
        rows = torch.cat(
            [
                torch.arange(spans[i].row_start, spans[i].row_start + spans[i].num_tokens)
                for i in members
            ]
        )
        prefix_calls.append(PrefixCall(to_device(rows, device), offset, length))
        offset += length
    for group in _call_groups(spans, num_keys, partial):
        index = torch.tensor(group, dtype=torch.long)
        num_q = spans[group[0]].num_tokens
        longest = max(num_keys[i] for i in group)
        q_pos = starts[index, None] + torch.arange(num_q)[None, :]  # [B, Q]
        k_pos = lows[index, None] + torch.arange(longest)[None, :]  # [B, K]
        k_pos = k_pos.masked_fill(k_pos >= ends[index, None], -1)
        valid = k_pos >= 0
        blocks = torch.gather(tables[index], 1, (k_pos.clamp(min=0) // block_size))
        slots = (blocks * block_size + k_pos.clamp(min=0) % block_size).masked_fill(~valid, 0)
        key_slots.append(slots.reshape(-1))
        rows = (row_starts[index, None] + torch.arange(num_q)[None, :]).reshape(-1)
        first = spans[group[0]].row_start
        contiguous = all(spans[i].row_start == first + j * num_q for j, i in enumerate(group))
        padded = bool((~valid).any())
        # Every chunk of the call attends exactly to its own queries' positions (fresh prompts
        # of one length): SDPA's causal mask serves them all, no mask tensor.
        causal = (
            num_q == longest > 1
            and not partial[group[0]]
            and bool((lows[index] == starts[index]).all())
            and (window is None or num_q <= window)
        )
        mask = None
        if (num_q > 1 and not causal) or padded:
            qp, kp = q_pos[:, :, None], k_pos[:, None, :]
            full = (kp <= qp) & (kp >= 0)
            if window is not None:
                full &= kp > qp - window
            mask = to_device(full[:, None], device)
        calls.append(
            AttentionCall(
                rows=to_device(rows, device),
                first_row=first if contiguous else None,
                num_seqs=len(group),
                num_queries=num_q,
                key_offset=offset,
                num_keys=longest,
                q_pos=q_pos,
                k_pos=k_pos,
                mask=mask,
                causal=causal,
                partial=partial[group[0]],
            )
        )
        offset += len(group) * longest
    return AttentionMeta(
        slot_mapping=to_device(slot_mapping, device),
        key_slots=to_device(
            torch.cat(key_slots) if key_slots else torch.zeros(0, dtype=torch.long), device
        ),
        calls=tuple(calls),
        num_rows=num_rows,
        prefix_calls=tuple(prefix_calls),
        decodes=decodes,
    )


def _paged_decodes(
    spans: Sequence[ChunkSpan],
    single: torch.Tensor,
    tables: torch.Tensor,
    lows: torch.Tensor,
    ends: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> PagedDecodes:
    """The one-query chunks `single` (indices into `spans`) as the paged kernel reads them."""
    rows = torch.tensor([spans[i].row_start for i in single.tolist()], dtype=torch.long)
    first = int(rows[0])
    contiguous = bool((rows == first + torch.arange(rows.numel())).all())
    low, end = lows[single].contiguous(), ends[single].contiguous()
    width = max(1, max(len(spans[i].table) for i in single.tolist()))
    return PagedDecodes(
        rows=to_device(rows, device),
        first_row=first if contiguous else None,
        tables=tables[single, :width].contiguous(),
        lows=low,
        ends=end,
        order=torch.argsort(end - low, descending=True, stable=True),
        num_keys=int((end - low).sum()),
        block_size=block_size,
    )


@dataclass(frozen=True, slots=True)
class ShardMeta:
    """One sharded (or MLA) group's step on this rank: where each row's K/V goes (if this rank
    owns it) and, per chunk, the local keys it attends to. Chunks are padded to `Q` queries and
    `K` local keys, as for SDPA; local key `j` of every sequence sits at the same position
    (`key_positions[j]`), in block `table[j // block_size]` at offset `j % block_size`."""

    slots: torch.Tensor  # [T]: this rank's flat cache slot of each row's token; -1 elsewhere
    query_rows: torch.Tensor  # [B, Q]: row of the flat batch for each padded query
    query_valid: torch.Tensor  # [B, Q] bool
    key_slots: torch.Tensor  # [B, K]: flat local slot of each chunk's local key
    key_positions: torch.Tensor  # [K]: sequence position of local key j
    mask: torch.Tensor  # [B, Q, K] bool: causal and within the chunk's local keys
    counts: torch.Tensor  # [T]: local keys each row attends to (rows in batch order)


def build_shard_meta(
    spans: Sequence[ChunkSpan], *, block_size: int, dcp: DcpGroup, device: torch.device
) -> ShardMeta:
    """The ShardMeta of one group's chunks on this rank of `dcp` (N = 1 for plain MLA)."""
    num_chunks = len(spans)
    max_q = max(s.num_tokens for s in spans)
    ends = torch.tensor([s.start + s.num_tokens for s in spans], dtype=torch.long)
    num_local = dcp.num_local_tokens(ends)
    max_k = int(num_local.max())
    index = torch.arange(max_k)
    key_positions = global_positions(
        index, rank=dcp.rank, world_size=dcp.world_size, interleave=dcp.interleave
    )
    width = max(len(s.table) for s in spans)
    positions, tables = [], []
    query_rows = torch.zeros(num_chunks, max_q, dtype=torch.long)
    query_valid = torch.zeros(num_chunks, max_q, dtype=torch.bool)
    q_pos = torch.full((num_chunks, max_q), -1, dtype=torch.long)
    key_slots = torch.zeros(num_chunks, max_k, dtype=torch.long)
    for b, span in enumerate(spans):
        table = torch.tensor(span.table, dtype=torch.long)
        new_pos = torch.arange(span.start, span.start + span.num_tokens)
        positions.append(new_pos)
        padded = torch.zeros(width, dtype=torch.long)
        padded[: len(table)] = table
        tables.append(padded.expand(span.num_tokens, -1))
        query_rows[b, : span.num_tokens] = torch.arange(
            span.row_start, span.row_start + span.num_tokens
        )
        query_valid[b, : span.num_tokens] = True
        q_pos[b, : span.num_tokens] = new_pos
        local = index[: int(num_local[b])]
        key_slots[b, : local.numel()] = table[local // block_size] * block_size + local % block_size
    mask = (key_positions[None, None, :] <= q_pos[:, :, None]) & (
        index[None, None, :] < num_local[:, None, None]
    )
    mask &= query_valid[:, :, None]
    rows = AttentionRows(torch.cat(positions), torch.cat(tables), block_size)
    return ShardMeta(
        slots=rows.slots(dcp).to(device),
        query_rows=query_rows.to(device),
        query_valid=query_valid.to(device),
        key_slots=key_slots.to(device),
        key_positions=key_positions.to(device),
        mask=mask.to(device),
        counts=mask[query_valid].sum(dim=-1).to(device),
    )


@dataclass(frozen=True, slots=True)
class LatentIndex:
    """The sparse-MLA indexer's inputs for the step's rows (DeepSeek-V3.2 DSA)."""

    q: torch.Tensor  # [T, index_heads, index_dim], rotated
    weights: torch.Tensor  # [T, index_heads], head weights (scale included)
    k: torch.Tensor  # [T, index_dim]: each new token's index key, to cache
    top_k: int


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`cache[slots]` for a [B, K] slot tensor: index_select copies whole rows, about 4x faster
    than advanced indexing on CPU (the gather dominates long-context decode there)."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


class GatherBuffers:
    """Reused output tensors for the per-layer key and value gathers. A fresh multi-megabyte
    output every layer costs its page faults each time (on CPU the allocator hands large
    blocks back to the system): gathering into the same memory layer after layer, step after
    step, was 2-4x faster than `index_select` allocating its output (a decode of 32 requests
    at 300 tokens of context, SmolLM2-135M). A layer's gathered keys live until its attention
    returns, so one buffer per role serves every layer. A buffer grows to the largest step's
    gather (and a quarter more) and is kept at that size (one layer's keys, not all layers').

    The keys come out head-major, `[KVH, S, D]`: each head's keys of a chunk are then one
    contiguous `[K, D]` matrix, which SDPA reads 1.4-1.7x faster than the cache's token-major
    rows (SmolLM2's 3 KV heads, decodes of 8 x 2,062 and 12 x 3,500 on a 2-core CPU), more
    than the per-head gather costs over one row gather."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def gather(self, role: str, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`cache[slots]` (`cache` `[slots, KVH, D]`) head-major, `[KVH, S, D]`, written into
        the `role` buffer (grown as needed)."""
        num_heads = cache.shape[1]
        shape = (num_heads, slots.numel(), *cache.shape[2:])
        numel = shape[0] * shape[1] * cache[0, 0].numel() if cache.shape[0] else 0
        key = (role, cache.dtype, cache.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            # Grown by a quarter at least: decodes' contexts grow a little every step, and a
            # buffer grown to the exact size would be allocated (and faulted in) anew each time.
            grown = numel + numel // 4 if buffer is not None else numel
            buffer = torch.empty(max(grown, 1), dtype=cache.dtype, device=cache.device)
            self._buffers[key] = buffer
        out = buffer[:numel].view(shape)
        for head in range(num_heads):
            torch.index_select(cache[:, head], 0, slots, out=out[head])
        return out


def _chunk_keys(keys: torch.Tensor, offset: int, num_seqs: int, num_keys: int) -> torch.Tensor:
    """`[B, KVH, K, D]` view of a call's region of the head-major gathered keys."""
    region = keys.narrow(1, offset, num_seqs * num_keys)
    return region.view(keys.shape[0], num_seqs, num_keys, -1).transpose(0, 1)


def _partial(
    q: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp, grouped-query heads without repeating K/V: `q` `[B, Q,
    H, D]`, `kb`/`vb` `[B, KVH, K, D]`, `mask` `[B, 1, Q, K]` (None: every key; every query
    must see one). Returns `out` `[B, Q, H, Dv]` and `lse` `[B, Q, H]` in float32."""
    b, nq, heads, dim = q.shape
    kv_heads, nk = kb.shape[1], kb.shape[2]
    group = heads // kv_heads
    qg = q.view(b, nq, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(b, kv_heads, -1, dim)
    scores = torch.matmul(qg, kb.transpose(-1, -2)).float() * scale  # [B, KVH, Q*G, K]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, kv_heads, nq, group, nk)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, KVH, Q, G]
    probs = torch.exp(scores - lse[..., None]).to(vb.dtype).view(b, kv_heads, nq * group, nk)
    out = torch.matmul(probs, vb).view(b, kv_heads, nq, group, -1)
    out = out.permute(0, 2, 1, 3, 4).reshape(b, nq, heads, -1)
    return out, lse.permute(0, 2, 1, 3).reshape(b, nq, heads)


def _attend_partial(
    call: AttentionCall,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_attend_call` with the log-sum-exp, for chunks whose shared prefix is merged later."""
    b, nq, nk = call.num_seqs, call.num_queries, call.num_keys
    heads, dim = q.shape[1], q.shape[2]
    qc = q.index_select(0, call.rows).view(b, nq, heads, dim)
    kb = _chunk_keys(keys, call.key_offset, b, nk)
    vb = _chunk_keys(values, call.key_offset, b, nk)
    out, lse = _partial(qc, kb, vb, call.mask, scale, softcap)
    return out.reshape(b * nq, heads, -1), lse.reshape(b * nq, heads)


def _attend_call(
    call: AttentionCall,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """One call's attention: `q` `[T, H, D]` (all rows), `keys`/`values` `[KVH, S, D]` (the
    step's gathered keys); returns `[B * Q, H, D]` for the call's rows."""
    b, nq, nk = call.num_seqs, call.num_queries, call.num_keys
    heads, kv_heads, dim = q.shape[1], keys.shape[0], q.shape[2]
    if call.first_row is not None:
        qc = q.narrow(0, call.first_row, b * nq)
    else:
        qc = q.index_select(0, call.rows)
    kb = _chunk_keys(keys, call.key_offset, b, nk)
    vb = _chunk_keys(values, call.key_offset, b, nk)
    group = heads // kv_heads
    if softcap is None and nq == 1:
        # A decode: the G query heads of a KV head attend as G queries of one sequence.
        out = F.scaled_dot_product_attention(
            qc.view(b, kv_heads, group, dim), kb, vb, attn_mask=call.mask, scale=scale
        )
        return out.reshape(b, heads, -1)
    qb = qc.view(b, nq, heads, dim).transpose(1, 2)  # [B, H, Q, D]
    # SDPA's CPU kernels read each KV head for its G query heads: no repeated copy of K/V.
    gqa = softcap is None and group > 1 and q.device.type == "cpu"
    if group > 1 and not gqa:
        kb = kb.repeat_interleave(group, dim=1)
        vb = vb.repeat_interleave(group, dim=1)
    if softcap is None:
        out = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=call.mask, is_causal=call.causal, scale=scale, enable_gqa=gqa
        )
    else:
        scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        if call.mask is not None:
            scores = scores.masked_fill(~call.mask, float("-inf"))
        elif call.causal:
            scores = scores.masked_fill(
                torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(1), float("-inf")
            )
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(vb.dtype), vb)
    return out.transpose(1, 2).reshape(b * nq, heads, -1)


def _put_rows(
    result: torch.Tensor, rows: torch.Tensor, first_row: int | None, out: torch.Tensor
) -> None:
    if first_row is not None:
        result.narrow(0, first_row, out.shape[0]).copy_(out)
    else:
        result.index_copy_(0, rows, out.to(result.dtype))


def _attend_paged(
    decodes: PagedDecodes,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """The one-query chunks' attention by the paged kernel, `[B, H, Dv]` in their row order."""
    kernel = cpu_kernels.load()
    if kernel is None:
        raise RuntimeError(
            "attention metadata asks for the CPU paged decode kernel, which is not loaded; "
            "build the step with paged_decodes=False"
        )
    b = decodes.rows.numel()
    qd = q.narrow(0, decodes.first_row, b) if decodes.first_row is not None else q[decodes.rows]
    out = kernel.paged_decode(
        qd,
        k_cache,
        v_cache,
        decodes.tables,
        decodes.lows,
        decodes.ends,
        decodes.order,
        block_size=decodes.block_size,
        scale=scale,
        softcap=softcap,
    )
    return out.to(q.dtype)


class ForwardContext:
    """Per step: attention metadata per group, state chunks per state group, and the cache."""

    def __init__(
        self,
        cache: DeviceCache,
        *,
        layer_group: Sequence[int],
        attention: dict[int, AttentionMeta],
        states: dict[int, list[StateChunk]],
        num_tokens: int,
        shards: dict[int, ShardMeta] | None = None,
        dcp: DcpGroup | None = None,
        buffers: GatherBuffers | None = None,
    ) -> None:
        self.cache = cache
        self.buffers = buffers or GatherBuffers()
        self.layer_group = layer_group
        self.attention_meta = attention
        self.states = states
        self.num_tokens = num_tokens
        self.shards = shards or {}  # sharded full-attention groups and MLA groups
        self.dcp = dcp or DcpGroup()
        self.aux_hidden: dict[int, torch.Tensor] = {}
        # Attention score elements computed this step (all layers and heads, padding included).
        self.attention_elements = 0
        self.gathered_keys = 0  # cache slots gathered for attention this step (all layers)

    def attention(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write k/v into the layer's paged cache, then attend. q `[T, H, D]`, k/v
        `[T, KVH, D]`; returns `[T, H, D]` (each token sees its request's earlier tokens)."""
        group = self.layer_group[layer_index]
        k_cache, v_cache = self.cache.kv(layer_index)
        shard = self.shards.get(group)
        if shard is not None:
            if softcap is not None:
                raise ValueError(
                    f"layer {layer_index}: attention logit soft-capping is not supported under "
                    "decode context parallelism; run this model with dcp=1"
                )
            write_owned_slots(k_cache[:, None], k, shard.slots)
            write_owned_slots(v_cache[:, None], v, shard.slots)
            kb = _gather(k_cache, shard.key_slots).to(q.dtype)  # [B, K, KVH, D]
            vb = _gather(v_cache, shard.key_slots).to(q.dtype)
            out, lse = partial_attention_chunks(
                q[shard.query_rows], kb, vb, shard.mask, scale=scale
            )
            valid = shard.query_valid
            merged, _ = merge_across_ranks(out[valid], lse[valid], shard.counts, self.dcp)
            return merged
        meta = self.attention_meta[group]
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        self.attention_elements += meta.computed_elements * q.shape[1]
        result = None
        if meta.decodes is not None:
            paged = _attend_paged(meta.decodes, q, k_cache, v_cache, scale, softcap)
            if not meta.calls and not meta.prefix_calls and meta.decodes.first_row == 0:
                return paged
            result = q.new_empty(q.shape)
            _put_rows(result, meta.decodes.rows, meta.decodes.first_row, paged)
        if not meta.calls and result is not None:
            return result
        return self._attend_gathered(meta, q, k_cache, v_cache, scale, softcap, result)

    def _attend_gathered(
        self,
        meta: AttentionMeta,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        softcap: float | None,
        result: torch.Tensor | None,
    ) -> torch.Tensor:
        """The calls (and shared prefixes) of `meta` over one gather of the keys they read,
        written into `result` (a new tensor where None)."""
        keys = self.buffers.gather("keys", k_cache, meta.key_slots).to(q.dtype)
        values = self.buffers.gather("values", v_cache, meta.key_slots).to(q.dtype)
        self.gathered_keys += int(meta.key_slots.numel())
        if (
            result is None
            and len(meta.calls) == 1
            and meta.calls[0].first_row == 0
            and not meta.prefix_calls
        ):
            return _attend_call(meta.calls[0], q, keys, values, scale, softcap)
        result = q.new_empty(q.shape) if result is None else result
        row_lse = (
            torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
            if meta.prefix_calls
            else None
        )
        for call in meta.calls:
            if call.partial and row_lse is not None:
                out, call_lse = _attend_partial(call, q, keys, values, scale, softcap)
                row_lse.index_copy_(0, call.rows, call_lse)
            else:
                out = _attend_call(call, q, keys, values, scale, softcap)
            _put_rows(result, call.rows, call.first_row, out)
        for prefix in meta.prefix_calls:
            assert row_lse is not None
            kb = _chunk_keys(keys, prefix.key_offset, 1, prefix.num_keys)
            vb = _chunk_keys(values, prefix.key_offset, 1, prefix.num_keys)
            qp = q.index_select(0, prefix.rows)[None]
            out_p, lse_p = _partial(qp, kb, vb, None, scale, softcap)
            own, own_lse = result.index_select(0, prefix.rows), row_lse.index_select(0, prefix.rows)
            top = torch.maximum(lse_p[0], own_lse)
            w_p, w_own = torch.exp(lse_p[0] - top), torch.exp(own_lse - top)
            merged = (out_p[0] * w_p[..., None] + own * w_own[..., None]) / (w_p + w_own)[..., None]
            result.index_copy_(0, prefix.rows, merged.to(result.dtype))
        return result

    def latent_attention(
        self,
        layer_index: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        *,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        scale: float,
        index: LatentIndex | None = None,
    ) -> torch.Tensor:
        """MLA in the absorbed (MQA) form. `q_nope` `[T, H, nope]`, `q_pe` `[T, H, rope]`
        (rotated), `latent` `[T, kv_lora + rope]` (normed `c_kv`, rotated `k_pe`), `w_uk`
        `[H, nope, kv_lora]`, `w_uv` `[H, v, kv_lora]`. Caches each new token's latent row (and
        index key), attends every row over its request's earlier tokens (the indexer's top-k of
        them when `index` is given) and returns `[T, H, v]`, identical on every rank.

        Under DCP the heads are split across the group as under tensor parallelism: each rank
        absorbs its own heads' queries for **all** rows (prefill included), all-gathers them,
        attends over its latent shard, reduce-scatters the merge back to its heads, applies
        `w_uv` and all-gathers the heads. A row whose slot is negative (another rank owns its
        token's KV) skips only the cache writes.
        """
        shard = self.shards[self.layer_group[layer_index]]
        dcp = self.dcp
        latent_cache, index_cache = self.cache.kv(layer_index)
        write_owned_slots(latent_cache[:, None], latent.unsqueeze(1), shard.slots)
        if index is not None:
            write_owned_slots(index_cache[:, None], index.k.unsqueeze(1), shard.slots)
        heads = dcp.head_slice(q_nope.shape[1])
        kv_lora = w_uk.shape[-1]
        q_lat = torch.einsum("rhn,hnc->rhc", q_nope[:, heads], w_uk[heads])
        q_all = all_gather_heads(torch.cat([q_lat, q_pe[:, heads]], dim=-1), dcp)
        keys = _gather(latent_cache, shard.key_slots).to(q_all.dtype)  # [B, K, 1, latent]
        mask, valid = shard.mask, shard.query_valid
        if index is not None:
            index_keys = _gather(index_cache, shard.key_slots)[:, :, 0].to(index.q.dtype)
            logits = torch.einsum("bqhd,bkd->bqhk", index.q[shard.query_rows], index_keys)
            logits = torch.relu(logits * index.q.shape[-1] ** -0.5)
            scores = torch.einsum("bqhk,bqh->bqk", logits, index.weights[shard.query_rows])
            chosen = select_top_k(
                scores[valid], mask[valid], shard.key_positions, k=index.top_k, dcp=dcp
            )
            mask = torch.zeros_like(mask)
            mask[valid] = chosen
        # The value is the latent's c_kv part: attend with the whole latent and keep that part.
        out, lse = partial_attention_chunks(q_all[shard.query_rows], keys, keys, mask, scale=scale)
        out = out[..., :kv_lora]
        counts = mask[valid].sum(dim=-1)
        mine, _ = merge_across_ranks(out[valid], lse[valid], counts, dcp, scatter_heads=True)
        out_heads = torch.einsum("rhc,hvc->rhv", mine, w_uv[heads])
        return all_gather_heads(out_heads, dcp)

    def state_chunks(self, layer_index: int) -> list[StateChunk]:
        """The chunks a recurrent layer processes this step, in flat-batch order."""
        return self.states[self.layer_group[layer_index]]

    def load_state(self, layer_index: int, chunk: StateChunk) -> dict[str, torch.Tensor]:
        """The state the chunk starts from (a copy): the restored snapshot, or zeros."""
        return self.cache.read_state(layer_index, chunk.read_slot)

    def load_states(
        self,
        layer_index: int,
        chunks: Sequence[StateChunk],
        names: Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The states `chunks` start from, stacked `[B, ...]` (zeros where a chunk has none);
        only `names` of them where given."""
        return self.cache.read_states(layer_index, [c.read_slot for c in chunks], names)

    def save_states(
        self, layer_index: int, chunks: Sequence[StateChunk], states: dict[str, torch.Tensor]
    ) -> None:
        """Store each single-snapshot chunk's state (row i of each of `states`, `[B, ...]`) in
        every slot its snapshot asks for."""
        rows, slots = [], []
        for i, chunk in enumerate(chunks):
            for slot in chunk.slots[0]:
                rows.append(i)
                slots.append(slot)
        self.cache.write_states(layer_index, rows, slots, states)

    def state_views(
        self, layer_index: int, chunks: Sequence[StateChunk], name: str
    ) -> list[torch.Tensor] | None:
        """For decodes that advance their `name` state in place in the cache (a step then
        copies no state in or out): per chunk, the float32 storage of the first slot its state
        goes to, holding the state it starts from (copied from its read slot, or zeros); after
        the step, `copy_state_views` fills the chunk's other slots. None where that would
        change what another chunk reads (a chunk's slot is another's read slot, or two chunks
        share one), a chunk keeps no state, or the storage is not float32: load and save."""
        tensor = self.cache.state_tensor(layer_index, name)
        if tensor.dtype != torch.float32 or not all(c.slots[0] for c in chunks):
            return None
        targets = [c.slots[0][0] for c in chunks]
        readers: dict[int | None, list[int]] = {}
        for i, chunk in enumerate(chunks):
            readers.setdefault(chunk.read_slot, []).append(i)
        if len(set(targets)) < len(targets) or any(
            i != j for j, target in enumerate(targets) for i in readers.get(target, ())
        ):
            return None
        views = []
        for chunk, target in zip(chunks, targets, strict=True):
            view = tensor[target]
            if chunk.read_slot is None:
                view.zero_()
            elif chunk.read_slot != target:
                view.copy_(tensor[chunk.read_slot])
            views.append(view)
        return views

    def copy_state_views(self, layer_index: int, chunks: Sequence[StateChunk], name: str) -> None:
        """After an in-place step (`state_views`): each chunk's state into its other slots."""
        tensor = self.cache.state_tensor(layer_index, name)
        for chunk in chunks:
            first, *others = chunk.slots[0]
            for slot in others:
                tensor[slot].copy_(tensor[first])

    def save_state(
        self, layer_index: int, chunk: StateChunk, num_tokens: int, state: dict[str, torch.Tensor]
    ) -> None:
        """Store the state after `num_tokens` tokens of `chunk` (one of `chunk.snapshots`)."""
        try:
            slots = chunk.slots[chunk.snapshots.index(num_tokens)]
        except ValueError:
            raise ValueError(
                f"layer {layer_index}: no snapshot requested after {num_tokens} tokens; "
                f"requested {chunk.snapshots}"
            ) from None
        for slot in slots:
            self.cache.write_state(layer_index, slot, state)
