"""A schedule for the suite's fixed rows that keeps prefill out of every decode's gaps, priced by
the suite's own cost model (docs/suite.md, "The p99 ITL test on the fixed rows").

The suite's `itl` test asks the shipped preset for p99 ITL within 5% of the tuned vLLM's while it
keeps vLLM's goodput. On the 8k-prompt rows no vLLM schedule does both: every step that carries
a prefill also carries the running decodes, so a gap is a prefill step (89 ms for vLLM's 8,192
tokens; the tuned 2,048-token budget keeps gaps near 58 ms and cannot keep up with the prompts).
This script asks whether any schedule could, on paper: cohorts of K requests whose prompts are
prefilled in full steps with no decode in them, all but each prompt's last token; one release
step in which every member's last prompt token runs (its first token); then the cohort's decode
steps with no prefill in them, until its answers end; then the next cohort. No member has a gap
that holds a prefill, so the cohort's decode step is every gap's length.

For each fixed row of the suite (`fixed:input=I,output=O,rate=R`) on the suite's deployment
(Qwen3-Next on one simulated H200, MTP): the smallest K whose cycle (prefill, release, decodes
at the simulator's mean tokens a step) fits within K arrivals' mean span K / R; its decode step
(the gap), the longest wait to a first token with evenly spaced arrivals (K / R + prefill +
release), the cycle's share of the span, and whether the pool holds the cohort; beside them the
p99 ITL and TTFT of vLLM's defaults, the tuned vLLM and the preset from a suite report. Poisson
arrivals vary a cohort's span, so a share near 1 leaves no room: this is a paper schedule, not
a simulated run. Prints one JSON object on its last line.

    python benchmarks/cohort_schedule.py [--report docs/suite_screen.json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hybridserve.metrics.slo import TTFT_SLO_S
from hybridserve.sim.cost_model import RequestShape, RooflineCostModel, StepShape
from hybridserve.sim.deployment import SimConfig, resolve_deployment
from hybridserve.sim.fixed_workload import FixedWorkload
from hybridserve.sim.memory import max_concurrency
from hybridserve.sim.run import pool_memory_account, simulated_cost_model
from hybridserve.sim.suite import BASELINE, TUNED, TUNED_LABEL, suite_configs, suite_rows

ROOT = Path(__file__).resolve().parents[1]
MAX_COHORT = 4_096
CONFIGS = (BASELINE, TUNED_LABEL, "hybridserve")


def tokens_per_step(config: SimConfig, model: RooflineCostModel) -> float:
    """The mean tokens a decode step delivers: 1 plus the accepted drafts (each draft position
    accepted with the acceptance rate until the first rejection)."""
    if not model.num_draft_passes:
        return 1.0
    p, k = config.acceptance_rate, config.num_speculative_tokens
    return sum(p**i for i in range(k + 1))


class Prefill:
    """Prompts prefilled first come first served in steps of `budget` tokens, each piece after
    what its prompt already computed: `add` one more prompt, `seconds` for all added so far."""

    def __init__(self, model: RooflineCostModel, prompt: int, budget: int) -> None:
        self.model, self.prompt, self.budget = model, prompt, budget
        self.closed_s, self.step, self.room = 0.0, list[RequestShape](), budget

    def add(self) -> None:
        done = 0
        while done < self.prompt:
            take = min(self.room, self.prompt - done)
            self.step.append(RequestShape(take, done, 1))
            done, self.room = done + take, self.room - take
            if self.room == 0:
                self.closed_s += self.model.step_cost(StepShape(tuple(self.step))).total_s
                self.step, self.room = [], self.budget

    def seconds(self) -> float:
        if not self.step:
            return self.closed_s
        return self.closed_s + self.model.step_cost(StepShape(tuple(self.step))).total_s


def cohorts(
    config: SimConfig, model: RooflineCostModel, row: FixedWorkload, budget: int, pool: int
) -> dict[str, Any]:
    """The cohorts (up to `pool` requests, the most the KV pool holds) whose cycle fits within
    their arrivals' mean span and whose longest wait to a first token is within the TTFT SLO:
    the smallest (`first`: the shortest gaps) and the one whose cycle takes the least of its
    span (`most_slack`); None when no cohort does."""
    assert row.rate_per_s is not None
    drafts = config.num_speculative_tokens if model.num_draft_passes else 0
    steps = (row.output_tokens - 1) / tokens_per_step(config, model)
    mid = row.input_tokens + row.output_tokens // 2
    prefill = Prefill(model, row.input_tokens - 1, budget)
    first: dict[str, Any] | None = None
    slack: dict[str, Any] | None = None
    least_share = float("inf")
    for k in range(1, min(pool, MAX_COHORT) + 1):
        prefill.add()
        release = model.step_cost(StepShape((RequestShape(1, row.input_tokens - 1, 1),) * k))
        gap = model.step_cost(StepShape((RequestShape(1 + drafts, mid, 1),) * k)).total_s
        pre = prefill.seconds() + release.total_s
        span = k / row.rate_per_s
        cycle = pre + steps * gap
        found = {
            "cohort": k,
            "decode_step_ms": round(1e3 * gap, 2),
            "cycle_share_of_span": round(cycle / span, 3),
            "longest_first_token_s": round(span + pre, 2),
        }
        if span + pre > TTFT_SLO_S:
            break  # a larger cohort waits longer still
        if cycle > span:
            continue
        first = first or found
        if cycle / span < least_share:
            slack, least_share = found, cycle / span
    return {"decode_steps": round(steps, 1), "first": first, "most_slack": slack}


def screen_metrics(report: dict[str, Any], row: str) -> dict[str, Any]:
    """The p99 ITL and TTFT of vLLM, the tuned vLLM and the preset on `row` of a suite report."""
    configs = report["rows"].get(row, {}).get("configs", {})
    return {
        name: {
            "itl_p99_ms": round(configs[name]["itl_p99_ms"], 1),
            "ttft_p99_s": round(configs[name]["ttft_p99_ms"] / 1e3, 1),
        }
        for name in CONFIGS
        if name in configs
    }


def _shown(path: Path) -> str:
    """`path` relative to the checkout when it lies in it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=ROOT / "docs" / "suite_screen.json")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"--report {args.report}: not a suite report ({err})") from None
    configs, _ = suite_configs(SimConfig(model="qwen3-next-80b-a3b", gpu="H200"), [], TUNED)
    config = configs[BASELINE]
    model = simulated_cost_model(config)
    deployment = resolve_deployment(config)
    budget = deployment.settings.scheduler.max_num_batched_tokens
    blocks = pool_memory_account(deployment).num_blocks
    rows = {}
    for suite_row in suite_rows():
        if not suite_row.workload.startswith("fixed:"):
            continue
        fixed = FixedWorkload.parse(suite_row.workload.removeprefix("fixed:"))
        pool = int(
            max_concurrency(
                blocks,
                deployment.model.kv_cache_groups(),
                fixed.input_tokens + fixed.output_tokens,
                max_num_batched_tokens=budget,
            )
        )
        cohort = {**cohorts(config, model, fixed, budget, pool), "pool_holds": pool}
        rows[suite_row.name] = {
            "workload": suite_row.workload,
            "cohort_schedule": cohort,
            "suite": screen_metrics(report, suite_row.name),
        }
    out = {
        "deployment": {"model": config.model, "gpu": config.gpu, "step_tokens": budget},
        "tokens_per_decode_step": round(tokens_per_step(config, model), 3),
        "report": _shown(args.report),
        "rows": rows,
    }
    for name, row in rows.items():
        c = row["cohort_schedule"]
        line = "no cohort keeps up within the TTFT SLO" if c["first"] is None else "; ".join(
            f"K={x['cohort']}, every gap {x['decode_step_ms']} ms, cycle "
            f"{x['cycle_share_of_span']} of its span, first token within "
            f"{x['longest_first_token_s']} s"
            for x in (c["first"], c["most_slack"])
        )  # fmt: skip
        itl = {k: v["itl_p99_ms"] for k, v in row["suite"].items()}
        print(f"{name}: {line}; suite p99 ITL ms {itl}", file=sys.stderr)
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
