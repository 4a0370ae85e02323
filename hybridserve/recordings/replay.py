"""Run the hybridserve baseline on a recording's scenario and compare every step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.engine.assembly import (
    EngineConfig,
    EngineParts,
    ModelCache,
    build_engine,
    resolve_engine_config,
)
from hybridserve.engine.settings import Preset
from hybridserve.executor.fake import FakeExecutor
from hybridserve.kvcache import CacheLayout, KVCacheManager
from hybridserve.recordings.recording import (
    RecordedRequest,
    Recording,
    RecordingError,
    cache_layout,
    scheduler_config,
)

COMPARED = (
    "scheduled",
    "new_reqs",
    "resumed",
    "preempted",
    "finished",
    "num_free_blocks_after_schedule",
    "num_free_blocks",
)


@dataclass(frozen=True, slots=True)
class ReplayReport:
    scenario: str
    steps: int
    identical_steps: int
    first_divergence: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "steps": self.steps,
            "identical_steps": self.identical_steps,
            "first_divergence": self.first_divergence,
        }


class RecordedSampler:
    """The recorder's fake model runner with its fake rejection sampler (FORMAT.md 7.4).

    A sampling chunk with d drafts, r of them real (placeholders are -1), emits a + 1 tokens,
    a = min(k, r); every scheduled request is then offered K drafts for the next step, which
    the scheduler keeps only for a request that is running and not in a partial prefill.
    """

    def __init__(
        self, requests: dict[str, RecordedRequest], sampler: dict[str, int], num_drafts: int
    ) -> None:
        self.requests = requests
        self.sampler = sampler
        self.num_drafts = num_drafts
        self._num_outputs: dict[str, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for req_id in plan.finished_req_ids:
            self._num_outputs.pop(req_id, None)
        sampled: dict[str, tuple[int, ...]] = {}
        drafts: dict[str, tuple[int, ...]] = {}
        for chunk in plan.chunks:
            recorded = self.requests[chunk.req_id]
            t = self._num_outputs.get(chunk.req_id, 0)
            if chunk.sample:
                drafted = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens :]
                real = sum(1 for token in drafted if token >= 0)
                accepted = min(recorded.accepted_drafts(plan.step_id, self.sampler), real)
                sampled[chunk.req_id] = tuple(
                    recorded.output_token(t + j) for j in range(accepted + 1)
                )
                t += accepted + 1
                self._num_outputs[chunk.req_id] = t
            drafts[chunk.req_id] = tuple(
                recorded.output_token(t + j) for j in range(self.num_drafts)
            )
        return StepResult(plan.step_id, sampled, 0.0, drafts)


def recorded_engine(recording: Recording) -> EngineParts:
    """The baseline engine in the recording's configuration, over the recorder's fake model
    runner (its sampler when the recording speculates)."""
    config = recorded_config(recording)
    by_id = {r.req_id: r for r in recording.requests}
    sampler = recording.draft_sampler
    num_drafts = config.layout.speculative.num_speculative_tokens

    def executor(layout: CacheLayout) -> FakeExecutor | RecordedSampler:
        if sampler is not None and num_drafts > 0:
            return RecordedSampler(by_id, sampler, num_drafts)
        return FakeExecutor(lambda req_id, t: by_id[req_id].output_token(t))

    return build_engine(config, executor)


def recorded_config(recording: Recording) -> EngineConfig:
    """The recorded engine's configuration, resolved as every engine's is
    (`resolve_engine_config`): the header's scheduler settings, retention and cache geometry,
    and its in-flight cap when it logged one (else one step's budget, vLLM's own rule). A value
    they refuse is an error of the recording, named with its file and line 1."""
    header = recording.header
    try:
        layout, scheduler = cache_layout(header), scheduler_config(header)
        settings = Preset(
            scheduler=scheduler,
            retention=layout.retention,
            lookahead_block_hashes=layout.speculative.lookahead_block_hashes,
        )
        model = ModelCache(
            groups=layout.groups,
            speculative=layout.speculative,
            dcp=layout.dcp,
            hash_block_size=layout.hash_block_size,
            alignment_tokens=layout.alignment_tokens,
            eagle_groups=layout.eagle_groups,
            partial_hash_hits=layout.partial_hash_hits,
        )
        return resolve_engine_config(
            settings,
            model,
            num_blocks=layout.num_blocks,
            enable_caching=header["engine"].get("enable_prefix_caching", True),
            max_in_flight_tokens=header["engine"].get("max_in_flight_tokens"),
        )
    except RecordingError as exc:
        raise RecordingError(f"{recording.path}:1: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        detail = f"{exc.args[0]!r} is missing" if isinstance(exc, KeyError) else str(exc)
        raise RecordingError(
            f"{recording.path}:1: the header's engine and cache settings cannot build the "
            f"recorded engine: {detail}"
        ) from None


def replay_recording(recording: Recording, *, check_invariants: bool = False) -> ReplayReport:
    parts = recorded_engine(recording)
    engine, cache = parts.engine, parts.cache
    pending = sorted(recording.requests, key=lambda r: (r.arrival_step, r.index))
    cursor = step = identical = 0
    first: dict[str, Any] | None = None
    recorded = recording.steps
    while cursor < len(pending) or engine.has_requests():
        while cursor < len(pending) and pending[cursor].arrival_step == step:
            engine.add_request(pending[cursor].to_request())
            cursor += 1
        done = engine.step(float(step))
        if check_invariants:
            cache.check_invariants()
        actual = _step_line(done, cache)
        expected = recorded[step] if step < len(recorded) else None
        diff = _first_difference(expected, actual)
        if diff is None:
            identical += 1
        elif first is None:
            first = {"step": step, **diff}
        step += 1
    if step != len(recorded) and first is None:
        first = {"step": step, "field": "steps", "expected": len(recorded), "actual": step}
    return ReplayReport(recording.scenario, len(recorded), identical, first)


def _step_line(done: Any, cache: KVCacheManager) -> dict[str, Any]:
    out = done.scheduled
    return {
        "scheduled": [list(x) for x in out.num_scheduled_tokens],
        "new_reqs": [list(x) for x in out.new_reqs],
        "resumed": [list(x) for x in out.resumed],
        "preempted": list(out.preempted),
        "finished": [o.req_id for o in done.outputs if o.finished],
        "num_free_blocks_after_schedule": out.num_free_blocks,
        "num_free_blocks": cache.num_free_blocks,
    }


def _first_difference(
    expected: dict[str, Any] | None, actual: dict[str, Any]
) -> dict[str, Any] | None:
    if expected is None:
        return {"field": "steps", "expected": None, "actual": "an extra step"}
    for field in COMPARED:
        want, got = expected.get(field), actual[field]
        if want != got:
            diff: dict[str, Any] = {"field": field, "expected": want, "actual": got}
            if isinstance(want, list) and isinstance(got, list):
                diff["index"] = next(
                    (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                    min(len(want), len(got)),
                )
            return diff
    return None
