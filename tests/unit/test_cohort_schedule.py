"""benchmarks/cohort_schedule.py: a schedule for the suite's fixed rows that keeps prefill out of
every decode's gaps, priced by the suite's cost model."""

from __future__ import annotations

import json
from types import ModuleType

import pytest

from hybridserve.sim.cost_model import RequestShape, StepShape
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.fixed_workload import FixedWorkload
from hybridserve.sim.run import simulated_cost_model
from hybridserve.sim.suite import TUNED, suite_configs
from tests.benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def cs() -> ModuleType:
    return load_benchmark("cohort_schedule")


@pytest.fixture(scope="module")
def vllm() -> SimConfig:
    configs, _ = suite_configs(SimConfig(model="qwen3-next-80b-a3b", gpu="H200"), [], TUNED)
    return configs["vllm"]


def test_prompts_are_packed_first_come_first_served_into_full_steps(
    cs: ModuleType, vllm: SimConfig
) -> None:
    model = simulated_cost_model(vllm)
    prefill = cs.Prefill(model, 8_191, 8_192)
    prefill.add()
    prefill.add()
    steps = [
        (RequestShape(8_191, 0, 1), RequestShape(1, 0, 1)),
        (RequestShape(8_190, 1, 1),),
    ]
    assert prefill.seconds() == pytest.approx(
        sum(model.step_cost(StepShape(s)).total_s for s in steps)
    )


def test_a_decode_step_delivers_the_accepted_drafts_and_the_bonus_token(
    cs: ModuleType, vllm: SimConfig
) -> None:
    model = simulated_cost_model(vllm)
    assert (vllm.num_speculative_tokens, vllm.acceptance_rate) == (2, 0.7)
    assert cs.tokens_per_step(vllm, model) == pytest.approx(1 + 0.7 + 0.49)


def test_cohorts_keep_up_within_the_slo_below_saturation_and_none_past_it(
    cs: ModuleType, vllm: SimConfig
) -> None:
    model = simulated_cost_model(vllm)
    prefill_step = model.step_cost(StepShape((RequestShape(8_192, 0, 1),))).total_s
    below = cs.cohorts(vllm, model, FixedWorkload.parse("input=8192,output=64,rate=4"), 8_192, 185)
    first, slack = below["first"], below["most_slack"]
    assert first["cohort"] < slack["cohort"] <= 185
    for cohort in (first, slack):
        assert cohort["cycle_share_of_span"] <= 1.0
        assert cohort["longest_first_token_s"] <= 15.0
        assert cohort["decode_step_ms"] < 1e3 * prefill_step  # no gap holds a prefill
    assert slack["cycle_share_of_span"] < first["cycle_share_of_span"]
    past = cs.cohorts(vllm, model, FixedWorkload.parse("input=8192,output=64,rate=12"), 8_192, 185)
    assert past["first"] is None and past["most_slack"] is None
    # A pool that holds one request leaves only cohorts of one.
    tiny = cs.cohorts(vllm, model, FixedWorkload.parse("input=8192,output=64,rate=1"), 8_192, 1)
    assert tiny["first"]["cohort"] == 1


def test_every_fixed_row_of_the_suite_is_in_the_json_line(
    cs: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    cs.main([])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["rows"]) == {
        "prefill-heavy-4", "prefill-heavy-8", "prefill-heavy-12",
        "decode-heavy-3", "decode-heavy-6", "decode-heavy-10",
    }  # fmt: skip
    assert out["rows"]["prefill-heavy-8"]["suite"]["vllm-tuned"]["itl_p99_ms"] > 0
    with pytest.raises(SystemExit, match="--report"):
        cs.main(["--report", "no-such-report.json"])
