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
    from tests.unit.test_fidelity_script import LLAMA, _calibration

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(LLAMA))
    cal = _calibration(tmp_path / "cal.json")
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
