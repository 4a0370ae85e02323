"""Fleet routers: which replica serves an arriving request.

A router scores the replicas through a `ReplicaView` and picks the best, ties to the lowest
index (so a seed fixes every choice). The routers:

* `round-robin`: replicas in turn.
* `least-loaded`: the fewest outstanding tokens (prompt tokens not yet answered plus output
  tokens still to come, counted by the router from what it routed and what was delivered).
* `session`: a session (an agent's job) stays on the replica its first request went to; a new
  session, or a request without one, goes to the least-loaded replica.
* `prefix-fa`: score = the longest full-attention prefix overlap in tokens minus
  `load_weight` x outstanding tokens, as SGLang's cache-aware router and NVIDIA Dynamo's KV
  router score replicas (overlap against load, one weight trading them).
* `prefix-hybrid`: what the placement will be able to serve. The *reconciled* hit (the hit
  every group, Mamba states included, can serve: what the replica skips now), plus
  `junction_weight` x the tokens past it up to the *junction* the placement makes: where the
  replica holds a longer full-attention prefix than its states can resume, admitting the
  request there keeps a state at that junction (on the state grid), which every later request
  sharing the prefix hits. Under vLLM's `boundary` retention most arrivals' reconciled hit is
  about 0, so scoring it alone spreads a shared prefix over the fleet and no junction is ever
  made; scoring the full-attention overlap alone (`prefix-fa`) takes a longer overlap with no
  state over a slightly shorter one that resumes now. With `junction_weight` 1 and states at
  every block this is `prefix-fa`; at 0 it is the reconciled hit alone. Dynamo's hybrid KV
  routing proposal scores the resume point on the state grid (the reconciled hit); llm-d's
  hybrid scorer handles sliding windows only.

`load_weight` is the trade-off: at 0 the router follows overlap alone (and can pile every
session sharing a system prompt onto one replica); a large weight turns it into least-loaded.
At the default, `LOAD_WEIGHT` (0.1), ten outstanding tokens weigh as one token of prefix.
`junction_weight` (default `JUNCTION_WEIGHT`) prices a token the placement will serve later
against one it serves now.

Two views of a replica's cache: `PreciseView` asks a KVCacheManager read-only (`find_hit`); in
the fleet that is the replica's `CacheMirror` (kvcache/events.py), rebuilt from the replica's
KV events alone, the stream `serve --kv-events` publishes, with one index per group and the
coordinator's own reconciliation over it, so the view scores exactly what the replica's cache
would answer without ever querying it; `ApproximateView` keeps the
router's own record of the block hashes it sent to the replica, in an LRU as large as the
replica's pool (SGLang's approximate radix tree per worker). The approximate reconciled hit
counts a prefix only up to the last state boundary the router itself saw sent: the end of a
routed prompt, on the state grid.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridserve.core.errors import ConfigError
from hybridserve.kvcache import KVCacheManager
from hybridserve.kvcache.hashing import BlockHash
from hybridserve.kvcache.spec import GroupKind

ROUTERS = ("round-robin", "least-loaded", "session", "prefix-fa", "prefix-hybrid")
VIEWS = ("precise", "approximate")
# A junction token (served to later requests once the placement keeps its state) against a
# token of reconciled hit (served now).
JUNCTION_WEIGHT = 0.75
# An outstanding token against a token of prefix served (the prefix routers' load term). Most
# of a replica's outstanding tokens are answers still to come, each a row of a decode batch,
# while a served token is a prompt token not recomputed; at 1.0 a prefix as long as the load gap
# between two replicas is given up, which scatters conversations (docs/fleet.md: at 0.1 both
# prefix routers reach one engine's hit rate with the fleet's pool on the Mooncake trace and on
# agents, at imbalance <= 1.2 with 4 replicas).
LOAD_WEIGHT = 0.1


def state_grid(cache: KVCacheManager) -> int:
    """Tokens between the positions a state group can resume at (0 without state groups)."""
    layout = cache.layout
    grids = [
        math.lcm(layout.alignment_tokens, spec.block_size)
        for spec in layout.groups
        if spec.kind is GroupKind.MAMBA
    ]
    return max(grids, default=0)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router knows of an arriving request."""

    req_id: str
    session: str | None
    num_tokens: int
    block_hashes: Sequence[BlockHash]


class ReplicaView(Protocol):
    """A router's picture of one replica's cache."""

    def fa_overlap(self, request: RouteRequest) -> int:
        """Tokens of the longest full-attention prefix the replica holds."""
        ...

    def hybrid_hit(self, request: RouteRequest) -> int:
        """Tokens of the reconciled hit the replica would give."""
        ...

    def hit_and_junction(self, request: RouteRequest) -> tuple[int, int]:
        """The reconciled hit, and the position (>= the hit) up to which the replica will
        serve the request's prefix once it is placed there: the full-attention junction on the
        state grid where a state will be kept, else the hit."""
        ...

    def on_routed(self, request: RouteRequest) -> None:
        """The request was sent to this replica."""
        ...


