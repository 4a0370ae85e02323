"""The host link: what the host tier's copies cost a simulated step.

A host slot holds one block id's pages on one GPU (`memory.bytes_per_block`). `--host-memory-gib`
is the host memory of one engine, over all its TP ranks (as vLLM's `--kv-offloading-size`): each
rank's share holds `host_blocks` slots. Each rank copies its own shard over its own link, at the
same time, so a copy of n blocks takes `latency + n * bytes_per_block / (bandwidth * efficiency)`
whatever the TP width.

In a step (StepPlan's order): the saves of evicted blocks (device to host) run before the
forward, which overwrites them; so do loads a plan needs at once (none from the scheduler: it
prefetches). Prefetched loads and write-through saves (`HostCopy.background`) run on a side
stream beside the forward, each direction on its own (PCIe is full duplex), adding only what
outlasts it. A waiting request whose hit is partly on the host is not admitted until its loads
are done (as vLLM's offloading parks it in WAITING_FOR_REMOTE_KVS while the others run); a plan
carries at most `loads_per_step` of them, what the link moves in `PREFETCH_WINDOW_S`, so that
they finish beside the step. Both host tiers (hybridserve's and vLLM's) load this way: they
differ in what they store, not in how they load.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepPlan
from hybridserve.sim.gpus import Gpu

GIB = float(1 << 30)
# Measured pinned-memory copies over PCIe Gen5 x16 on an H100 reach about 50 GB/s of the
# 64 GB/s per direction (vLLM blog, "KV offloading connector", 2026-01-08).
HOST_LINK_EFFICIENCY = 50.0 / 64.0
# Prefetches a step carries: what the link moves in this long, about one mixed step of the
# simulated engines (50-90 ms), so that a step's loads finish beside its forward.
PREFETCH_WINDOW_S = 0.05


@dataclass(frozen=True, slots=True)
class HostLink:
    """One GPU's link to host memory, and the bytes one block id moves over it."""

    bytes_per_s: float  # per direction, datasheet
    latency_s: float  # per batched copy
    bytes_per_block: float
    efficiency: float = HOST_LINK_EFFICIENCY

    @classmethod
    def of(cls, gpu: Gpu, bytes_per_block: float) -> HostLink:
        return cls(gpu.host_link_bytes_per_s, gpu.host_link_latency_s, bytes_per_block)

    def loads_per_step(self) -> int:
        """Prefetched blocks a plan carries at most: `PREFETCH_WINDOW_S` of the link."""
        rate = self.bytes_per_s * self.efficiency
        return max(1, int(PREFETCH_WINDOW_S * rate / self.bytes_per_block))

    def copy_s(self, num_blocks: int) -> float:
        """Seconds to copy `num_blocks` blocks one way (0 for none)."""
        if num_blocks <= 0:
            return 0.0
        rate = self.bytes_per_s * self.efficiency
        return self.latency_s + num_blocks * self.bytes_per_block / rate

    def step_s(self, plan: StepPlan, compute_s: float) -> float:
        """What the plan's host transfers add to a step whose forward takes `compute_s`."""
        if not plan.host_saves and not plan.host_loads:
            return 0.0
        saves_beside = sum(1 for c in plan.host_saves if c.background)
        loads_beside = sum(1 for c in plan.host_loads if c.background)
        saves_before = len(plan.host_saves) - saves_beside
        loads_before = len(plan.host_loads) - loads_beside
        before = max(self.copy_s(saves_before), self.copy_s(loads_before))
        beside = max(self.copy_s(saves_beside), self.copy_s(loads_beside))
        return before + max(beside - compute_s, 0.0)


def host_blocks(host_memory_gib: float, bytes_per_block: float, *, tp: int = 1) -> int:
    """Host slots of one rank: its share of `host_memory_gib` over the engine's `tp` ranks, in
    blocks of `bytes_per_block` (one rank's pages of one block id)."""
    if not host_memory_gib >= 0:
        raise ConfigError("host_memory_gib (--host-memory-gib)", host_memory_gib, "use 0 or more")
    if host_memory_gib == 0:
        return 0
    slots = int(host_memory_gib * GIB / tp // bytes_per_block)
    if slots < 1:
        raise ConfigError(
            "host_memory_gib (--host-memory-gib)",
            host_memory_gib,
            f"it holds no block of {bytes_per_block / GIB:.3f} GiB per rank; give more, or 0",
        )
    return slots
