"""Engine commands on malformed traces, recordings and settings: an error naming the file, the
real line, the field, the value and the fix (exit 2), never a traceback or a silent acceptance."""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridserve.cache_replay.trace import TraceError, load_mooncake
from hybridserve.cli import app
from hybridserve.core.config import SchedulerConfig
from hybridserve.core.errors import ConfigError
from hybridserve.engine.settings import load_settings_file
from hybridserve.sim.arrivals import azure_arrivals, mooncake_arrivals
from tests.conftest import require_data

ROOT = Path(__file__).resolve().parents[2]
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _run(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, " ".join(result.output.split())


def _mooncake_rows(n: int) -> list[dict[str, object]]:
    return [
        {"timestamp": 100 * i, "input_length": 600, "output_length": 4, "hash_ids": [i, i + 1]}
        for i in range(n)
    ]


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _simulate(workload: str) -> tuple[int, str]:
    return _run(["simulate", "--workload", workload, "--duration", "30", "--warmup", "0"])


# ----- traces --------------------------------------------------------------------------------


def test_invalid_utf8_in_a_mooncake_trace_names_the_line_and_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = json.dumps(_mooncake_rows(1)[0]).encode() + b"\n"
    path.write_bytes(good + b'{"timestamp": 1\xff}\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:2: byte \d+ \(column 16\) is not UTF-8"):
        load_mooncake(path)
    code, text = _simulate(f"mooncake:{path}")
    assert code == 2 and "t.jsonl:2" in text and "UTF-8" in text


def test_invalid_utf8_in_an_azure_trace_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_bytes(
        AZURE_HEADER.encode() + b"2023-11-16 18:17:03.97,48,10\n2023-11-16 18:17:04.9\xe9,5,1\n"
    )
    code, text = _simulate(f"azure:{path}")
    assert code == 2 and "a.csv:3: byte" in text and "is not UTF-8" in text


@pytest.mark.parametrize("stamp", ["NaN", "Infinity", "-5"])
def test_a_non_finite_or_negative_timestamp_refuses_the_trace_at_its_line(
    tmp_path: Path, stamp: str
) -> None:
    rows = [json.dumps(r) for r in _mooncake_rows(20)]
    rows[6] = rows[6].replace('"timestamp": 600', f'"timestamp": {stamp}')
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(rows) + "\n")
    code, text = _simulate(f"mooncake:{path}")
    assert code == 2, text
    assert "t.jsonl:7: timestamp=" in text and "finite number of milliseconds >= 0" in text


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("2023-11-16 18:17:04.97,-5,10", "ContextTokens='-5'; use an integer >= 1"),
        ("2023-11-16 18:17:04.97,0,10", "ContextTokens='0'; use an integer >= 1"),
        ("2023-11-16 18:17:04.97,12,-1", "GeneratedTokens='-1'; use an integer >= 0"),
        ("2023-11-16 18:17:04.97,12", "GeneratedTokens=None; use an integer >= 0"),
        ("yesterday,12,3", "TIMESTAMP='yesterday'; use an ISO time"),
    ],
)
def test_bad_azure_token_counts_are_refused_as_the_mooncake_loader_refuses_them(
    tmp_path: Path, row: str, message: str
) -> None:
    path = tmp_path / "a.csv"
    path.write_text(AZURE_HEADER + "2023-11-16 18:17:03.97,48,10\n\n" + row + "\n")
    with pytest.raises(TraceError) as info:
        list(azure_arrivals(path))
    assert f"a.csv:4: {message}" in str(info.value)  # line 4: the blank line 3 counts


def test_an_overlong_azure_row_is_rejected_before_its_prompt_is_built(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        AZURE_HEADER + "2023-11-16 18:17:03.97,48,10\n2023-11-16 18:17:04.97,2000000,10\n"
        "2023-11-16 18:17:05.97,30,8\n"
    )
    rejected: list[tuple[str, int, str]] = []
    rows = list(azure_arrivals(path, max_prompt_tokens=4096, rejected=rejected))
    assert [len(r[2]) for r in rows] == [48, 30]
    assert rejected == [("a1", 2_000_000, "max_model_len=4096 leaves no room to generate")]
    # No list to report it in: refused at its line (over the 2^20 ids an Azure prompt owns).
    with pytest.raises(TraceError, match=r"a\.csv:3: a 2,000,000-token prompt; an Azure prompt"):
        list(azure_arrivals(path))


