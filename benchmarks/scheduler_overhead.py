"""Scheduler overhead on the 20-agent burst workload (experiment E3), against vLLM 0.33.

Measures the thread CPU time (`time.thread_time_ns`) of every `Scheduler.schedule()` call and
every `Scheduler.update()` call, separately, while the `burst_agents_fa16` recording's scenario
(512 requests, 20 agents, all added before step 0) runs to completion with the recording's fake
sampler: the driver loop of `hybridserve.recordings.replay`, without the step comparison. The
fake executor runs between the two calls and is not timed; nor are request creation, block
hashing at `add_request`, or the driver's bookkeeping.

Two runs, one JSON object per line on stdout:

1. full attention, block 16: the burst_agents_fa16 recording as it is;
2. hybrid full + Mamba2 (align, 544): the cache layout (groups, block count, hash block size,
   alignment, retention) of the hybrid_align_544 recording's header, with the requests, arrival
   steps and scheduler limits of burst_agents_fa16.

Steps are bucketed by the number of requests scheduled in the step; a bucket "N" holds the steps
with 0.75 N <= requests <= 1.25 N (other steps count only in the whole-trace total). Percentiles
are sorted-index (nearest-rank) percentiles: p-th = sorted[ceil(p/100 * n) - 1]; the median is
`statistics.median`. Each layout runs once as a warm-up (imports, allocator, caches), then once
measured; the garbage collector stays on, as it is in a server. vLLM 0.33's reference medians are
from data/README.md (a busy 2-core CI machine): compare ratios, not absolute times.

`--profile` also runs cProfile over one more full-attention run (enabled only inside schedule()
and update(), so request creation and the fake executor stay out of it) and prints the top 25
functions by tottime to stderr, so that stdout stays JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridserve.core.paths import data_path
from hybridserve.executor.fake import FakeExecutor
from hybridserve.kvcache import CacheLayout, KVCacheManager
from hybridserve.recordings.recording import (
    Recording,
    RecordingError,
    cache_layout,
    load_recording,
    scheduler_config,
)
from hybridserve.scheduler import Scheduler

# data/vllm-recordings (or $HYBRIDSERVE_DATA/vllm-recordings).
RECORDINGS = data_path("vllm-recordings")
WORKLOAD = "burst_agents_fa16"
HYBRID = "hybrid_align_544"
BUCKETS = (32, 128, 256)
TOLERANCE = 0.25
BUCKET_RULE = (
    "a step is in bucket N when 0.75*N <= len(scheduled) <= 1.25*N; "
    "p99 = sorted[ceil(0.99*n) - 1] (nearest rank), median = statistics.median"
)

# vLLM 0.33.0, thread CPU time per step in µs, from data/README.md (E3 table):
# bucket -> (schedule() median, p99, update_from_output() median, p99).
VLLM_0_33: dict[str, dict[str, tuple[int, int, int, int]]] = {
    "full": {
        "32": (301, 4323, 166, 1089),
        "128": (1188, 7667, 782, 2149),
        "256": (3761, 9858, 1905, 3698),
    },
    "hybrid": {
        "32": (496, 951, 145, 343),
        "128": (2180, 3195, 765, 1278),
        "256": (4426, 7850, 1583, 2567),
    },
}
VLLM_0_33_WHOLE_TRACE = {"steps": 933, "total_cpu_s": 3.70}  # full attention only


@dataclass(slots=True)
class Timings:
    """Per-step measurements of one run."""

    num_requests: list[int] = field(default_factory=list)
    schedule_ns: list[int] = field(default_factory=list)
    update_ns: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def steps(self) -> int:
        return len(self.num_requests)

    @property
    def total_cpu_s(self) -> float:
        return (sum(self.schedule_ns) + sum(self.update_ns)) / 1e9


def drive(
    recording: Recording, layout: CacheLayout, profiler: cProfile.Profile | None = None
) -> Timings:
    """Run the recording's requests to completion, timing schedule() and update() per step.

    With a profiler, it is enabled around the schedule() and update() calls only (the timings
    of such a run include the profiler's overhead and are not reported).
    """
    cache = KVCacheManager(layout)
    scheduler = Scheduler(scheduler_config(recording.header), cache)
    by_id = {r.req_id: r for r in recording.requests}
    executor = FakeExecutor(lambda req_id, t: by_id[req_id].output_token(t))
    pending = sorted(recording.requests, key=lambda r: (r.arrival_step, r.index))
    timings = Timings()
    clock = time.thread_time_ns
    cursor = step = 0
    while cursor < len(pending) or scheduler.has_requests():
        while cursor < len(pending) and pending[cursor].arrival_step == step:
            scheduler.add_request(pending[cursor].to_request())
            cursor += 1
        if profiler is not None:
            profiler.enable()
        t0 = clock()
        scheduled = scheduler.schedule(float(step))
        t1 = clock()
        if profiler is not None:
            profiler.disable()
        result = executor.execute(scheduled.plan)
        if profiler is not None:
            profiler.enable()
        t2 = clock()
        scheduler.update(scheduled, result)
        t3 = clock()
        if profiler is not None:
            profiler.disable()
        timings.num_requests.append(len(scheduled.num_scheduled_tokens))
        timings.schedule_ns.append(t1 - t0)
        timings.update_ns.append(t3 - t2)
        timings.num_preempted += len(scheduled.preempted)
        step += 1
    return timings


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile: the smallest value with at least p% of the values <= it."""
    ordered = sorted(values)
    return ordered[max(math.ceil(p / 100 * len(ordered)) - 1, 0)]


def summarize(timings: Timings) -> dict[str, dict[str, Any]]:
    buckets: dict[str, dict[str, Any]] = {}
    for nominal in BUCKETS:
        low, high = (1 - TOLERANCE) * nominal, (1 + TOLERANCE) * nominal
        rows = [i for i, n in enumerate(timings.num_requests) if low <= n <= high]
        entry: dict[str, Any] = {"requests": nominal, "steps": len(rows)}
        for name, series in (("schedule", timings.schedule_ns), ("update", timings.update_ns)):
            us = [series[i] / 1e3 for i in rows]
            entry[f"{name}_us_median"] = round(statistics.median(us), 1) if us else None
            entry[f"{name}_us_p99"] = round(percentile(us, 99), 1) if us else None
        buckets[str(nominal)] = entry
    return buckets


def vllm_reference(kind: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for bucket, (sched, sched_p99, update, update_p99) in VLLM_0_33[kind].items():
        out[bucket] = {
            "schedule_us_median": sched,
            "schedule_us_p99": sched_p99,
            "update_us_median": update,
            "update_us_p99": update_p99,
            "schedule_plus_update_us_median": sched + update,
        }
    return out


def ratios(buckets: dict[str, dict[str, Any]], vllm: dict[str, dict[str, int]]) -> dict[str, Any]:
    """ours / vLLM per bucket, for the schedule, update and schedule+update medians."""
    out: dict[str, Any] = {}
    for bucket, ref in vllm.items():
        ours = buckets[bucket]
        if ours["schedule_us_median"] is None:
            out[bucket] = None
            continue
        combined = ours["schedule_us_median"] + ours["update_us_median"]
        out[bucket] = {
            "schedule_median": round(ours["schedule_us_median"] / ref["schedule_us_median"], 3),
            "update_median": round(ours["update_us_median"] / ref["update_us_median"], 3),
            "schedule_plus_update_median": round(
                combined / ref["schedule_plus_update_us_median"], 3
            ),
            "schedule_plus_update_us_median": round(combined, 1),
        }
    return out


def report(
    label: str, kind: str, timings: Timings, layout: CacheLayout, extra: dict[str, Any]
) -> dict[str, Any]:
    buckets = summarize(timings)
    vllm = vllm_reference(kind)
    line: dict[str, Any] = {
        "workload": label,
        "buckets": buckets,
        "total_cpu_s": round(timings.total_cpu_s, 3),
        "steps": timings.steps,
        "vllm_0_33": vllm,
        "ratio_to_vllm": ratios(buckets, vllm),
        "bucketing": BUCKET_RULE,
        "schedule_cpu_s": round(sum(timings.schedule_ns) / 1e9, 3),
        "update_cpu_s": round(sum(timings.update_ns) / 1e9, 3),
        "preemptions": timings.num_preempted,
        "num_blocks": layout.num_blocks,
        **extra,
    }
    if kind == "full":
        line["vllm_0_33_whole_trace"] = VLLM_0_33_WHOLE_TRACE
    return line


def hybrid_layout(directory: Path) -> CacheLayout:
    """The hybrid_align_544 layout; only its header is read (its requests are not rebuilt)."""
    path = directory / f"{HYBRID}.jsonl"
    with path.open(encoding="utf-8") as handle:
        header = json.loads(handle.readline())
    return cache_layout(header)


def profile_run(recording: Recording, layout: CacheLayout, top: int) -> None:
    """cProfile schedule() and update() over one run; the top functions by tottime to stderr."""
    profiler = cProfile.Profile()
    drive(recording, layout, profiler)
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    stats.sort_stats(pstats.SortKey.TIME).print_stats(top)
    print(buffer.getvalue(), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--recordings", type=Path, default=RECORDINGS)
    parser.add_argument(
        "--profile", action="store_true", help="cProfile a full-attention run (top 25 to stderr)"
    )
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up runs")
    args = parser.parse_args(argv)
    path = args.recordings / f"{WORKLOAD}.jsonl"
    if not path.exists():
        print(json.dumps({"error": f"{path} is absent; skipping the scheduler benchmark"}))
        return 0
    try:
        recording = load_recording(path)
    except RecordingError as exc:
        print(json.dumps({"error": str(exc)}))
        return 0
    full_label = "burst_agents_fa16 (full attention, block 16)"
    runs = [(full_label, "full", cache_layout(recording.header))]
    hybrid_path = args.recordings / f"{HYBRID}.jsonl"
    if hybrid_path.exists():
        runs.append(
            (
                "burst_agents_fa16 prompts on the hybrid_align_544 layout "
                "(full attention 544 + Mamba2 align 544)",
                "hybrid",
                hybrid_layout(args.recordings),
            )
        )
    for label, kind, layout in runs:
        if not args.no_warmup:
            drive(recording, layout)
        timings = drive(recording, layout)
        extra = {"layout_from": f"{HYBRID}.jsonl header"} if kind == "hybrid" else {}
        print(json.dumps(report(label, kind, timings, layout, extra)), flush=True)
    if not hybrid_path.exists():
        print(json.dumps({"error": f"{hybrid_path} is absent; no hybrid run"}), flush=True)
    if args.profile:
        profile_run(recording, runs[0][2], top=25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
