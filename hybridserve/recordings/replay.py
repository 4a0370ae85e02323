"""Run the hybridserve baseline on a recording's scenario and compare every step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridserve.engine import Engine
from hybridserve.executor.fake import FakeExecutor
from hybridserve.kvcache import KVCacheManager
from hybridserve.recordings.trace import Recording, cache_layout, scheduler_config
from hybridserve.scheduler import Scheduler

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


def replay_recording(recording: Recording, *, check_invariants: bool = False) -> ReplayReport:
    cache = KVCacheManager(cache_layout(recording.header))
    scheduler = Scheduler(scheduler_config(recording.header), cache)
    by_id = {r.req_id: r for r in recording.requests}
    engine = Engine(scheduler, FakeExecutor(lambda req_id, t: by_id[req_id].output_token(t)))
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
