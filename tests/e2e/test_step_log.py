"""`serve --step-log` and `simulate --step-log` write one JSON line per step that scheduled
work, in one form: the schedule a run took, step by step."""

from __future__ import annotations

import io
import itertools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.cli.sim_backend import SimServingBackend
from hybridserve.core.errors import ConfigError
from hybridserve.engine.step_log import StepLog, StepRecord, read_step_log
from hybridserve.server.app import ServerSettings
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.run import run_simulation
from hybridserve.sim.workload import AgentParams
from tests.e2e.conftest import MODEL, start_server


def test_a_served_request_is_logged_as_its_prefill_then_one_decode_a_token(
    tmp_path: Path,
) -> None:
    path = tmp_path / "steps.jsonl"
    server = start_server(settings=ServerSettings(step_log=path, warm_up_tokens=0))
    prompt = list(range(100, 140))  # 40 token ids
    try:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "ignore_eos": True}
        reply = server.client.post(f"{server.api_url}/completions", json=body).json()
    finally:
        server.stop()  # the engine thread closes the log
    assert reply["usage"]["completion_tokens"] == 6
    records = read_step_log(path)
    # The prefill samples the first token; each of the other five is one decode step.
    assert [r.chunks for r in records] == [((40, 0, 0),)] + [((1, 40 + i, 0),) for i in range(5)]
    assert [r.kind for r in records] == ["prefill"] + ["decode"] * 5
    # The sim backend's executor reports its modelled seconds (the server paces to them).
    assert all(r.s > 0 and r.exec_s > 0 for r in records)
    assert all(b.t >= a.t + a.s for a, b in itertools.pairwise(records))


def test_decodes_of_prompts_behind_one_cached_prefix_log_the_blocks_they_share(
    tmp_path: Path,
) -> None:
    """Two streams whose prompts begin with the same cached 64 tokens (4 blocks) decode
    together: their steps log those 64 tokens as shared (read by one decode more)."""
    path = tmp_path / "steps.jsonl"
    backend = SimServingBackend(model_profile="llama-3.1-8b", sim_speed=1.0)
    server = start_server(settings=ServerSettings(step_log=path, warm_up_tokens=0), backend=backend)
    prefix = list(range(100, 164))

    def complete(own: int, max_tokens: int) -> int:
        body = {"model": backend.model_name, "prompt": [*prefix, *[own] * 16]}
        body |= {"max_tokens": max_tokens, "ignore_eos": True}
        reply = httpx.post(f"{server.api_url}/completions", json=body, timeout=60).json()
        return int(reply["usage"]["completion_tokens"])

    try:
        assert complete(7, 1) == 1  # the prefix is cached
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(complete, (8, 9), (32, 32))) == [32, 32]
    finally:
        server.stop()
    records = read_step_log(path)
    together = [r for r in records if r.kind == "decode" and len(r.chunks) == 2]
    assert together and {r.shared for r in together} == {64}
    assert all(r.shared == 0 for r in records if len(r.chunks) == 1)


def test_a_simulated_run_logs_every_step_in_order_and_without_overlap(tmp_path: Path) -> None:
    config = SimConfig(agents=AgentParams(num_agents=3), duration_s=90.0, warmup_s=10.0)
    path = tmp_path / "sim.jsonl"
    with StepLog(path) as log:
        run = run_simulation(config, step_log=log)
    records = read_step_log(path)
    # Every step but those that scheduled nothing (a pool waiting on a pin, say).
    assert 0.99 * run.summary["steps"] <= len(records) == log.steps <= run.summary["steps"]
    # (the log keeps microseconds)
    assert all(b.t >= a.t + a.s - 2e-6 for a, b in itertools.pairwise(records))
    kinds = {r.kind for r in records}
    assert {"decode", "prefill"} <= kinds
    # The agents' prompts begin with one system prompt: decodes together share its blocks
    # (whole blocks of it, once per extra decode).
    shared = [r.shared for r in records if r.num_decodes > 1]
    assert max(shared) >= 0.9 * config.agents.system_prompt_tokens
    assert all(r.shared == 0 for r in records if r.num_decodes < 2)
    # A simulated step's seconds are the executor's: nothing else is charged.
    assert all(r.s == pytest.approx(r.exec_s) for r in records)


def test_a_step_log_line_that_is_not_a_record_is_named_but_a_cut_last_line_is_skipped(
    tmp_path: Path,
) -> None:
    good = StepRecord(t=1.0, s=0.5, exec_s=0.4, chunks=((1, 10, 0), (64, 0, 0)))
    line = json.dumps(good.to_json())
    path = tmp_path / "steps.jsonl"
    path.write_text(f"{line}\n{line[:20]}")  # a writer killed mid-line
    assert read_step_log(path) == [good]
    assert good.kind == "mixed" and good.num_decodes == 1 and good.num_prefill_tokens == 64
    path.write_text(f'{line}\n{{"t": 2}}\n{line}\n')
    with pytest.raises(ConfigError, match=r"line 2.*--step-log"):
        read_step_log(path)


def test_a_step_log_in_a_missing_folder_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--step-log"):
        StepLog(tmp_path / "no" / "such" / "steps.jsonl")


def test_simulate_refuses_a_step_log_for_a_fleet_before_writing_it(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    args = ["simulate", "--agents", "2", "--duration", "60", "--warmup", "10", "--json"]
    result = CliRunner().invoke(app, [*args, "--replicas", "2", "--step-log", str(path)])
    assert result.exit_code == 2
    assert "a step log follows one engine" in " ".join(result.output.split())
    assert not path.exists()


def test_serve_refuses_a_step_log_in_a_missing_folder_before_loading_a_model(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "no" / "steps.jsonl"
    result = CliRunner().invoke(app, ["serve", "--executor", "sim", "--step-log", str(missing)])
    assert result.exit_code == 2
    assert "--step-log" in result.output and "does not exist" in result.output


def test_a_step_log_that_cannot_be_written_is_dropped_with_a_warning_not_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class FullDisk(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

    config = SimConfig(agents=AgentParams(num_agents=2), duration_s=60.0, warmup_s=10.0)
    with StepLog(tmp_path / "steps.jsonl") as log:
        log._file.close()  # the real file, replaced by a disk that is full
        log._file = FullDisk()
        run = run_simulation(config, step_log=log)
    assert run.summary["steps"] > 0 and log.steps == 0
    assert "No space left on device" in caplog.text
