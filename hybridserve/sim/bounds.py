"""Upper bounds on E1's job goodput, each a switch on one simulated run (`--bound NAME`).

* `free-prefill`: prompt tokens cost nothing: every step is charged only for its decodes (and
  verifies), a step with no decode takes no time, and prompt tokens take no token budget (the
  budget is lifted past any step, `lifted_budget`; the pool stays the one the real budget's
  profile run leaves). The cache, the pool and every queue are unchanged, so this bounds what
  any prefill scheduling or caching can give short of a larger pool.
* `ideal-hits`: a prompt costs only the tokens no earlier request computed: the tokens of the
  job's previous turn (its prompt and answer, less the last sampled token) and, after the first
  request, the shared system prompt are free. This bounds what any prefix-cache retention can
  give (the cache still holds and evicts blocks as it does; only their recomputation is free,
  and under the lifted budget it takes no budget either).
* `infinite-engine`: the engine answers at once; a job takes its tool time only. Every agent's
  jobs are the same as in the real run (the workload's per-agent streams), walked without an
  engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepPlan
from hybridserve.metrics.recorder import MetricsRecorder
from hybridserve.sim.cost_model import RequestShape, StepShape
from hybridserve.sim.workload import AgentParams, AgentWorkload

BOUNDS = ("free-prefill", "ideal-hits", "infinite-engine")


def check_bound(name: str | None) -> None:
    """Raises ConfigError for a name that is not a bound."""
    if name is not None and name not in BOUNDS:
        raise ConfigError("bound", name, f"use one of {BOUNDS}")


def bounded_shape(
    plan: StepPlan, bound: str, ideal_prefix: Mapping[str, int], *, scheduler_cpu_s: float = 0.0
) -> StepShape:
    """The work of `plan` that `bound` still charges for."""
    requests: list[RequestShape] = []
    for chunk in plan.chunks:
        shape = RequestShape(
            len(chunk.token_ids), chunk.start, chunk.num_draft_tokens, chunk.sample
        )
        if shape.is_decode:
            requests.append(shape)
        elif bound == "ideal-hits":
            end = chunk.start + len(chunk.token_ids)
            start = max(chunk.start, min(ideal_prefix.get(chunk.req_id, 0), end))
            if end > start:
                requests.append(RequestShape(end - start, start, 0, chunk.sample))
        elif bound != "free-prefill":
            raise ConfigError("bound", bound, f"a step-cost bound is one of {BOUNDS[:2]}")
    return StepShape(tuple(requests), scheduler_cpu_s)


def lifted_budget(scheduler: SchedulerConfig, speculative: SpeculativeConfig) -> SchedulerConfig:
    """The scheduler of a step-cost bound: a token budget no step can fill (a whole prompt and
    every decode with its drafts) and no long-prefill threshold, so that the prompt tokens the
    bound makes free are never rationed by the budget; every other limit is the run's."""
    rows = scheduler.max_num_seqs * (1 + speculative.num_speculative_tokens)
    return replace(
        scheduler,
        max_num_batched_tokens=scheduler.max_model_len + rows,
        long_prefill_token_threshold=0,
    )


def infinite_engine_recorder(params: AgentParams, *, seed: int, until_s: float) -> MetricsRecorder:
    """E1 with an engine that answers at once: each agent's jobs back to back, a turn's answer
    the instant it is sent, the next turn a tool time later."""
    workload = AgentWorkload(params, seed=seed)
    recorder = MetricsRecorder()
    for agent in range(params.num_agents):
        now = 0.0
        while now < until_s:
            job = workload.new_job(agent)
            recorder.on_job_start(job.job_id, now)
            while now < until_s:
                turn = workload.next_turn(job)
                if turn is None:
                    break
                req_id = f"{turn.job_id}.t{turn.turn}"
                recorder.on_job_turn(turn.job_id)
                recorder.on_arrival(req_id, now, len(turn.prompt), turn.job_id)
                recorder.on_delivery(req_id, now, turn.max_tokens)
                recorder.on_finish(req_id, now)
                tool_s = workload.after_answer(job, [0] * turn.max_tokens)
                if workload.is_over(job):
                    break
                now += tool_s
            if now < until_s:
                recorder.on_job_finish(job.job_id, now)
            else:
                break
    return recorder
