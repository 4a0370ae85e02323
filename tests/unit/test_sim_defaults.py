"""Simulator defaults never give a wrong or empty number silently: the warm-up of a finite
workload, the speculative method of a model, rates of a trace that ended, over-long trace
requests, a queue that never drains, and the sim server's end of sequence."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.cli.sim_backend import PrintableTokens
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.metrics.recorder import MetricsRecorder
from hybridserve.server.tokenizer import BYTE_EOS_ID
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.run import simulate, simulated_engine
from hybridserve.sim.summary import QueueTrace
from hybridserve.sim.workload import AgentParams

FIXED = "fixed:input=1000,output=100,concurrency=8,requests=100"


def _cli_json(args: list[str]) -> dict[str, object]:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


def test_finite_workload_warmup_defaults_to_zero_so_its_latencies_are_measured() -> None:
    metrics = _cli_json(["simulate", "--workload", FIXED])
    assert metrics["requests_completed"] == 100
    assert all(metrics[k] is not None for k in ("ttft_p50_ms", "itl_p99_ms", "tpot_mean_ms"))


def test_a_window_without_a_finished_request_is_an_error_naming_the_fix() -> None:
    result = CliRunner().invoke(app, ["simulate", "--workload", FIXED, "--warmup", "300"])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "--warmup" in text and "no request finished" in text and "lower --warmup" in text


def test_negative_warmup_blames_the_warmup() -> None:
    with pytest.raises(ConfigError) as caught:
        SimConfig(warmup_s=-1.0)
    assert caught.value.field.startswith("warmup_s")
    result = CliRunner().invoke(app, ["bench", "--warmup", "-1"])
    assert result.exit_code == 2 and "warmup_s (--warmup)=-1.0" in result.output


@pytest.mark.parametrize(
    ("model", "method", "drafts"),
    [("llama-3.1-8b", "none", 0), ("qwen3-next-80b-a3b", "mtp", 2), ("deepseek-v3", "mtp", 2)],
)
def test_speculation_defaults_to_what_the_model_has(model: str, method: str, drafts: int) -> None:
    scheduler = simulated_engine(
        SimConfig(model=model, tp=8 if model == "deepseek-v3" else 1)
    ).scheduler
    assert scheduler.cache.layout.speculative.method.value == method
    assert scheduler.num_lookahead_tokens == drafts


def test_mtp_on_a_model_without_mtp_layers_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"llama-3\.1-8b has no MTP layers"):
        simulated_engine(SimConfig(model="llama-3.1-8b", speculation="mtp"))


def test_bench_names_the_model_and_method_it_simulated(tmp_path: Path) -> None:
    args = ["bench", "--model-config", str(Path("benchmarks/configs/llama-3.1-70b").resolve())]
    args += ["--agents", "1", "--duration", "40", "--warmup", "0", "--name", str(tmp_path / "b")]
    report = _cli_json(args)
    setup = report["setup"]
    assert isinstance(setup, dict)
    assert setup["model"] == "llama-3.1-70b" and setup["spec"] == "none"
    saved = json.loads((tmp_path / "b" / "report.json").read_text())
    assert saved["setup"]["model"] == "llama-3.1-70b"


def test_trace_rates_are_over_the_time_the_run_had_work() -> None:
    workload = "poisson:rate=4,requests=40,input=200,output=20"
    summary = simulate(SimConfig(model="llama-3.1-8b", workload=workload, warmup_s=0.0))
    assert summary["simulated_s"] < 60  # the requests ran out long before the 1,800 s duration
    output = summary["requests_completed"] * 20
    assert summary["output_tokens_per_s"] == pytest.approx(output / summary["simulated_s"])


def _trace(path: Path, lengths: list[int]) -> Path:
    with path.open("w") as fh:
        for i, n in enumerate(lengths):
            blocks = list(range(i * 1000, i * 1000 + -(-n // 512)))
            record = {"timestamp": i * 200, "input_length": n, "output_length": 8}
            fh.write(json.dumps({**record, "hash_ids": blocks}) + "\n")
    return path


def test_a_trace_request_over_max_model_len_is_rejected_and_counted_not_fatal(
    tmp_path: Path,
) -> None:
    trace = _trace(tmp_path / "t.jsonl", [1000, 5000, 1000, 1000])
    args = ["simulate", "--workload", f"mooncake:{trace}", "--model", "llama-3.1-8b"]
    result = CliRunner().invoke(app, [*args, "--max-model-len", "4096"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "1 requests were rejected" in text and "m1 (request 2 of the trace" in text
    assert "--max-model-len" in text
    assert "requests_rejected" in text
    kept = _cli_json([*args, "--max-model-len", "8192"])
    assert kept["requests_rejected"] == 0 and kept["requests_completed"] == 4
    dropped = _cli_json([*args, "--max-model-len", "4096"])
    assert dropped["requests_rejected"] == 1 and dropped["requests_completed"] == 3


def test_max_model_len_below_the_agents_context_is_refused() -> None:
    with pytest.raises(ConfigError, match="agents grow their contexts"):
        SimConfig(
            max_model_len=4096, agents=AgentParams(system_prompt_tokens=1000, context_limit=8192)
        )


def test_queue_trace_tells_a_growing_queue_from_a_steady_one() -> None:
    growing, steady = QueueTrace(0.0), QueueTrace(0.0)
    for t in range(100):
        growing.on_step(float(t), t)
        steady.on_step(float(t), 5 + t % 3)
    assert growing.summary(100.0)["never_drains"] == 1.0
    assert steady.summary(100.0)["never_drains"] == 0.0


def _recorded(arrivals: list[float], finishes: list[float]) -> MetricsRecorder:
    recorder = MetricsRecorder()
    for i, (arrival, finish) in enumerate(zip(arrivals, finishes, strict=True)):
        recorder.on_arrival(f"r{i}", arrival, 100)
        recorder.on_finish(f"r{i}", finish)
    return recorder


def test_a_queue_full_before_the_window_opened_never_drains_relative_to_its_arrival_rate() -> None:
    # 100 requests at 1/s; served at 0.5/s: the queue was as long in the first quarter as in
    # the last (it saturated early), so only the rates tell it from a steady run.
    arrivals = [float(t) for t in range(100)]
    slow, steady = QueueTrace(0.0), QueueTrace(0.0)
    for t in range(200):
        slow.on_step(float(t), 50)
        steady.on_step(float(t), 50)
    behind = slow.summary(200.0, _recorded(arrivals, [2.0 * t + 1 for t in range(100)]))
    assert behind["never_drains"] == 1.0
    assert behind["arrival_rate_per_s"] == pytest.approx(100 / 99)
    assert behind["service_rate_per_s"] == pytest.approx(50 / 99)
    # The same trace served as it arrives, with one slow request at the end: it drains.
    keeping_up = [t + 1.0 for t in arrivals[:-1]] + [150.0]
    assert steady.summary(200.0, _recorded(arrivals, keeping_up))["never_drains"] == 0.0


def test_an_overloaded_run_warns_that_it_never_drains() -> None:
    workload = "poisson:rate=40,requests=1200,input=4000,output=50"
    args = ["simulate", "--workload", workload, "--model", "llama-3.1-8b", "--gpu", "A100-80G"]
    args += ["--dtype", "bf16"]
    result = CliRunner().invoke(app, [*args, "--duration", "30"])
    assert result.exit_code == 0, result.output
    assert "never drains" in " ".join(result.output.split())


class _Constant:
    def execute(self, plan: StepPlan) -> StepResult:
        return StepResult(plan.step_id, {f"r{i}": (ord("a"),) for i in range(1000)}, 0.01, {})


def test_sim_backend_ends_answers_with_eos_at_the_configured_rate() -> None:
    plan = StepPlan(step_id=0, chunks=())
    never = PrintableTokens(_Constant(), eos_probability=0.0).execute(plan)
    assert all(ids == (ord("a"),) for ids in never.sampled_token_ids.values())
    ended = PrintableTokens(_Constant(), eos_probability=0.25, seed=3).execute(plan)
    share = sum(ids == (BYTE_EOS_ID,) for ids in ended.sampled_token_ids.values()) / 1000
    assert math.isclose(share, 0.25, abs_tol=0.05)
    again = PrintableTokens(_Constant(), eos_probability=0.25, seed=3).execute(plan)
    assert again.sampled_token_ids == ended.sampled_token_ids  # seeded