def test_simulate_on_a_billion_token_azure_row_allocates_nothing_and_runs_the_rest(
    tmp_path: Path,
) -> None:
    """Under a 2 GiB address-space limit: a prompt built before the length check (8 GB of list
    alone) ends in a MemoryError instead of a run."""
    path = tmp_path / "a.csv"
    path.write_text(
        AZURE_HEADER + "2023-11-16 18:17:03.97,48,10\n2023-11-16 18:17:04.97,1000000000,10\n"
        "2023-11-16 18:17:05.97,30,8\n"
    )

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    done = subprocess.run(
        [sys.executable, "-m", "hybridserve.cli", "simulate", "--workload", f"azure:{path}"]
        + ["--duration", "30", "--warmup", "0"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_memory,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    text = " ".join(done.stderr.split())
    rejected = "1 requests were rejected, not run: a1 (request 2 of the trace, 1,000,000,000 tok"
    assert rejected in text


def test_an_overlong_mooncake_request_is_rejected_without_building_its_prompt(
    tmp_path: Path,
) -> None:
    path = _write_jsonl(tmp_path / "t.jsonl", _mooncake_rows(3))
    rejected: list[tuple[str, int, str]] = []
    rows = list(mooncake_arrivals(path, max_prompt_tokens=600, rejected=rejected))
    assert rows == [] and [r[:2] for r in rejected] == [("m0", 600), ("m1", 600), ("m2", 600)]


@pytest.mark.parametrize("kind", ["mooncake", "azure"])
def test_a_missing_trace_names_the_option_that_takes_it(tmp_path: Path, kind: str) -> None:
    code, text = _simulate(f"{kind}:{tmp_path / 'missing.file'}")
    assert code == 2 and "does not exist" in text
    assert f"--workload {kind}:PATH" in text and "--trace" not in text
    code, text = _run(["cache-replay", "--trace", str(tmp_path / "missing.jsonl")])
    assert code == 2 and "pass --trace PATH" in text  # cache-replay's own option


# ----- recordings ------------------------------------------------------------------------------


def _recording_lines() -> list[str]:
    return require_data("vllm-recordings", "threshold_fa16.jsonl").read_text().splitlines(True)


def _replay(path: Path) -> tuple[int, str]:
    return _run(["replay-vllm", str(path)])


def test_a_json_error_in_a_recording_names_its_real_line(tmp_path: Path) -> None:
    lines = _recording_lines()
    lines[300] = lines[300][:20] + "}\n"
    (tmp_path / "r.jsonl").write_text("".join(lines))
    code, text = _replay(tmp_path / "r.jsonl")
    assert code == 2 and "r.jsonl:301: not JSON" in text and "line 1" not in text


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        (lambda ls: "".join(ls[:500]) + ls[500][:40], "r.jsonl:501, the last line, is cut off"),
        (lambda ls: "".join(ls[:500]), "after 299 of the 812 steps its header (totals.steps)"),
        (lambda ls: "".join(ls[:50]), "after 49 of the 200 request lines its header"),
    ],
)
def test_a_truncated_recording_is_reported_as_truncated_not_as_a_divergence(
    tmp_path: Path, cut: object, message: str
) -> None:
    (tmp_path / "r.jsonl").write_text(cut(_recording_lines()))  # type: ignore[operator]
    code, text = _replay(tmp_path / "r.jsonl")
    assert code == 2, text
    assert text.startswith("error: truncated recording:") and message in text
    assert "diverge" not in text


