"""The host link: what the host tier's copies cost a simulated step.

A host slot holds one block id's pages on one GPU (`memory.bytes_per_block`). `--host-memory-gib`
is the host memory of one engine, over all its TP ranks (as vLLM's `--kv-offloading-size`): each
rank's share holds `host_blocks` slots. Each rank copies its own shard over its own link, at the
same time, so a copy of n blocks takes `latency + n * bytes_per_block / (bandwidth * efficiency)`
whatever the TP width.

In a step (StepPlan's order): the saves of evicted blocks (device to host) and the loads of
promoted blocks (host to device) run before the forward, each direction on its own (PCIe is
full duplex), so they add the longer of the two; write-through saves of the last step's blocks
(`HostCopy.background`, vLLM's offloading) run on a side stream beside the forward, adding only
what outlasts it. A load is not overlapped with the step before it: a request waits for its
load in its own step (vLLM's offloading instead parks the request until its load completes and
lets the others run, which this model charges to every request of the step; at the sizes
simulated here a load is a few milliseconds).
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
        background = sum(1 for c in plan.host_saves if c.background)
        blocking = len(plan.host_saves) - background
        before = max(self.copy_s(blocking), self.copy_s(len(plan.host_loads)))
        beside = max(self.copy_s(background) - compute_s, 0.0)
        return before + beside


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
