"""Controls off = vLLM: every recorded step of the real vLLM 0.33 scheduler, reproduced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.recordings.recording import RecordingError, generate_prompt, load_recording
from hybridserve.recordings.replay import replay_recording
from tests.conftest import require_data

IDENTICAL = [
    "burst_agents_fa16",
    "threshold_fa16",
    "poisson_agents_fa16_tight",
    "hybrid_align_544",
    "hybrid_align_544_tight",
    "priority_fa16",
    # Extension recordings (FORMAT.md 7): speculation, sliding windows, retention modes.
    "mtp2_fa16",
    "mtp2_fa16_resend",
    "hybrid_mtp_align_544",
    "hybrid_eagle_legacy_align_544",
    "swa_fa32_swa16",
    "hybrid_align_dense",
    "hybrid_align_interval",
    "hybrid_fine_hits",
    "hybrid_fine_hits_pmu16",
    "eagle_legacy_fa16",
]
RECORDINGS = IDENTICAL
# Replays that also check the cache invariants after every step.
CHECKED = {
    "hybrid_align_544_tight",
    "mtp2_fa16",
    "swa_fa32_swa16",
    "hybrid_mtp_align_544",
    "hybrid_fine_hits_pmu16",
}


@pytest.mark.parametrize("name", IDENTICAL)
def test_baseline_reproduces_every_recorded_vllm_step(name: str) -> None:
    recording = load_recording(require_data("vllm-recordings", f"{name}.jsonl"))
    report = replay_recording(recording, check_invariants=name in CHECKED)
    assert report.first_divergence is None, report.first_divergence
    assert report.identical_steps == report.steps == len(recording.steps)


def test_every_shipped_recording_is_covered() -> None:
    folder = require_data("vllm-recordings")
    assert sorted(p.stem for p in folder.glob("*.jsonl")) == sorted(RECORDINGS)


def test_rebuilt_prompts_must_match_their_digests(tmp_path: Path) -> None:
    source = require_data("vllm-recordings", "threshold_fa16.jsonl")
    lines = source.read_text().splitlines()
    header = json.loads(lines[0])
    header["workload"]["params"]["agent_p_mul"] += 1
    (tmp_path / "bad.jsonl").write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(RecordingError, match="prompt_sha256"):
        load_recording(tmp_path / "bad.jsonl")


def test_prompt_generator_follows_the_closed_form() -> None:
    params = {
        "n_agents": 2,
        "growth": 3,
        "base_min": 4,
        "base_mul": 1,
        "base_mod": 3,
        "agent_tag_base": 100,
        "agent_tok_base": 200,
        "agent_a_mul": 10,
        "agent_p_mul": 1,
        "agent_tok_mod": 50,
        "suffix_tag_base": 300,
        "suffix_tok_base": 400,
        "suffix_i_mul": 5,
        "suffix_j_mul": 2,
        "suffix_tok_mod": 7,
        "suffix_min": 2,
        "suffix_len_mul": 1,
        "suffix_len_mod": 2,
    }
    # i=3: a=1, k=1 -> shared 4+1+3=8, suffix 2+1=3
    prompt = generate_prompt(3, params)
    assert prompt[:2] == [101, 200 + (10 + 1) % 50]
    assert len(prompt) == 11 and prompt[8] == 303 and prompt[9] == 400 + (15 + 2) % 7


def test_replay_command_reports_json_and_exit_status() -> None:
    path = require_data("vllm-recordings", "threshold_fa16.jsonl")
    result = CliRunner().invoke(app, ["replay-vllm", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["steps"] == report["identical_steps"] == 812
    assert report["first_divergence"] is None


def test_replay_command_fails_on_a_divergent_recording(tmp_path: Path) -> None:
    source = require_data("vllm-recordings", "threshold_fa16.jsonl")
    lines = source.read_text().splitlines()
    step_index = next(
        i for i, line in enumerate(lines) if '"step": 5,' in line or '"step":5,' in line
    )
    step = json.loads(lines[step_index])
    step["num_free_blocks"] += 1
    lines[step_index] = json.dumps(step)
    (tmp_path / "tampered.jsonl").write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(app, ["replay-vllm", str(tmp_path / "tampered.jsonl"), "--json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["first_divergence"]["step"] == 5
    assert report["first_divergence"]["field"] == "num_free_blocks"