def test_a_recording_header_without_engine_names_the_field(tmp_path: Path) -> None:
    lines = _recording_lines()
    header = json.loads(lines[0])
    del header["engine"]
    (tmp_path / "r.jsonl").write_text(json.dumps(header) + "\n" + "".join(lines[1:]))
    code, text = _replay(tmp_path / "r.jsonl")
    assert code == 2 and "r.jsonl:1: field 'engine' is missing" in text
    header = json.loads(lines[0])
    header["engine"]["policy"] = "lifo"
    (tmp_path / "p.jsonl").write_text(json.dumps(header) + "\n" + "".join(lines[1:]))
    code, text = _replay(tmp_path / "p.jsonl")
    assert code == 2 and "p.jsonl:1: engine.policy='lifo'; use one of ['fcfs', 'priority']" in text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("max_tokens"), "r.jsonl:4: field 'max_tokens' is missing"),
        (lambda r: r.update(max_tokens=0), "r.jsonl:4: max_tokens=0; use an integer >= 1"),
        (lambda r: r.update(idx="3"), "r.jsonl:4: idx='3'; use an integer >= 0"),
    ],
)
def test_a_bad_request_line_of_a_recording_names_its_line_and_field(
    tmp_path: Path, change: object, message: str
) -> None:
    lines = _recording_lines()
    row = json.loads(lines[3])
    change(row)  # type: ignore[operator]
    lines[3] = json.dumps(row) + "\n"
    (tmp_path / "r.jsonl").write_text("".join(lines))
    code, text = _replay(tmp_path / "r.jsonl")
    assert code == 2 and message in text


def test_generator_parameters_too_large_are_refused_before_a_prompt_is_built(
    tmp_path: Path,
) -> None:
    lines = _recording_lines()
    header = json.loads(lines[0])
    header["workload"]["params"]["growth"] = 40_000  # request 20's prompt: past max_model_len
    (tmp_path / "r.jsonl").write_text(json.dumps(header) + "\n" + "".join(lines[1:]))
    code, text = _replay(tmp_path / "r.jsonl")
    assert code == 2, text
    assert "r.jsonl:22: request r20: the generator gives a 42240-token prompt" in text
    assert "(engine.max_model_len=32768)" in text


def test_invalid_utf8_in_a_recording_names_the_line(tmp_path: Path) -> None:
    lines = [line.encode() for line in _recording_lines()]
    lines[7] = b'{"req_id": "\xff"}\n'
    (tmp_path / "r.jsonl").write_bytes(b"".join(lines))
    code, text = _replay(tmp_path / "r.jsonl")
    assert code == 2 and "r.jsonl:8: byte" in text and "is not UTF-8" in text


# ----- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_number_in_the_settings_file_names_the_field(
    tmp_path: Path, value: str
) -> None:
    path = tmp_path / "s.toml"
    path.write_text(f"[scheduler]\ntarget_mixed_step_ms = {value}\n")
    with pytest.raises(ConfigError, match=r"scheduler\.target_mixed_step_ms") as info:
        load_settings_file(path)
    assert "finite number" in str(info.value)
    code, text = _run(["serve", "--executor", "sim", "--config", str(path)])
    assert code == 2 and "scheduler.target_mixed_step_ms" in text


@pytest.mark.parametrize("name", ["decode_prefill_max_wait_ms", "kv_pin_max_ttl_s"])
def test_scheduler_config_refuses_nan_and_inf_in_every_float_field(name: str) -> None:
    for value in (math.nan, math.inf):
        with pytest.raises(ConfigError, match=rf"scheduler\.{name}=.* use a finite number"):
            SchedulerConfig(**{name: value})


def _float_flags() -> list[tuple[str, str, tuple[str, ...]]]:
    """(command, float flag, the command's required options with a placeholder value)."""
    import typer

    command = typer.main.get_command(app)
    found = []
    for name, sub in command.commands.items():  # type: ignore[attr-defined]
        required = tuple(
            arg for p in sub.params if p.required and p.opts for arg in (p.opts[0], "x")
        )
        for param in sub.params:
            if getattr(param.type_descriptor, "annotation", None) is float:
                found.append((name, param.opts[0], required))
    return found


def test_every_float_flag_of_the_command_line_refuses_nan_and_inf() -> None:
    flags = _float_flags()
    assert ("serve", "--target-mixed-step-ms", ()) in flags and len(flags) >= 20
    for command, flag, required in flags:
        for value in ("nan", "inf"):
            code, text = _run([command, *required, flag, value])
            assert code == 2, (command, flag, text)
            assert f"Invalid value for '{flag}'" in text and "not a finite number" in text
