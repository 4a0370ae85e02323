"""DeviceCache: the tensors behind the cache groups (paged K/V and recurrent-state slots).

Block ids are global (one pool for all groups, as in the KVCacheManager). An attention layer
holds `[num_blocks * block_size, num_kv_heads, head_dim]` for K and for V; an MLA layer holds
`[num_blocks * block_size, 1, latent_dim]` latent rows in place of K and its indexer keys
`[..., 1, max(index_dim, 1)]` in place of V; a state layer holds
one state per block id plus `num_scratch_slots` executor-owned slots (after the block ids) for
the states of unverified draft tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridserve.executor.torch.models.base import (
    AttentionCache,
    LatentCache,
    LayerCache,
    StateCache,
)


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
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_base = num_blocks
        self.num_scratch_slots = num_scratch_slots
        self._kv: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._state: list[dict[str, torch.Tensor] | None] = []
        num_slots = num_blocks * block_size
        for layer in layers:
            if isinstance(layer, AttentionCache):
                shape = (num_slots, layer.num_kv_heads, layer.head_dim)
                k = torch.zeros(shape, dtype=dtype, device=device)
                self._kv.append((k, torch.zeros_like(k)))
                self._state.append(None)
            elif isinstance(layer, LatentCache):
                latent = torch.zeros((num_slots, 1, layer.latent_dim), dtype=dtype, device=device)
                index_dim = max(layer.index_dim, 1)
                index = torch.zeros((num_slots, 1, index_dim), dtype=dtype, device=device)
                self._kv.append((latent, index))
                self._state.append(None)
            else:
                self._kv.append(None)
                self._state.append(_state_tensors(layer, num_blocks + num_scratch_slots, device))

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

    def read_states(self, layer_index: int, slots: Sequence[int | None]) -> dict[str, torch.Tensor]:
        """The states in `slots`, stacked `[B, ...]` (a copy; zeros for None)."""
        states = self._states(layer_index)
        present = [i for i, slot in enumerate(slots) if slot is not None]
        out = {}
        for name, tensor in states.items():
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
        """Row `rows[i]` of each stacked state into slot `slots[i]` (slots distinct)."""
        for name, tensor in self._states(layer_index).items():
            source = states[name]
            index = torch.tensor(slots, dtype=torch.long, device=tensor.device)
            picked = source.index_select(0, torch.tensor(rows, device=source.device))
            tensor.index_copy_(0, index, picked.to(tensor.dtype))

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
        """Bytes one block id holds over every layer (K/V rows or a state slot each)."""
        return sum(
            view.numel() * view.element_size()
            for layer in range(len(self._kv))
            for view in self.block_views(layer, 0)
        )

    def block_views(self, layer_index: int, block_id: int) -> list[torch.Tensor]:
        """Views of what block `block_id` holds in a layer: its `block_size` K and V (or
        latent and indexer) rows, or each tensor of its state slot. Writing them writes the
        cache (the host tier's saves read them, its loads write them)."""
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
