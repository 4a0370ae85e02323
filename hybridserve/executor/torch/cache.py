"""DeviceCache: the tensors behind the cache groups (paged K/V and recurrent-state slots).

Block ids are global (one pool for all groups, as in the KVCacheManager), and a block id
belongs to one group at a time. An attention layer's K and V are
`[num_blocks * block_size, num_kv_heads, head_dim]`; an MLA layer holds
`[num_blocks * block_size, 1, latent_dim]` latent rows in place of K and its indexer keys
`[..., 1, max(index_dim, 1)]` in place of V. Layers at the same position k of different groups
whose rows have the same shapes keep them in one pair of tensors (`kv_storage`), as vLLM's
uniform-page layout does (its KVCacheTensor shared by layer k of every group): block b of the
pair holds layer k of whichever group owns b. One block id then costs as many layers' pages as
the largest group holds (3 on Gemma 3 270M's six groups of 3, not its 18 layers). A state layer
holds one state per block id plus `num_scratch_slots` executor-owned slots (after the block ids)
for the states of unverified draft tokens; it shares nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hybridserve.executor.torch.models.base import (
    AttentionCache,
    LatentCache,
    LayerCache,
    StateCache,
    derive_cache_groups,
)


def kv_storage(
    layers: Sequence[LayerCache], layer_group: Sequence[int] | None = None
) -> list[int | None]:
    """Per layer, the K/V storage (a pair of tensors) that holds its rows; None for a state
    layer. The K/V layers of a group take positions 0, 1, ... in layer order, and layers at the
    same position of different groups with the same row shapes share one storage. Without
    `layer_group` (layer i's group id) every layer has its own."""
    groups = [0] * len(layers) if layer_group is None else layer_group
    positions: dict[int, int] = {}
    storage: dict[tuple[int, _RowShapes], int] = {}
    out: list[int | None] = []
    for layer, group in zip(layers, groups, strict=True):
        shapes = _row_shapes(layer)
        if shapes is None:
            out.append(None)
            continue
        position = positions.get(group, 0)
        positions[group] = position + 1
        out.append(storage.setdefault((position, shapes), len(storage)))
    return out


def kv_sharing(layers: Sequence[LayerCache], layer_group: Sequence[int] | None = None) -> float:
    """The K/V elements a token takes over every K/V layer, over those it takes in the shared
    storage of `kv_storage`: how many more block ids the same bytes hold than with a storage
    per layer (1.0 without sharing, 6.0 on Gemma 3 270M's six groups of 3)."""
    storage = kv_storage(layers, layer_group)
    every = stored = 0
    seen: set[int] = set()
    for layer, sid in zip(layers, storage, strict=True):
        shapes = _row_shapes(layer)
        if shapes is None or sid is None:
            continue
        elements = sum(math.prod(shape) for shape in shapes)
        every += elements
        if sid not in seen:
            seen.add(sid)
            stored += elements
    return every / stored if stored else 1.0


def default_pool_blocks(
    layers: Sequence[LayerCache], *, max_model_len: int, block_size: int
) -> int:
    """The pool a server allocates unless told: the bytes of four requests at the longest
    context (at least 256 blocks) with a page in every K/V layer, in block ids of the shared
    storage of the model's default cache groups (`kv_sharing` times as many ids: Gemma 3 270M
    at 8,192 tokens and 16-token blocks gets 12,288, where one K/V tensor per layer held 2,048
    in the same bytes). A model without sharing (one attention kind; state layers) gets
    max(256, 4 x max_model_len / block_size) blocks."""
    base = max(256, 4 * -(-max_model_len // block_size))
    groups = derive_cache_groups(layers, block_size=block_size)
    return int(base * kv_sharing(layers, groups.layer_group))


_RowShapes = tuple[tuple[int, ...], tuple[int, ...]]


def _row_shapes(layer: LayerCache) -> _RowShapes | None:
    """The shapes of one token's row in a layer's two K/V tensors; None for a state layer."""
    if isinstance(layer, AttentionCache):
        return (layer.num_kv_heads, layer.head_dim), (layer.num_kv_heads, layer.head_dim)
    if isinstance(layer, LatentCache):
        return (1, layer.latent_dim), (1, max(layer.index_dim, 1))
    return None


class DeviceCache:
    def __init__(
        self,
        layers: Sequence[LayerCache],
        *,
        num_blocks: int,
        block_size: int,
        num_scratch_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        layer_group: Sequence[int] | None = None,
    ) -> None:
        """`layer_group[i]` is layer i's cache group: layers at the same position of different
        groups share their K/V tensors (see `kv_storage`). Without it every layer has its
        own."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_base = num_blocks
        self.num_scratch_slots = num_scratch_slots
        self._kv: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._state: list[dict[str, torch.Tensor] | None] = []
        # Per layer, the first layer whose tensors it uses (itself unless it shares).
        self._storage_layer: list[int] = []
        num_slots = num_blocks * block_size
        first_layer: dict[int, int] = {}
        for index, (layer, sid) in enumerate(
            zip(layers, kv_storage(layers, layer_group), strict=True)
        ):
            if sid is None:
                assert isinstance(layer, StateCache)
                self._kv.append(None)
                self._state.append(_state_tensors(layer, num_blocks + num_scratch_slots, device))
                self._storage_layer.append(index)
                continue
            self._state.append(None)
            owner = first_layer.setdefault(sid, index)
            self._storage_layer.append(owner)
            if owner != index:
                self._kv.append(self._kv[owner])
                continue
            shapes = _row_shapes(layer)
            assert shapes is not None
            k_shape, v_shape = shapes
            self._kv.append(
                (
                    torch.zeros((num_slots, *k_shape), dtype=dtype, device=device),
                    torch.zeros((num_slots, *v_shape), dtype=dtype, device=device),
                )
            )

    def storage_layer(self, layer_index: int) -> int:
        """The first layer whose tensors `layer_index` keeps its pages in (itself when it
        shares none): layers with the same storage layer alias."""
        return self._storage_layer[layer_index]

    def kv(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._kv[layer_index]
        if entry is None:
            raise ValueError(f"layer {layer_index} is a state layer; it has no K/V cache")
        return entry

    def _states(self, layer_index: int) -> dict[str, torch.Tensor]:
        entry = self._state[layer_index]
        if entry is None:
            raise ValueError(f"layer {layer_index} is an attention layer; it has no state")
        return entry

    def read_state(self, layer_index: int, slot: int | None) -> dict[str, torch.Tensor]:
        states = self._states(layer_index)
        if slot is None:
            return {name: torch.zeros_like(t[0]) for name, t in states.items()}
        return {name: t[slot].clone() for name, t in states.items()}

    def read_states(
        self,
        layer_index: int,
        slots: Sequence[int | None],
        names: Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The states in `slots`, stacked `[B, ...]` (a copy; zeros for None); only `names` of
        them where given."""
        states = self._states(layer_index)
        present = [i for i, slot in enumerate(slots) if slot is not None]
        out = {}
        for name, tensor in states.items():
            if names is not None and name not in names:
                continue
            if len(present) == len(slots):
                index = torch.tensor(slots, dtype=torch.long, device=tensor.device)
                out[name] = tensor.index_select(0, index)
                continue
            stacked = tensor.new_zeros((len(slots), *tensor.shape[1:]))
            if present:
                rows = torch.tensor(present, dtype=torch.long, device=tensor.device)
                index = torch.tensor([slots[i] for i in present], device=tensor.device)
                stacked.index_copy_(0, rows, tensor.index_select(0, index))
            out[name] = stacked
        return out

    def write_states(
        self,
        layer_index: int,
        rows: Sequence[int],
        slots: Sequence[int],
        states: dict[str, torch.Tensor],
    ) -> None:
        """Row `rows[i]` of each stacked state in `states` into slot `slots[i]` (slots
        distinct)."""
        tensors = self._states(layer_index)
        for name, source in states.items():
            tensor = tensors[name]
            index = torch.tensor(slots, dtype=torch.long, device=tensor.device)
            if list(rows) != list(range(source.shape[0])):
                source = source.index_select(0, torch.tensor(rows, device=source.device))
            tensor.index_copy_(0, index, source.to(tensor.dtype))

    def state_tensor(self, layer_index: int, name: str) -> torch.Tensor:
        """Layer `layer_index`'s `name` state of every slot, `[slots, ...]` (the storage)."""
        return self._states(layer_index)[name]

    def write_state(self, layer_index: int, slot: int, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in self._states(layer_index).items():
            tensor[slot].copy_(state[name])

    def copy_tokens(
        self, layer_index: int, src_block: int, dst_block: int, num_tokens: int
    ) -> None:
        """Copy-on-write of an attention block's first `num_tokens` slots."""
        bs = self.block_size
        for tensor in self.kv(layer_index):
            tensor[dst_block * bs : dst_block * bs + num_tokens] = tensor[
                src_block * bs : src_block * bs + num_tokens
            ]

    def copy_state(self, layer_index: int, src_slot: int, dst_slot: int) -> None:
        for tensor in self._states(layer_index).values():
            tensor[dst_slot].copy_(tensor[src_slot])

    def is_state_layer(self, layer_index: int) -> bool:
        return self._state[layer_index] is not None

    def block_bytes(self) -> int:
        """Bytes one block id holds: its K/V rows (or latent rows) in each storage, counted
        once however many layers share it, and its state slot in each state layer."""
        return sum(
            view.numel() * view.element_size()
            for layer in range(len(self._kv))
            if self._storage_layer[layer] == layer
            for view in self.block_views(layer, 0)
        )

    def allocated_bytes(self) -> int:
        """Bytes of every tensor the cache allocated (state scratch slots included)."""
        total = 0
        for layer, kv in enumerate(self._kv):
            if self._storage_layer[layer] == layer:
                tensors = kv if kv is not None else tuple(self._states(layer).values())
                total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def block_views(self, layer_index: int, block_id: int) -> list[torch.Tensor]:
        """Views of what block `block_id` holds in a layer: its `block_size` K and V (or
        latent and indexer) rows, or each tensor of its state slot. Writing them writes the
        cache (the host tier's saves read them, its loads write them). Layers with the same
        `storage_layer` get views of the same memory: what block `block_id` holds there
        belongs to the layer of the group that owns the block."""
        states = self._state[layer_index]
        if states is not None:
            return [tensor[block_id] for tensor in states.values()]
        rows = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        return [tensor[rows] for tensor in self.kv(layer_index)]


def _state_tensors(
    layer: StateCache, num_slots: int, device: torch.device
) -> dict[str, torch.Tensor]:
    return {
        name: torch.zeros((num_slots, *shape), dtype=layer.dtype, device=device)
        for name, shape in layer.shapes.items()
    }
