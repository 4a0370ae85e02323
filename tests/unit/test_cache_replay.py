"""`hybridserve cache-replay`: trace loading, token synthesis, the replay and its output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridserve.cache_replay.trace import TraceError, TraceRecord, load_mooncake
from hybridserve.cli import app
from hybridserve.core.errors import ConfigError
from hybridserve.layouts import LAYOUTS, parse_groups
from tests.conftest import require_data

runner = CliRunner()


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def replay_json(*args: str) -> dict[str, object]:
    result = runner.invoke(app, ["cache-replay", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_synthesised_blocks_share_tokens_exactly_when_hash_ids_match() -> None:
    a = TraceRecord(0, 0.0, 1000, 5, (7, 8)).prompt_tokens()
    b = TraceRecord(1, 0.0, 700, 5, (7, 9)).prompt_tokens()
    assert len(a) == 1000 and len(b) == 700
    assert a[:512] == b[:512] and not set(a[512:]) & set(b[512:])
    outs = [TraceRecord(i, 0.0, 10, 4, (1,)).output_tokens() for i in (0, 1)]
    assert not set(outs[0]) & set(outs[1]) and not set(outs[0]) & set(a)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"timestamp": 0, "input_length": 10, "output_length": 1}, "hash_ids"),
        ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}, "input_length"),
        ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}, "needs 2"),
        ({"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": [1]}, "timestamp"),
    ],
)
def test_malformed_trace_lines_are_named_with_line_and_field(
    tmp_path: Path, row: dict[str, object], message: str
) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row])
    with pytest.raises(TraceError, match=message) as info:
        load_mooncake(path)
    assert "t.jsonl:1" in str(info.value)


def test_cli_reports_bad_input_without_a_traceback(tmp_path: Path) -> None:
    result = runner.invoke(app, ["cache-replay", "--trace", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2
    assert "does not exist" in result.output and "Traceback" not in result.output
    bad = runner.invoke(app, ["cache-replay", "--model", "gpt-9"])
    assert bad.exit_code == 2 and "llama-3.1-8b" in bad.output
    blocks = runner.invoke(app, ["cache-replay", "--num-blocks", "lots"])
    assert blocks.exit_code == 2 and "--num-blocks" in blocks.output


def test_group_strings_parse_into_specs_and_errors_name_the_fix() -> None:
    groups = parse_groups("full:16,swa:16:w=4096,mamba:32:mode=all,draft:16:w=8:extra=4")
    assert [g.kind.value for g in groups] == ["full", "swa", "mamba", "draft"]
    for bad, fix in (("swa:16", "w=N"), ("tree:4", "kind"), ("full", "KIND:BLOCK_SIZE")):
        with pytest.raises(ConfigError, match=fix):
            parse_groups(bad)


def test_qwen3_next_profile_uses_the_544_token_hybrid_page() -> None:
    groups = LAYOUTS["qwen3-next-80b-a3b"].groups
    assert [g.block_size for g in groups] == [544, 544]


def test_json_output_has_the_documented_keys(tmp_path: Path) -> None:
    rows = [
        {"timestamp": i * 10, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, i + 2]}
        for i in range(4)
    ]
    path = write_trace(tmp_path / "t.jsonl", rows)
    out = replay_json(
        "--trace", str(path), "--model", "llama-3.1-8b", "--spec", "none", "--retention", "dense"
    )
    for key in (
        "queried_tokens",
        "cacheable_tokens",
        "hit_tokens",
        "hit_rate",
        "group_hit_tokens",
        "ideal_full_attention_hit_rate",
        "registered_blocks",
        "evicted_blocks",
    ):
        assert key in out
    assert out["queried_tokens"] == 6000
    assert out["hit_tokens"] == 3 * 1024  # every later request shares two 512-token blocks
    assert out["ideal_full_attention_hit_rate"] == pytest.approx(3 * 1024 / 6000, abs=1e-6)


def test_finite_pool_evicts_and_rejects_requests_that_cannot_fit(tmp_path: Path) -> None:
    rows = [
        {
            "timestamp": i,
            "input_length": 2048,
            "output_length": 8,
            "hash_ids": [4 * i + k for k in range(4)],
        }
        for i in range(6)
    ] + [
        {
            "timestamp": 99,
            "input_length": 9000,
            "output_length": 1,
            "hash_ids": list(range(100, 118)),
        }
    ]
    path = write_trace(tmp_path / "t.jsonl", rows)
    out = replay_json(
        "--trace",
        str(path),
        "--groups",
        "full:16",
        "--spec",
        "none",
        "--retention",
        "dense",
        "--num-blocks",
        "300",
        "--concurrency",
        "2",
    )
    assert out["evicted_blocks"] > 0
    assert out["rejected_requests"] == 1 and out["requests"] == 6


def test_default_run_prints_both_retentions_side_by_side() -> None:
    result = runner.invoke(app, ["cache-replay", "--limit", "300"])
    assert result.exit_code == 0, result.output
    assert "retention=boundary" in result.output and "predec" in result.output


def test_vllm_033_retention_already_recovers_what_the_pre_033_rule_loses_under_legacy_eagle() -> (
    None
):
    out = replay_json(
        "--model",
        "qwen3-next-80b-a3b",
        "--spec",
        "eagle-legacy",
        "--limit",
        "600",
        "--retention",
        "boundary-only,boundary,boundary+predecessor",
    )
    runs = out["runs"]
    assert isinstance(runs, list)
    pre_033, vllm_033, predecessor = (r["hit_rate"] for r in runs)
    # The pre-0.33 rule keeps no state where the dropped lookup lands: the common hit collapses.
    assert predecessor > 1.2 * pre_033
    # vLLM 0.33's replay_boundaries keeps it: predecessor retention adds next to nothing.
    assert predecessor >= vllm_033 > predecessor - 0.01


def test_conversation_trace_replay_reproduces_the_ideal_hit_rate() -> None:
    path = require_data("traces", "conversation_trace.jsonl")
    out = replay_json(
        "--trace",
        str(path),
        "--model",
        "llama-3.1-8b",
        "--spec",
        "none",
        "--num-blocks",
        "inf",
        "--retention",
        "boundary",
    )
    assert out["requests"] == 12_031
    assert out["hit_rate"] == pytest.approx(0.3736, abs=5e-5)
    assert out["ideal_full_attention_hit_rate"] == pytest.approx(0.3736, abs=5e-5)


def test_a_layout_without_a_mamba_group_replays_one_retention_column_by_default() -> None:
    result = CliRunner().invoke(
        app, ["cache-replay", "--groups", "full:16,swa:16:w=64", "--limit", "40", "--json"]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert "runs" not in payload and payload["retention"] == "boundary"
