"""CacheLayout: the groups plus the three granularities H (hash), A (alignment), P (page)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from hybridserve.core.config import SpeculativeConfig
from hybridserve.core.errors import ConfigError
from hybridserve.kvcache.retention import Retention
from hybridserve.kvcache.spec import ChunkedLocalSpec, GroupKind, GroupSpec

HASH_ALGOS = ("sha256", "xxh3_128")


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheLayout:
    """Everything the cache needs to know about a model's cache groups and their geometry.

    * `hash_block_size` (H): tokens per request block hash.
    * `alignment_tokens` (A): a reconciled hit is a multiple of A; defaults to P.
    * P: the scheduler page, lcm of every group's lookup unit U_g.
    * `dcp` (N): decode-context-parallel width; only full attention / MLA is sharded, so its
      unit is block_size * N and every other group's unit is its block size.
    * `eagle_groups`: the groups holding the EAGLE/MTP draft layers, which lose their last
      matched block on the legacy path (vLLM's `is_eagle_group`); None = every attention group.
    * `partial_hash_hits`: fine-grained hits (vLLM's `enable_partial_hash_hits` with a Mamba
      align block coarser than H): a prompt's last H boundary inside a state block is also a
      servable state and a registered partial attention block.
    * `max_in_flight_tokens`: tokens of the batches in flight; sizes the sliding-window
      admission cap (vLLM's `max_admission_blocks_per_request`); 0 = no cap.
    """

    groups: tuple[GroupSpec, ...]
    num_blocks: int
    hash_block_size: int = 0  # 0 = the smallest group unit
    alignment_tokens: int = 0  # 0 = P
    dcp: int = 1
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    retention: Retention = field(default_factory=Retention)
    hash_algo: str = "sha256"
    eagle_groups: tuple[int, ...] | None = None
    partial_hash_hits: bool = False
    max_in_flight_tokens: int = 0
    # The host tier (host_tier.py): blocks of host memory, the device's page size each; 0 =
    # none. `host_write_through` saves every block once computed (vLLM's offloading) instead
    # of at its eviction.
    host_blocks: int = 0
    host_write_through: bool = False
    # Prefetched loads a step carries at most (0: every one queued): sized so that a step's
    # loads finish beside its forward over the host link.
    host_loads_per_step: int = 0
    units: tuple[int, ...] = field(init=False)
    page_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("groups", (), "give at least one cache group")
        if self.num_blocks < 2:
            raise ConfigError(
                "num_blocks", self.num_blocks, "use at least 2 (one is the null block)"
            )
        if self.dcp < 1:
            raise ConfigError("dcp", self.dcp, "use a DCP width of 1 or more")
        if self.eagle_groups is not None and any(
            not 0 <= g < len(self.groups) for g in self.eagle_groups
        ):
            raise ConfigError(
                "eagle_groups", self.eagle_groups, f"use group ids below {len(self.groups)}"
            )
        if self.host_loads_per_step < 0:
            raise ConfigError(
                "host_loads_per_step", self.host_loads_per_step, "use 0 (no cap) or more"
            )
        if self.host_blocks < 0:
            raise ConfigError("host_blocks", self.host_blocks, "use 0 (no host tier) or more")
        if self.host_blocks and (self.dcp > 1 or self.partial_hash_hits):
            raise ConfigError(
                "host_blocks",
                self.host_blocks,
                "the host tier keeps whole blocks of one rank: use it without DCP and without "
                "partial hash hits, or set host memory to 0",
            )
        if self.max_in_flight_tokens < 0:
            raise ConfigError("max_in_flight_tokens", self.max_in_flight_tokens, "use 0 or more")
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError("hash_algo", self.hash_algo, f"use one of {HASH_ALGOS}")
        units = tuple(g.block_size * (self.dcp if g.dcp_sharded else 1) for g in self.groups)
        object.__setattr__(self, "units", units)
        object.__setattr__(self, "page_tokens", math.lcm(*units))
        if self.hash_block_size == 0:
            object.__setattr__(self, "hash_block_size", math.gcd(*units))
        if self.alignment_tokens == 0:
            object.__setattr__(self, "alignment_tokens", self.page_tokens)
        self._validate_geometry()
        self._validate_spec_support()
        self._validate_retention()

    def _validate_geometry(self) -> None:
        h, a, p = self.hash_block_size, self.alignment_tokens, self.page_tokens
        for gid, unit in enumerate(self.units):
            if unit % h != 0:
                raise ConfigError(
                    "hash_block_size",
                    h,
                    f"it must divide group {gid}'s lookup unit {unit}; use a divisor of {unit}",
                )
        if a % h != 0 or p % a != 0:
            raise ConfigError(
                "alignment_tokens",
                a,
                f"it must be a multiple of hash_block_size={h} that divides the page {p}",
            )

    def _validate_retention(self) -> None:
        interval = self.retention.interval_tokens
        if interval <= 0:
            return
        if not any(
            g.kind in (GroupKind.MAMBA, GroupKind.SWA, GroupKind.DRAFT) for g in self.groups
        ):
            raise ConfigError(
                "retention",
                self.retention.name,
                "a retention interval needs a sliding-window or state group; use boundary",
            )
        if interval % self.page_tokens != 0:
            raise ConfigError(
                "retention",
                self.retention.name,
                f"the interval must be a multiple of the scheduler block {self.page_tokens}",
            )

    def _validate_spec_support(self) -> None:
        for gid, spec in enumerate(self.groups):
            if not isinstance(spec, ChunkedLocalSpec):
                continue
            if self.speculative.uses_hidden_states or self.dcp > 1:
                raise ConfigError(
                    f"groups[{gid}]",
                    "chunked_local",
                    "chunked local attention supports neither EAGLE/MTP nor DCP; remove one",
                )
            if spec.chunk % self.alignment_tokens != 0:
                raise ConfigError(
                    "alignment_tokens",
                    self.alignment_tokens,
                    f"it must divide the local-attention chunk {spec.chunk}",
                )

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def kind(self, group_id: int) -> GroupKind:
        return self.groups[group_id].kind

    def drops_tail(self, group_id: int) -> bool:
        """EAGLE groups lose their last matched block on the legacy EAGLE/MTP path."""
        if not self.speculative.drops_target_tail:
            return False
        if self.eagle_groups is not None:
            return group_id in self.eagle_groups
        return self.groups[group_id].kind in (GroupKind.FULL, GroupKind.MLA, GroupKind.SWA)

    @property
    def sharded_units(self) -> tuple[int, ...]:
        """Distinct units of DCP-sharded groups wider than A (their landing grid is coarser)."""
        return tuple(
            sorted(
                {
                    u
                    for g, u in zip(self.groups, self.units, strict=True)
                    if g.dcp_sharded and u > self.alignment_tokens
                }
            )
        )

    def with_num_blocks(self, num_blocks: int) -> CacheLayout:
        return dataclasses.replace(self, num_blocks=num_blocks)
