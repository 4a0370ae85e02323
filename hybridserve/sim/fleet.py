"""A simulated fleet: N replicas, each the production Engine + Scheduler + KVCacheManager on
the simulated executor, behind a router, in one deterministic event loop. The replicas and the
workload are built as the single engine's are (`hybridserve.sim.run.fleet_simulation`:
`simulated_engine`, and `make_simulation` for agents, a Mooncake or Azure trace, Poisson,
fixed); the fleet loop drives the workload's arrivals and answers instead of its own loop.

Events at one simulated time resolve in a fixed order: the steps that end then deliver their
outputs (replica order), then the arrivals due are routed and admitted (in arrival order), then
every idle replica with work starts its next step. A step's timeline, GPU time and admissions are
recorded when it starts (its plan is known then); its tokens are delivered when it ends. With one
replica this is exactly the single-engine loop, so `--replicas 1 --router round-robin` gives the
single-engine report bit for bit.

Disaggregated (`--pd P:D`, sim/pd.py), a prefill replica answers the first token; the handoff
lands on a decode replica after the link's time, and is admitted there with the prompt marked
computed (`Request.num_external_computed_tokens`, as vLLM's KV connector does): its first step
computes the first answer token only, and the cache registers the received blocks as a
one-chunk prefill would.

The fleet's report (`hybridserve.sim.fleet_report`) adds, over the measurement window: the
reconciled hit rate against the global ideal (one infinite cache for the whole fleet: every block
any replica computed, prompts and answers, kept forever, states at every block), and the load
imbalance, max/mean over replicas of the time-averaged outstanding tokens.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hybridserve.core.errors import ConfigError, RequestError
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine, EngineStep
from hybridserve.engine.assembly import EngineParts
from hybridserve.kvcache import KVCacheManager
from hybridserve.kvcache.events import CacheMirror
from hybridserve.kvcache.hashing import BlockHash, BlockHasher
from hybridserve.metrics.recorder import MetricsRecorder
from hybridserve.scheduler import Scheduler
from hybridserve.sim.deployment import Deployment, FleetConfig
from hybridserve.sim.loop import Simulation
from hybridserve.sim.pd import handoff_bytes, link_of
from hybridserve.sim.routers import (
    ApproximateView,
    PreciseView,
    ReplicaView,
    Router,
    RouteRequest,
    state_grid,
)
from hybridserve.sim.summary import QueueTrace

_RECENT_SESSIONS = 1_024  # sessions whose last prompt's hashes are kept for the next one


@dataclass(slots=True)
class _Replica:
    engine: Engine
    scheduler: Scheduler
    clock: float = 0.0  # when its running step ends (or ended)
    pending: EngineStep | None = None  # the step in flight, delivered at `clock`
    steps: int = 0
    busy_s: float = 0.0  # GPU seconds of steps that end inside the window


@dataclass(slots=True)
class _InFlight:
    replica: int
    prompt: int  # prompt tokens still counted as outstanding (0 after the first token)
    output: int  # output tokens still to come on this replica
    hashes: list[BlockHash]
    tokens: tuple[int, ...]
    max_tokens: int  # the request's whole answer
    decoding: bool = False  # on a decode replica, after its handoff


@dataclass(order=True, slots=True)
class _Handoff:
    time_s: float
    seq: int
    req_id: str = field(compare=False)
    replica: int = field(compare=False)  # the decode replica (fleet index)
    route: RouteRequest = field(compare=False)


def _replica_views(caches: list[KVCacheManager], mirrors: list[CacheMirror]) -> list[ReplicaView]:
    """The router's view of each replica: its mirror's cache (precise, when `mirrors` are
    given) or an estimate from the requests it was sent (approximate)."""
    if mirrors:
        return [PreciseView(m.cache) for m in mirrors]
    return [
        ApproximateView(
            capacity=c.layout.num_blocks,
            hash_block_size=c.layout.hash_block_size,
            state_grid=state_grid(c),
            alignment=c.layout.alignment_tokens,
        )
        for c in caches
    ]


class FleetSimulation:
    """Drives a workload's `Simulation` over several replicas (see the module docstring):
    `replicas` are the engines built from `deployment` (`hybridserve.sim.run.fleet_simulation`
    builds them), `workload` the simulation whose arrivals and answers the fleet loop drives."""

    def __init__(
        self,
        deployment: Deployment,
        fleet: FleetConfig,
        replicas: Sequence[EngineParts],
        workload: Simulation,
        *,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        if len(replicas) != fleet.replicas:
            raise ConfigError(
                "replicas", len(replicas), f"build one engine per replica ({fleet.replicas})"
            )
        self.deployment = deployment
        self.config = deployment.config
        self.fleet = fleet
        self.progress = progress
        self.replicas = [_Replica(parts.engine, parts.scheduler) for parts in replicas]
        num_prefill = fleet.pd[0] if fleet.pd is not None else fleet.replicas
        self.num_prefill = num_prefill
        if fleet.pd is not None:
            self.link = link_of(fleet.pd_link, deployment.gpu)
        self.sim = workload
        # Per request, the prompt tokens an ideal cache holds (the workload records them).
        self.ideal: dict[str, int] = workload.ideal_prefix
        self.recorder: MetricsRecorder = workload.recorder
        caches = [r.scheduler.cache for r in self.replicas]
        self.hasher: BlockHasher = caches[0].hasher
        # Precise, each replica's KV events feed the router's mirror of its cache (routers.py).
        self.mirrors: list[CacheMirror] = (
            [CacheMirror.of(c) for c in caches] if fleet.view == "precise" else []
        )
        views = _replica_views(caches, self.mirrors)
        # Arrivals go to the prefill replicas (all of them when colocated); handoffs to the
        # decode replicas, by the same router.
        weights = {"load_weight": fleet.load_weight, "junction_weight": fleet.junction_weight}
        self.router = Router(fleet.router, views[:num_prefill], **weights)
        self.decode_router = Router(fleet.router, views[num_prefill:] or views, **weights)
        self._slot: list[tuple[Router, int]] = [
            (self.router, i) if i < num_prefill else (self.decode_router, i - num_prefill)
            for i in range(fleet.replicas)
        ]
        self._start_ledgers()

    def _start_ledgers(self) -> None:
        """The run's tallies, all empty: handoffs, step counts, routing, the global ideal and
        the per-replica load integrals."""
        self._handoffs: list[_Handoff] = []
        self._handoff_seq = 0
        self.decode_of: dict[str, int] = {}
        self.transfer_s: list[float] = []
        self.transfer_bytes = 0.0
        self.queue = QueueTrace(self.config.warmup_s)
        self.now = 0.0
        self.steps = 0
        self.gpu_seconds = {"decode": 0.0, "prefill": 0.0, "mixed": 0.0}
        self.replica_of: dict[str, int] = {}
        self.job_replica: dict[str, int] = {}
        self._inflight: dict[str, _InFlight] = {}
        # Global ideal: every block hash any replica computed, and per request its ideal hit.
        self._seen: set[BlockHash] = set()
        self.global_ideal: dict[str, int] = {}
        # Per recent session, the last prompt's tokens and hashes (an agent's prompt grows by
        # appending, so its next prompt hashes only the new blocks).
        self._session_hashes: OrderedDict[str, tuple[tuple[int, ...], list[BlockHash]]] = (
            OrderedDict()
        )
        # Outstanding tokens, time-integrated over the window, per replica.
        self._area = [0.0] * self.fleet.replicas
        self._last_change = [0.0] * self.fleet.replicas

    # ----- the loop ---------------------------------------------------------------------------

    def run(self, until_s: float) -> MetricsRecorder:
        sim = self.sim
        sim.start()
        while self.now < until_s:
            self._admit_handoffs()
            self._admit_arrivals()
            self._start_steps()
            ends = [r.clock for r in self.replicas if r.pending is not None]
            next_arrival = sim.next_arrival_s()
            upcoming = [*ends, *([next_arrival] if next_arrival is not None else [])]
            if self._handoffs:
                upcoming.append(self._handoffs[0].time_s)
            if not upcoming:
                break
            self.now = min(upcoming)
            for index, replica in enumerate(self.replicas):
                if replica.pending is not None and replica.clock <= self.now:
                    self._deliver(index)
        # Steps started before the end deliver their outputs, as the single-engine loop does.
        for index, replica in sorted(enumerate(self.replicas), key=lambda item: item[1].clock):
            if replica.pending is not None:
                self.now = max(self.now, replica.clock)
                self._deliver(index)
        return self.recorder

    def _hashes_of(self, prompt: tuple[int, ...], session: str | None) -> list[BlockHash]:
        hashes: list[BlockHash] = []
        if session is not None and session in self._session_hashes:
            tokens, previous = self._session_hashes[session]
            if prompt[: len(tokens)] == tokens:
                hashes = list(previous)
        self.hasher.extend(hashes, prompt)
        if session is not None:
            self._session_hashes[session] = (prompt, hashes)
            self._session_hashes.move_to_end(session)
            if len(self._session_hashes) > _RECENT_SESSIONS:
                self._session_hashes.popitem(last=False)
        return hashes

    def _admit_arrivals(self) -> None:
        sim = self.sim
        for arrival in sim.due_arrivals(self.now):
            prompt = tuple(arrival.prompt)
            hashes = self._hashes_of(prompt, arrival.job_id)
            route = RouteRequest(arrival.req_id, arrival.job_id, len(prompt), hashes)
            index = self.router.choose(route)
            # Disaggregated, the prefill replica answers the first token and hands off.
            first = arrival.max_tokens if self.fleet.pd is None else 1
            if not sim.admit(arrival, self.replicas[index].engine, max_tokens=first):
                continue
            self.router.routed(route, index)
            self._change_load(index, len(prompt) + first)
            self.replica_of[arrival.req_id] = index
            if arrival.job_id is not None:
                self.job_replica[arrival.job_id] = index
            self._inflight[arrival.req_id] = _InFlight(
                index, len(prompt), first, hashes, prompt, arrival.max_tokens
            )
            self._record_ideal(arrival.req_id, len(prompt), hashes)

    def _record_ideal(self, req_id: str, num_tokens: int, hashes: list[BlockHash]) -> None:
        cache = self.replicas[0].scheduler.cache
        cacheable = cache.cacheable_tokens
        matched = 0
        for block_hash in hashes:
            if block_hash not in self._seen:
                break
            matched += 1
        a = cache.layout.alignment_tokens
        tokens = min(matched * cache.layout.hash_block_size // a * a, cacheable(num_tokens))
        if self.replicas[0].scheduler.exact_tails:
            # Exact tails resume a session mid-block: an ideal cache holds its whole history.
            tokens = max(tokens, min(self.ideal.get(req_id, 0), num_tokens - 1))
        self.global_ideal[req_id] = tokens
        self._seen.update(hashes)

    def _start_steps(self) -> None:
        for index, replica in enumerate(self.replicas):
            if replica.pending is not None or not replica.engine.has_requests():
                continue
            start = self.now  # an idle replica's last step ended at or before now
            step = replica.engine.step(start)
            end = start + max(step.result.duration_s, 1e-6)
            self.steps += 1
            replica.steps += 1
            scheduled = step.scheduled
            recorder = self.recorder
            recorder.preemptions += len(scheduled.preempted)
            if end >= self.config.warmup_s and (
                scheduled.num_prefill_tokens or scheduled.num_decode_tokens
            ):
                if not scheduled.num_prefill_tokens:
                    kind = "decode"
                elif not scheduled.num_decode_tokens:
                    kind = "prefill"
                else:
                    kind = "mixed"
                self.gpu_seconds[kind] += end - start
                replica.busy_s += end - start
            recorder.timeline.on_step(
                end,
                duration_s=end - start,
                prefill=scheduled.num_prefill_tokens,
                decode=scheduled.num_decode_tokens,
                kv_usage=scheduled.kv_usage,
            )
            for req_id, hit in scheduled.new_reqs:
                recorder.on_admitted(req_id, hit)
            for req_id, why in step.failed:  # waiters this replica refused: they end here
                self._drop_failed(index, req_id, why)
            others = sum(r.scheduler.num_waiting for i, r in enumerate(self.replicas) if i != index)
            self.queue.on_step(step.now, scheduled.num_waiting + others)
            if self.progress is not None and self.steps % 256 == 0:
                self.progress(start)
            replica.pending = step
            replica.clock = end

    def _deliver(self, index: int) -> None:
        replica = self.replicas[index]
        step, end = replica.pending, replica.clock
        assert step is not None
        replica.pending = None
        sim, recorder = self.sim, self.recorder
        for output in step.outputs:
            req_id = output.req_id
            recorder.on_delivery(req_id, end, len(output.new_token_ids))
            sim.answer(req_id).extend(output.new_token_ids)
            flight = self._inflight[req_id]
            delta = flight.prompt + min(len(output.new_token_ids), flight.output)
            flight.output -= min(len(output.new_token_ids), flight.output)
            flight.prompt = 0
            if output.finished:
                delta += flight.output
                flight.output = 0
            self._change_load(index, -delta)
            handing_off = self.fleet.pd is not None and not flight.decoding
            if output.finished and handing_off and flight.max_tokens > 1:
                self._hand_off(req_id, flight, end)
                continue
            if output.finished:
                recorder.on_finish(req_id, end)
                answer = sim.take_answer(req_id)
                self._inflight.pop(req_id)
                # An infinite cache keeps the answer's blocks too (its last token is never fed).
                computed = (*flight.tokens, *answer[:-1])
                self._seen.update(self.hasher.extend(list(flight.hashes), computed))
                sim.finished(req_id, end, answer)

    def _drop_failed(self, index: int, req_id: str, why: str) -> None:
        """A request replica `index` refused (it can never start there): its outstanding
        tokens leave the replica's load, and the workload counts it and goes on."""
        flight = self._inflight.pop(req_id, None)
        if flight is not None:
            self._change_load(index, -(flight.prompt + flight.output))
        record = self.recorder.requests.get(req_id)
        self.sim.fail(req_id, record.prompt_tokens if record is not None else 0, why)

    def _hand_off(self, req_id: str, flight: _InFlight, end: float) -> None:
        """The prefill replica answered the first token: move the KV and state not already on
        the chosen decode replica, which resumes when the transfer lands."""
        answer = self.sim.answer(req_id)
        tokens = (*flight.tokens, *answer)
        hashes = self.hasher.extend(list(flight.hashes), tokens)
        route = RouteRequest(req_id, self._session_of(req_id), len(tokens), hashes)
        local = self.decode_router.choose(route)
        index = self.num_prefill + local
        cache = self.replicas[index].scheduler.cache
        resident = cache.find_hit(hashes, len(tokens)).num_tokens
        moved = max(len(flight.tokens) - resident, 0)
        num_bytes = handoff_bytes(
            self.deployment.model,
            moved_tokens=moved,
            kv_dtype=self.config.kv_dtype,
            tp=self.config.tp,
        )
        seconds = self.link.transfer_s(num_bytes)
        if end >= self.config.warmup_s:
            self.transfer_s.append(seconds)
            self.transfer_bytes += num_bytes
        heapq.heappush(
            self._handoffs, _Handoff(end + seconds, self._handoff_seq, req_id, index, route)
        )
        self._handoff_seq += 1

    def _session_of(self, req_id: str) -> str | None:
        record = self.recorder.requests.get(req_id)
        return record.job_id if record is not None else None

    def _admit_handoffs(self) -> None:
        while self._handoffs and self._handoffs[0].time_s <= self.now:
            handoff = heapq.heappop(self._handoffs)
            req_id, index = handoff.req_id, handoff.replica
            flight = self._inflight[req_id]
            answer = self.sim.answer(req_id)
            tokens = (*flight.tokens, *answer)
            remaining = flight.max_tokens - len(answer)
            try:
                self.replicas[index].engine.add_request(
                    Request(
                        req_id=req_id,
                        prompt_token_ids=tokens,
                        sampling=SamplingParams(max_tokens=remaining, ignore_eos=True),
                        arrival_time=handoff.time_s,
                        session_id=self._session_of(req_id),
                        # The prompt's KV and state arrived: computed at once, as vLLM's KV
                        # connector marks them; the first answer token is the first computed.
                        num_external_computed_tokens=len(flight.tokens),
                    )
                )
            except RequestError as exc:
                # No room to decode (the prompt filled the context): the answer ends here.
                self.sim.reject(req_id, len(tokens), str(exc))
                self._inflight.pop(req_id)
                self.recorder.on_finish(req_id, self.now)
                self.sim.finished(req_id, self.now, self.sim.take_answer(req_id))
                continue
            self.decode_router.routed(handoff.route, index - self.num_prefill)
            flight.replica, flight.output, flight.decoding = index, remaining, True
            self.decode_of[req_id] = index
            self._change_load(index, remaining)

    def _change_load(self, index: int, delta: int) -> None:
        now = self.now
        router, local = self._slot[index]
        lo = max(self._last_change[index], self.config.warmup_s)
        hi = min(now, self.config.duration_s)
        if hi > lo:
            self._area[index] += router.outstanding[local] * (hi - lo)
        self._last_change[index] = max(self._last_change[index], now)
        router.outstanding[local] += delta

    # ----- the report -------------------------------------------------------------------------

    def mean_outstanding(self, end_s: float) -> list[float]:
        """Each replica's outstanding tokens averaged over [warmup, end_s]."""
        span = end_s - self.config.warmup_s
        out = []
        for index in range(len(self.replicas)):
            area = self._area[index]
            lo = max(self._last_change[index], self.config.warmup_s)
            router, local = self._slot[index]
            if end_s > lo:
                area += router.outstanding[local] * (end_s - lo)
            out.append(area / span if span > 0 else 0.0)
        return out
