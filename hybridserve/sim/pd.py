"""Prefill/decode disaggregation: what a handoff moves and how long the link takes.

A prefill replica computes a prompt (and its first token); the request's KV and, for a hybrid
model, its recurrent state then move to a decode replica over a link, and decode there. The
bytes come from the model's cache layout: per token and per full-attention (or MLA) layer its
K and V; a sliding-window group only its window; a state group one state per layer, whatever
the length. Tokens the decode replica already holds (its own prefix hit) are not moved; the
state always is (it is the state at the prompt's end). Each GPU of a tensor-parallel replica
moves its own shard over its own link, so the time is one rank's bytes over one link.

Links (bandwidth per direction per GPU; latency a fixed cost per handoff):

* `nvlink`: the GPU catalog's `link_bytes_per_s` (hybridserve/sim/gpus.py and its sources:
  900 GB/s bidirectional NVLink 4 on H100/H200 is 450 GB/s a direction), for prefill and decode
  replicas in one NVLink domain.
* `ib-ndr`: InfiniBand NDR, 400 Gb/s = 50 GB/s per GPU: NVIDIA's ConnectX-7 user manual
  (single-port OSFP cards at NDR 400 Gb/s) and the DGX H100 user guide (one ConnectX-7 compute
  port per GPU), for replicas on different nodes. RoCE at 400 GbE is the same figure.

Latency is an assumption, not a measurement: 10 us a handoff on NVLink and 30 us over the
network (a few RDMA round trips to set up a transfer). Next to the bytes it is small: 12k tokens
of Qwen3-Next's bf16 KV and state (334 MB) take about 7 ms over NDR.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.core.errors import ConfigError
from hybridserve.kvcache.spec import MambaSpec, SlidingWindowSpec
from hybridserve.sim.gpus import Gpu
from hybridserve.sim.model_profiles import ModelProfile

_G = 1e9
LINKS = ("nvlink", "ib-ndr")


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    bytes_per_s: float  # one direction, one GPU
    latency_s: float  # a fixed cost per handoff

    def transfer_s(self, num_bytes: float) -> float:
        """Seconds to move `num_bytes` (0 bytes: nothing moves, no latency)."""
        if num_bytes <= 0:
            return 0.0
        return self.latency_s + num_bytes / self.bytes_per_s


def link_of(name: str, gpu: Gpu) -> Link:
    """The link `name` between two GPUs of this kind."""
    if name == "nvlink":
        if gpu.link_bytes_per_s <= 0:
            raise ConfigError(
                "pd_link (--pd-link)", name, f"{gpu.name} has no measured NVLink; use ib-ndr"
            )
        return Link(name, gpu.link_bytes_per_s, 10e-6)
    if name == "ib-ndr":
        return Link(name, 50 * _G, 30e-6)
    raise ConfigError("pd_link (--pd-link)", name, f"use one of {', '.join(LINKS)}")


def parse_pd(text: str) -> tuple[int, int]:
    """`P:D` -> (P, D), both 1 or more."""
    prefill, sep, decode = text.partition(":")
    try:
        p, d = int(prefill), int(decode)
    except ValueError:
        p = d = 0
    if not sep or p < 1 or d < 1:
        raise ConfigError(
            "pd (--pd)", text, "give prefill:decode replica counts, both 1 or more, e.g. 2:2"
        )
    return p, d


def handoff_bytes(
    model: ModelProfile, *, moved_tokens: int, kv_dtype: str = "bf16", tp: int = 1
) -> float:
    """One GPU's bytes for a handoff that moves `moved_tokens` tokens of KV plus the state."""
    total = 0.0
    has_state = False
    for group in model.cache_groups():
        if isinstance(group, MambaSpec):
            has_state = True
            continue
        tokens = moved_tokens
        if isinstance(group, SlidingWindowSpec):
            tokens = min(tokens, group.window)
        total += tokens * model.kv_bytes_per_token(group, dtype=kv_dtype, tp=tp)
    if has_state:
        total += model.state_bytes_per_sequence(dtype=kv_dtype, tp=tp)
    return total
