"""The pure parts of benchmarks/trace_real.py: each seed's window of the trace, the simulated
twin of a real trace run, the paired ratios and the measured-against-simulated rows (no server
runs, no simulation)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hybridserve.sim.arrivals import azure_arrivals
from tests.benchmark_module import load_benchmark

pytest.importorskip("httpx", reason="the benchmark's server helpers need the server extra")

ROWS = [  # (seconds after the first request, prompt tokens, output tokens)
    (0.0, 100, 10), (1.5, 200, 20), (2.9, 300, 30), (3.0, 400, 40), (5.2, 500, 50),
]  # fmt: skip


@pytest.fixture(scope="module")
def tr() -> ModuleType:
    return load_benchmark("trace_real")


@pytest.fixture(scope="module")
def fid() -> ModuleType:
    return load_benchmark("fidelity")


def _trace(path: Path) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for at, prompt, out in ROWS:
        lines.append(f"2023-11-16 18:15:{40 + at:09.6f},{prompt},{out}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_each_seed_replays_the_next_stretch_of_the_trace_from_zero(
    tr: ModuleType, tmp_path: Path
) -> None:
    trace = _trace(tmp_path / "AzureLLMInferenceTrace_conv.csv")
    # 30 wall seconds at 10 wall seconds a trace second: 3 trace seconds a window.
    first = tr.write_window(trace, 10.0, 0, 30.0, tmp_path / "logs")
    second = tr.write_window(trace, 10.0, 1, 30.0, tmp_path / "logs")
    assert first.name == "AzureLLMInferenceTrace_conv-ts10-s0.csv"
    with first.open() as handle:
        assert [int(r["ContextTokens"]) for r in csv.DictReader(handle)] == [100, 200, 300]
    replayed = list(azure_arrivals(second, time_scale=10.0))
    assert [len(prompt) for _, _, prompt, _ in replayed] == [400, 500]
    assert [at for at, *_ in replayed] == pytest.approx([0.0, 22.0])  # re-based, then scaled
    assert tr.load_label(trace, 10.0) == "azure-conv x1/10"
    with pytest.raises(SystemExit, match=r"no request between 15\.0 and 30\.0 s"):
        tr.write_window(trace, 2.0, 1, 30.0, tmp_path / "logs")


def test_the_twin_replays_the_runs_window_with_the_servers_scheduler(
    tr: ModuleType, tmp_path: Path
) -> None:
    from tests.unit.test_fidelity_script import twin_inputs

    checkpoint, cal = twin_inputs(tmp_path)
    setup = {"model": "smollm2", "duration": 210.0, "warmup": 30.0, "max_model_len": 8_192}
    pool = {"block_size": 32, "num_blocks": 384}
    for server, preset in (
        ("vllm", "baseline"),
        ("baseline", "baseline"),
        ("hybridserve", "hybridserve"),
    ):
        run = {"server": server, "time_scale": 8.0, "seed": 2, "window": "/w/s2.csv"}
        config = tr.sim_config(setup, pool, run, cal, checkpoint)
        assert config.preset == preset
        assert (config.workload, config.time_scale, config.seed) == ("azure:/w/s2.csv", 8.0, 2)
        assert (config.block_size, config.num_gpu_blocks_override) == (32, 384)
        assert (config.duration_s, config.warmup_s, config.max_model_len) == (210.0, 30.0, 8_192)
        assert config.calibrated_gpu.name == "cpu" and config.limit is None


def _run(server: str, seed: int, **metrics: float) -> dict[str, Any]:
    return {"server": server, "time_scale": 8.0, "seed": seed, "metrics": metrics}


def test_ratios_pair_seeds_and_rows_compare_means(tr: ModuleType) -> None:
    runs = [
        _run("vllm", 0, output_tokens_per_s=10.0, slo_requests_per_s=0.2),
        _run("vllm", 1, output_tokens_per_s=20.0, slo_requests_per_s=0.4),
        _run("hybridserve", 0, output_tokens_per_s=20.0, slo_requests_per_s=0.2),
        _run("hybridserve", 1, output_tokens_per_s=40.0, slo_requests_per_s=0.4),
        {"server": "hybridserve", "time_scale": 8.0, "seed": 2, "failed": {"reason": "exited"}},
    ]
    ratios = tr.ratios(runs, 8.0, [0, 1])
    assert list(ratios) == ["hybridserve/vllm"]
    tokens = ratios["hybridserve/vllm"]["output_tokens_per_s"]
    assert tokens["mean"] == pytest.approx(2.0) and tokens["per_seed"] == pytest.approx([2.0, 2.0])
    assert ratios["hybridserve/vllm"]["slo_requests_per_s"]["mean"] == pytest.approx(1.0)
    report = {"runs": runs, "setup": {"trace": "x/AzureLLMInferenceTrace_code.csv"}}
    simulated = {
        ("vllm", "vllm-http", 8.0, 0): {"output_tokens_per_s": 12.0},
        ("vllm", "vllm-http", 8.0, 1): {"output_tokens_per_s": 21.0},
    }
    rows = {r["metric"]: r for r in tr.fidelity_rows(report, simulated)}
    row = rows["output_tokens_per_s"]
    assert (row["measured"], row["simulated"], row["load"]) == (15.0, 16.5, "azure-code x1/8")
    assert row["error"] == pytest.approx(0.1) and row["per_seed"]["seeds"] == [0, 1]
    assert rows["ttft_p50_ms"]["error"] is None
    table = tr.markdown(list(rows.values()), tr.TABLE_METRICS)
    assert "| vllm | vllm-http | azure-code x1/8 |" in table and "+10% |" in table


def test_a_report_without_its_windows_writes_them_again(tr: ModuleType, tmp_path: Path) -> None:
    trace = _trace(tmp_path / "AzureLLMInferenceTrace_conv.csv")
    kept = tr.write_window(trace, 10.0, 1, 30.0, tmp_path / "kept")
    report = {
        "setup": {"trace": str(trace), "duration": 30.0},
        "runs": [
            {"server": "vllm", "time_scale": 10.0, "seed": 0, "window": "/gone/s0.csv"},
            {"server": "vllm", "time_scale": 10.0, "seed": 1, "window": str(kept)},
            {"server": "vllm", "time_scale": 10.0, "seed": 2, "failed": {"reason": "exited"}},
        ],
    }
    tr.ensure_windows(report, tmp_path / "again")
    again = Path(report["runs"][0]["window"])
    assert again == tmp_path / "again" / "AzureLLMInferenceTrace_conv-ts10-s0.csv"
    assert [len(p) for _, _, p, _ in azure_arrivals(again)] == [100, 200, 300]
    assert report["runs"][1]["window"] == str(kept)


def test_a_report_is_scored_with_the_calibrations_it_carries_when_the_folder_has_none(
    tr: ModuleType, tmp_path: Path
) -> None:
    carried = {name: {"name": name} for name in tr.CALIBRATION_NAMES}
    given = tmp_path / "given"
    given.mkdir()
    for name in tr.CALIBRATION_NAMES:
        (given / f"{name}.json").write_text(json.dumps({"from": "folder"}))
    # A folder that holds them all wins over the report's own.
    assert tr.calibration_folder({"calibrations": carried}, given) == given
    # An empty folder: the report's own, written out as they were.
    folder = tr.calibration_folder({"calibrations": carried}, tmp_path / "absent")
    assert json.loads((folder / "vllm-http.json").read_text()) == {"name": "vllm-http"}
    # Neither: an exit naming the folder and what it lacks.
    with pytest.raises(SystemExit, match="absent: no torch-own, torch-http, vllm-http"):
        tr.calibration_folder({}, tmp_path / "absent")


def _timed(server: str, seed: int, began: str, ended: str) -> dict[str, Any]:
    return _run(server, seed, output_tokens_per_s=1.0) | {"began": began, "ended": ended}


def test_a_run_between_two_calibrations_is_priced_by_when_it_ran(
    tr: ModuleType, fid: ModuleType, tmp_path: Path
) -> None:
    before, after = tmp_path / "before", tmp_path / "after"
    for folder, began, ended in (
        (before, "2026-12-07T10:00:00+00:00", "2026-12-07T10:10:00+00:00"),
        (after, "2026-12-07T12:00:00+00:00", "2026-12-07T12:10:00+00:00"),
    ):
        folder.mkdir()
        (folder / tr.MEASURED).write_text(json.dumps({"began": began, "ended": ended}))
    stamps = (fid.measured_stamp(before), fid.measured_stamp(after))
    times = (fid.midpoint(stamps[0]), fid.midpoint(stamps[1]))
    assert times[1] - times[0] == pytest.approx(7_200.0)
    runs = [
        _timed("vllm", 0, "2026-12-07T10:30:00+00:00", "2026-12-07T10:40:00+00:00"),
        _timed("vllm", 1, "2026-12-07T11:30:00+00:00", "2026-12-07T11:40:00+00:00"),
        _timed("vllm", 2, "2026-12-07T13:00:00+00:00", "2026-12-07T13:10:00+00:00"),
    ]
    # A quarter, three quarters, and past the second calibration: clamped to it.
    weights = fid.run_weights(runs, times, "time_scale")
    assert [weights[("vllm", 8.0, s)] for s in range(3)] == pytest.approx([0.25, 0.75, 1.0])
    first = {("vllm", "vllm-http", 8.0, s): {"itl_p50_ms": 100.0, "label": "x"} for s in range(3)}
    last = {("vllm", "vllm-http", 8.0, s): {"itl_p50_ms": 140.0} for s in range(3)}
    mixed = fid.bracketed(runs, "time_scale", stamps, first, last)
    assert [mixed[("vllm", "vllm-http", 8.0, s)] for s in range(3)] == [
        {"itl_p50_ms": pytest.approx(110.0)},
        {"itl_p50_ms": pytest.approx(130.0)},
        {"itl_p50_ms": pytest.approx(140.0)},
    ]


def test_bracketing_without_the_times_it_needs_exits_naming_what_is_missing(
    tr: ModuleType, fid: ModuleType, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit, match=r"measured\.json is not a readable measurement time"):
        fid.measured_stamp(tmp_path)
    untimed = [_run("hybridserve", 2)]
    with pytest.raises(SystemExit, match="hybridserve time_scale=8 seed 2 has no began/ended"):
        fid.run_weights(untimed, (0.0, 1.0), "time_scale")
    timed = [_timed("vllm", 0, "2026-12-07T10:00:00+00:00", "2026-12-07T10:10:00+00:00")]
    with pytest.raises(SystemExit, match="measured after"):
        fid.run_weights(timed, (5.0, 5.0), "time_scale")


def test_a_bracketed_report_carries_both_sets_and_when_each_was_measured(
    tr: ModuleType, fid: ModuleType, tmp_path: Path
) -> None:
    stamps = {
        key: {"began": f"2026-12-07T1{h}:00:00+00:00", "ended": f"2026-12-07T1{h}:05:00+00:00"}
        for key, h in (("calibrations", 0), ("calibrations_after", 2))
    }
    report = {key: {name: {"set": key} for name in tr.CALIBRATION_NAMES} for key in stamps} | {
        "calibrations_measured": stamps
    }
    absent = tmp_path / "absent"
    before = tr.calibration_folder(report, absent)
    after = tr.calibration_folder(report, absent, "calibrations_after", "--calibrations-after")
    assert json.loads((after / "torch-own.json").read_text()) == {"set": "calibrations_after"}
    assert fid.measured_stamp(before) == stamps["calibrations"]
    gap = fid.midpoint(fid.measured_stamp(after)) - fid.midpoint(fid.measured_stamp(before))
    assert gap == pytest.approx(7_200.0)