class PreciseView:
    """A cache queried read-only: the replica's event-fed mirror (or the replica's own cache,
    which gives the same answers)."""

    def __init__(self, cache: KVCacheManager) -> None:
        self.cache = cache
        self.state_grid = state_grid(cache)

    def fa_overlap(self, request: RouteRequest) -> int:
        hit = self.cache.find_hit(request.block_hashes, request.num_tokens)
        # The junction is the longest full-attention match when it exceeds the reconciled hit;
        # otherwise full attention offered exactly the reconciled hit.
        return max(hit.num_tokens, hit.junction)

    def hybrid_hit(self, request: RouteRequest) -> int:
        return self.cache.find_hit(request.block_hashes, request.num_tokens).num_tokens

    def hit_and_junction(self, request: RouteRequest) -> tuple[int, int]:
        hit = self.cache.find_hit(request.block_hashes, request.num_tokens)
        return hit.num_tokens, _junction(hit.num_tokens, hit.junction, self.state_grid)

    def on_routed(self, request: RouteRequest) -> None:
        """The real cache learns of the request when the replica computes it."""


class ApproximateView:
    """The router's own routing history for one replica: an LRU of block hashes (and of the
    hashes at which a routed prompt ended on the state grid), `capacity` blocks long."""

    def __init__(
        self, *, capacity: int, hash_block_size: int, state_grid: int, alignment: int
    ) -> None:
        if capacity < 1:
            raise ConfigError("capacity", capacity, "use 1 or more blocks")
        self.capacity = capacity
        self.hash_block_size = hash_block_size
        self.state_grid = state_grid  # tokens between resumable states; 0: no state groups
        self.alignment = alignment
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()
        self._states: OrderedDict[BlockHash, None] = OrderedDict()

    def _matched_blocks(self, request: RouteRequest) -> int:
        cap = (request.num_tokens - 1) // self.hash_block_size
        matched = 0
        for block_hash in request.block_hashes[:cap]:
            if block_hash not in self._blocks:
                break
            matched += 1
        return matched

    def fa_overlap(self, request: RouteRequest) -> int:
        tokens = self._matched_blocks(request) * self.hash_block_size
        return tokens // self.alignment * self.alignment

    def hybrid_hit(self, request: RouteRequest) -> int:
        matched = self._matched_blocks(request)
        if not self.state_grid:
            return matched * self.hash_block_size // self.alignment * self.alignment
        for blocks in range(matched, 0, -1):
            if request.block_hashes[blocks - 1] in self._states:
                return blocks * self.hash_block_size
        return 0

    def hit_and_junction(self, request: RouteRequest) -> tuple[int, int]:
        hit = self.hybrid_hit(request)
        return hit, _junction(hit, self.fa_overlap(request), self.state_grid)

    def on_routed(self, request: RouteRequest) -> None:
        for block_hash in request.block_hashes:
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        if self.state_grid:
            end = (request.num_tokens - 1) // self.state_grid * self.state_grid
            blocks = end // self.hash_block_size
            if 0 < blocks <= len(request.block_hashes):
                state = request.block_hashes[blocks - 1]
                self._states[state] = None
                self._states.move_to_end(state)
            while len(self._states) > self.capacity:
                self._states.popitem(last=False)


def _junction(hit: int, overlap: int, grid: int) -> int:
    """Where a placement will serve up to: the full-attention overlap on the state grid (a
    state is kept at the junction) when it passes the hit; the hit otherwise."""
    if grid:
        overlap = overlap // grid * grid
    return max(hit, overlap)


class Router:
    """Picks a replica for each request; `outstanding[i]` is replica i's outstanding tokens,
    kept by the fleet loop."""

    def __init__(
        self,
        name: str,
        views: Sequence[ReplicaView],
        *,
        load_weight: float = LOAD_WEIGHT,
        junction_weight: float = JUNCTION_WEIGHT,
    ) -> None:
        if name not in ROUTERS:
            raise ConfigError("router (--router)", name, f"use one of {', '.join(ROUTERS)}")
        if not load_weight >= 0:
            raise ConfigError(
                "load_weight (--router-load-weight)", load_weight, "use 0 or a positive weight"
            )
        if not 0 <= junction_weight <= 1:
            raise ConfigError("junction_weight", junction_weight, "use a weight in [0, 1]")
        if not views:
            raise ConfigError("replicas (--replicas)", 0, "use 1 or more replicas")
        self.name = name
        self.views = list(views)
        self.load_weight = load_weight
        self.junction_weight = junction_weight
        self.outstanding = [0] * len(views)
        self._next = 0
        self._sessions: dict[str, int] = {}

    def _least_loaded(self) -> int:
        return min(range(len(self.views)), key=lambda i: (self.outstanding[i], i))

    def choose(self, request: RouteRequest) -> int:
        """The replica for `request` (the router's record is not updated: see `routed`)."""
        n = len(self.views)
        if self.name == "round-robin":
            return self._next % n
        if self.name == "least-loaded":
            return self._least_loaded()
        if self.name == "session":
            if request.session is not None and request.session in self._sessions:
                return self._sessions[request.session]
            return self._least_loaded()
        scores = [self.score(i, request) for i in range(n)]
        return max(range(n), key=lambda i: (scores[i], -self.outstanding[i], -i))

    def score(self, replica: int, request: RouteRequest) -> float:
        """A prefix router's score of one replica: the tokens it will serve (`prefix-fa`: the
        full-attention overlap; `prefix-hybrid`: the reconciled hit plus the weighted junction
        past it) minus the weighted load."""
        view = self.views[replica]
        if self.name == "prefix-fa":
            served = float(view.fa_overlap(request))
        else:
            hit, junction = view.hit_and_junction(request)
            served = hit + self.junction_weight * (junction - hit)
        return served - self.load_weight * self.outstanding[replica]

    def routed(self, request: RouteRequest, replica: int) -> None:
        """The request went to `replica` (the engine accepted it)."""
        self._next = replica + 1
        if request.session is not None:
            self._sessions.setdefault(request.session, replica)
        self.views[replica].on_routed(request)
