"""HostCache: the tensors behind the host tier's slots (see `kvcache.host_tier`).

A slot holds one block of one group: what that block holds in every layer of the group (the
`block_size` K and V rows of an attention layer, the latent and indexer rows of an MLA layer,
every tensor of the state slot of a recurrent layer) and the executor's per-token side tables
of that group (the token ids that n-gram drafts read back, a draft head's next tokens). Its
tensors mirror the device cache's storage: layers that share device tensors (the same position
of different groups, `DeviceCache.storage_layer`) share the slot's, so a slot is
`DeviceCache.block_bytes()` bytes, and a save or load touches only the layers of the copy's
group.

On a CUDA device the slots are pinned and the copies run on a side stream with
`non_blocking=True`: the side stream first waits for the compute stream (a block saved holds
what earlier work wrote), and the compute stream waits for the side stream before the step's
block copies and forward. On the CPU they are plain copies. Saves run before loads, each list
in order, so a slot saved and loaded in one step is read after it is written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import HostCopy
from hybridserve.executor.torch.cache import DeviceCache


class HostCache:
    """`num_slots` host slots shaped like one block of each layer of `cache`;
    `layer_group[i]` is layer i's group id."""

    def __init__(
        self,
        cache: DeviceCache,
        num_slots: int,
        *,
        layer_group: Sequence[int],
        device: torch.device,
    ) -> None:
        if num_slots < 1:
            raise ConfigError("host_blocks", num_slots, "use 1 or more, or build no host cache")
        self.num_slots = num_slots
        self.num_blocks = cache.num_blocks
        self._cache = cache
        self._layers: dict[int, list[int]] = {}
        for layer, group in enumerate(layer_group):
            self._layers.setdefault(group, []).append(layer)
        self.pinned = device.type == "cuda"
        self._slots: list[list[torch.Tensor]] = []
        for layer in range(len(layer_group)):
            owner = cache.storage_layer(layer)
            if owner != layer:  # the slot's tensors of the layer it shares storage with
                self._slots.append(self._slots[owner])
                continue
            self._slots.append(
                [
                    torch.zeros((num_slots, *view.shape), dtype=view.dtype, pin_memory=self.pinned)
                    for view in cache.block_views(layer, 0)
                ]
            )
        # group -> (device-side table, its host copy, entries per block)
        self._tables: dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
        self._stream = torch.cuda.Stream(device) if self.pinned else None

    def allocated_bytes(self) -> int:
        """Bytes of the slots' tensors, each counted once (`num_slots` x the cache's
        `block_bytes()`)."""
        unique = {id(t): t for tensors in self._slots for t in tensors}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def add_table(self, group_id: int, table: torch.Tensor, unit: int) -> None:
        """Keep `table[block * unit : (block + 1) * unit]` (a CPU tensor the executor indexes
        by block of `group_id`) with every slot of that group."""
        host = torch.full((self.num_slots * unit,), -1, dtype=table.dtype)
        self._tables.setdefault(group_id, []).append((table, host, unit))

    def transfer(self, saves: Sequence[HostCopy], loads: Sequence[HostCopy]) -> None:
        """Every save (device block -> slot), then every load (slot -> device block)."""
        for copy in (*saves, *loads):
            self._check(copy)
        if self._stream is None:
            self._run(saves, loads, non_blocking=False)
            return
        compute = torch.cuda.current_stream(self._stream.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            self._run(saves, loads, non_blocking=True)
        compute.wait_stream(self._stream)

    def _run(
        self, saves: Sequence[HostCopy], loads: Sequence[HostCopy], *, non_blocking: bool
    ) -> None:
        for copy in saves:
            for view, host in self._pairs(copy):
                host.copy_(view, non_blocking=non_blocking)
            for table, host_table, unit in self._tables.get(copy.group_id, ()):
                host_table[copy.slot * unit : (copy.slot + 1) * unit] = table[
                    copy.block_id * unit : (copy.block_id + 1) * unit
                ]
        for copy in loads:
            for view, host in self._pairs(copy):
                view.copy_(host, non_blocking=non_blocking)
            for table, host_table, unit in self._tables.get(copy.group_id, ()):
                table[copy.block_id * unit : (copy.block_id + 1) * unit] = host_table[
                    copy.slot * unit : (copy.slot + 1) * unit
                ]

    def _pairs(self, copy: HostCopy) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device view, host view) of every tensor of the copy's block in its group."""
        pairs = []
        for layer in self._layers[copy.group_id]:
            views = self._cache.block_views(layer, copy.block_id)
            for view, host in zip(views, self._slots[layer], strict=True):
                pairs.append((view, host[copy.slot]))
        return pairs

    def _check(self, copy: HostCopy) -> None:
        if not 0 <= copy.slot < self.num_slots:
            raise ConfigError(
                "host_blocks",
                self.num_slots,
                f"the plan copies host slot {copy.slot}; build the executor with the layout's "
                "host_blocks",
            )
        if copy.group_id not in self._layers:
            raise ValueError(
                f"host copy {copy}: group_id={copy.group_id} is no group of this model; "
                f"use one of {sorted(self._layers)}"
            )
        if not 0 <= copy.block_id < self.num_blocks:
            raise ValueError(
                f"host copy {copy}: block_id={copy.block_id} is outside the device pool; "
                f"use 0..{self.num_blocks - 1}"
            )
