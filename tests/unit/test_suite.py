"""The workload suite: rows picked by name or role, paired ratios from paired seeds, verdicts,
one bad row failing alone, and the same report from the same seeds."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app, suite_commands
from hybridserve.core.errors import ConfigError
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.suite import (
    BOUND,
    MODES,
    SuiteRow,
    count_runs,
    pick_rows,
    row_report,
    run_suite,
    suite_configs,
    suite_report,
    suite_rows,
    verdict,
)

TINY = SuiteRow(
    name="tiny",
    workload="fixed:input=512,output=8,rate=2",
    role="choose",
    what="a tiny open loop",
    duration_s=(20.0, 20.0),
    warmup_s=(5.0, 5.0),
)
BROKEN = replace(TINY, name="broken", role="report", workload="mooncake:/no/such/trace.jsonl")


def test_rows_are_picked_by_role_or_name_and_an_unknown_name_is_refused() -> None:
    rows = suite_rows()
    assert {r.role for r in rows} == {"choose", "report"}
    assert [r.name for r in pick_rows("choose")] == [r.name for r in rows if r.role == "choose"]
    assert len(pick_rows("all")) == len(rows)
    assert [r.name for r in pick_rows("agents-5,bursty")] == ["agents-5", "bursty"]
    with pytest.raises(ConfigError, match="nope"):
        pick_rows("agents-5,nope")


def test_the_suite_covers_every_named_workload_kind() -> None:
    names = {r.name for r in suite_rows()}
    for n in ("agents-5", "agents-20", "agents-40", "agents-80", "bursty", "agents+rag"):
        assert n in names
    for trace in ("mooncake", "azure-code", "azure-conv"):
        assert {f"{trace}-1x", f"{trace}-2x", f"{trace}-4x"} <= names
    assert sum(n.startswith("prefill-heavy") for n in names) == 3
    assert sum(n.startswith("decode-heavy") for n in names) == 3


@pytest.mark.parametrize("mode", MODES)
def test_every_row_builds_a_valid_configuration(mode: str) -> None:
    for row in suite_rows():
        config = row.config(SimConfig(), mode)  # type: ignore[arg-type]
        assert config.duration_s > config.warmup_s
        if row.agents is not None:
            assert config.agents.num_agents == row.agents


def _summary(goodput: float, itl: float) -> dict[str, float]:
    return {
        "slo_requests_per_s": goodput,
        "slo_jobs_per_hour": 0.0,
        "itl_p99_ms": itl,
        "ttft_p99_ms": 100.0,
        "output_tokens_per_s": 10.0 * goodput,
    }


def test_a_rows_ratio_is_computed_from_paired_seeds() -> None:
    results = {
        ("tiny", "vllm", 0): _summary(2.0, 50.0),
        ("tiny", "vllm", 1): _summary(4.0, 50.0),
        ("tiny", "vllm-tuned", 0): _summary(2.0, 40.0),
        ("tiny", "vllm-tuned", 1): _summary(2.0, 40.0),
        ("tiny", "ours", 0): _summary(4.0, 50.0),
        ("tiny", "ours", 1): _summary(4.0, 50.0),
    }
    row = row_report(TINY, ["vllm", "vllm-tuned", "ours"], [0, 1], results, ["ours"])
    ratio = row["ratios"]["ours"]["vllm"]["goodput"]
    # Paired: seed 0 gives 2x, seed 1 gives 1x (an unpaired ratio of means would be 4/3).
    assert ratio["per_seed"] == [2.0, 1.0]
    assert ratio["mean"] == pytest.approx(math.sqrt(2.0), abs=1e-4)
    assert row["ratios"]["ours"]["vllm-tuned"]["goodput"]["degenerate"] is True
    assert row["configs"]["ours"]["per_seed_goodput"] == [4.0, 4.0]
    v = row["verdict"]["ours"]
    assert v["goodput_holds"] and not v["itl_holds"]  # 50 ms against the tuned 40 ms
    assert not v["interval_holds"]  # two seeds: the t interval reaches below 0.95
    assert not v["holds"]


def _ratio(mean: float | None, ci: list[float] | None = None) -> dict[str, object]:
    return {"mean": mean, "ci95": ci}


def _ratios(good: dict[str, object], itl: float = 1.0) -> dict[str, object]:
    return {"goodput": good, "itl_p99": _ratio(itl)}


def test_a_baseline_at_zero_cannot_be_lost_to_but_ours_at_zero_loses() -> None:
    zero_both = {"vllm": {"goodput": 0.0}, "vllm-tuned": {"goodput": 0.0}}
    none = _ratios(_ratio(None))
    assert verdict({"vllm": none, "vllm-tuned": none}, zero_both)["holds"]
    theirs = {"vllm": {"goodput": 3.0}, "vllm-tuned": {"goodput": 0.0}}
    lost = verdict({"vllm": none, "vllm-tuned": none}, theirs)
    assert not lost["goodput_holds"] and "goodput 0 against vllm's 3" in lost["why_not"][0]


def test_a_row_that_holds_every_test_holds() -> None:
    good = _ratios(_ratio(1.2, [1.0, 1.4]), itl=1.02)
    configs = {"vllm": {"goodput": 1.0}, "vllm-tuned": {"goodput": 1.0}}
    assert verdict({"vllm": good, "vllm-tuned": good}, configs) == {
        "holds": True,
        "goodput_holds": True,
        "interval_holds": True,
        "itl_holds": True,
        "why_not": [],
    }


def _configs() -> dict[str, SimConfig]:
    configs, _ = suite_configs(SimConfig(), ["hybridserve"])
    return configs


def test_a_bad_row_fails_alone_and_is_named() -> None:
    configs = _configs()
    results, errors = run_suite([TINY, BROKEN], configs, [0, 1], mode="screen")
    assert set(errors) == {"broken"}
    assert "no/such/trace" in errors["broken"]
    assert {key[0] for key in results} == {"tiny"}
    report = suite_report(
        [TINY, BROKEN], configs, [0, 1], results, errors, mode="screen", search={}
    )
    assert "error" in report["rows"]["broken"]
    assert report["summary"]["hybridserve"]["failed_rows"] == ["broken"]
    assert report["rows"]["tiny"]["ratios"]["hybridserve"]["vllm"]["goodput"]["n"] == 2


def test_same_seeds_same_report_in_processes_or_not() -> None:
    configs = _configs()
    first = run_suite([TINY], configs, [0, 1], mode="screen")
    again = run_suite([TINY], configs, [0, 1], mode="screen", workers=2)
    # NaN (a statistic with no sample) is not equal to itself: compare the written form.
    assert _text(first) == _text(again)


def _text(outcome: object) -> str:
    results, errors = outcome  # type: ignore[misc]
    return json.dumps({"|".join(map(str, k)): v for k, v in results.items()}) + str(errors)


def test_the_suite_command_prints_one_json_object_last(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    name = f"test-suite-{tmp_path.name}"
    result = CliRunner().invoke(
        app,
        ["suite", "--rows", "azure-code-1x", "--scale", "0.1", "--name", name, "--json"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    row = report["rows"]["azure-code-1x"]
    assert set(row["configs"]) == {"vllm", "vllm-tuned", "hybridserve"}
    assert set(row["ratios"]["hybridserve"]["vllm"]["goodput"]) >= {"mean", "ci95", "per_seed"}
    assert report["suite"]["chosen_on"] == []
    assert "free-prefill" not in report["suite"]["configs"]  # no row here has a bound to run
    folder = Path("runs") / name
    assert (folder / "report.json").exists() and (folder / "suite.png").exists()
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()


def test_a_bounded_row_runs_the_bound_and_gives_each_configuration_its_share() -> None:
    configs = _configs()
    assert "free-prefill" in configs
    bounded = replace(TINY, name="bounded", bounded=True)
    results, errors = run_suite([TINY, bounded], configs, [0, 1], mode="screen")
    assert not errors
    assert {(row, label) for row, label, _ in results if label == "free-prefill"} == {
        ("bounded", "free-prefill")
    }  # the bound runs on bounded rows only
    report = suite_report(
        [TINY, bounded], configs, [0, 1], results, errors, mode="screen", search={}
    )
    row = report["rows"]["bounded"]
    bound = row["configs"]["free-prefill"]["goodput"]
    ours = row["configs"]["hybridserve"]
    assert bound > 0 and ours["share_of_bound"] == pytest.approx(ours["goodput"] / bound, abs=1e-4)
    assert "free-prefill" not in report["rows"]["tiny"]["configs"]
    assert list(report["summary"]) == ["hybridserve"]  # the bound is compared against, not judged
    assert set(row["ratios"]) == {"hybridserve"}
    assert count_runs([TINY, bounded], list(configs), [0, 1]) == len(results) == 14
    assert suite_commands.BOUND == BOUND  # the table names the bound the suite runs


def test_the_summary_counts_each_test_per_role_and_names_the_rows_that_do_not_hold() -> None:
    configs = _configs()
    results, errors = run_suite([TINY], configs, [0, 1], mode="screen")
    summary = suite_report([TINY], configs, [0, 1], results, errors, mode="screen", search={})[
        "summary"
    ]["hybridserve"]
    chosen = summary["choose"]
    assert chosen["rows"] == 1 and summary["report"]["rows"] == 0
    for test in ("goodput", "interval", "itl"):
        assert chosen[f"{test}_holds"] in (0, 1)
    assert chosen["holds"] == (1 if not chosen["loses"] else 0)


def test_the_suite_command_prints_its_table_and_what_each_preset_holds(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    name = f"test-suite-text-{tmp_path.name}"
    result = CliRunner().invoke(
        app, ["suite", "--rows", "azure-code-1x", "--scale", "0.1", "--name", name]
    )
    folder = Path("runs") / name
    for f in folder.iterdir() if folder.exists() else ():
        f.unlink()
    if folder.exists():
        folder.rmdir()
    assert result.exit_code == 0, result.output
    assert "azure-code-1x" in result.output
    assert "hybridserve never loses on" in result.output
    assert "rows only reported [goodput 1/1" in result.output


def test_the_suite_command_refuses_one_seed_and_an_unknown_row() -> None:
    one = CliRunner().invoke(app, ["suite", "--seeds", "1"])
    assert one.exit_code == 2 and "--seeds" in one.output
    bad = CliRunner().invoke(app, ["suite", "--rows", "nope"])
    assert bad.exit_code == 2 and "nope" in bad.output
