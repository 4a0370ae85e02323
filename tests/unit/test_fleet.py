"""The simulated fleet: routers on hand-built states, the fleet loop's determinism, and its
one-replica equivalence with the single-engine simulator."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.core.config import SchedulerConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine, EngineStep
from hybridserve.engine.offline import run_to_completion
from hybridserve.engine.settings import DEFAULT_PRESET, PRESETS
from hybridserve.kvcache import CacheLayout, FullAttentionSpec, KVCacheManager, MambaSpec
from hybridserve.scheduler import Scheduler
from hybridserve.sim.deployment import FleetConfig, SimConfig
from hybridserve.sim.executor import SimulatedExecutor
from hybridserve.sim.fleet import FleetSimulation
from hybridserve.sim.fleet_report import imbalance
from hybridserve.sim.gpus import get_gpu
from hybridserve.sim.model_profiles import get_model
from hybridserve.sim.pd import Link, handoff_bytes, link_of, parse_pd
from hybridserve.sim.routers import (
    LOAD_WEIGHT,
    ApproximateView,
    PreciseView,
    Router,
    RouteRequest,
)
from hybridserve.sim.run import fleet_simulation, run_fleet, run_simulation
from hybridserve.sim.workload import AgentParams

BLOCK = 32


class _Load:
    """A view with no cache: only load-based routers ask it."""

    def fa_overlap(self, request: RouteRequest) -> int:
        return 0

    def hybrid_hit(self, request: RouteRequest) -> int:
        return 0

    def hit_and_junction(self, request: RouteRequest) -> tuple[int, int]:
        return 0, 0

    def on_routed(self, request: RouteRequest) -> None:
        pass


class _Fixed(_Load):
    def __init__(self, fa: int, hybrid: int) -> None:
        self.fa, self.hybrid = fa, hybrid

    def fa_overlap(self, request: RouteRequest) -> int:
        return self.fa

    def hybrid_hit(self, request: RouteRequest) -> int:
        return self.hybrid

    def hit_and_junction(self, request: RouteRequest) -> tuple[int, int]:
        return self.hybrid, max(self.hybrid, self.fa)


def _request(session: str | None = None, num_tokens: int = 100) -> RouteRequest:
    return RouteRequest("r", session, num_tokens, ())


def test_round_robin_takes_the_replicas_in_turn() -> None:
    router = Router("round-robin", [_Load(), _Load(), _Load()])
    chosen = []
    for _ in range(4):
        request = _request()
        replica = router.choose(request)
        router.routed(request, replica)
        chosen.append(replica)
    assert chosen == [0, 1, 2, 0]


def test_least_loaded_picks_the_fewest_outstanding_tokens() -> None:
    router = Router("least-loaded", [_Load(), _Load(), _Load()])
    router.outstanding[:] = [500, 120, 300]
    assert router.choose(_request()) == 1
    router.outstanding[:] = [100, 100, 300]
    assert router.choose(_request()) == 0  # ties go to the lowest index


def test_session_affinity_keeps_a_session_on_its_first_replica() -> None:
    router = Router("session", [_Load(), _Load()])
    router.outstanding[:] = [0, 10]
    first = _request("job-a")
    router.routed(first, router.choose(first))
    router.outstanding[:] = [1_000, 10]
    assert router.choose(_request("job-a")) == 0  # sticky despite the load
    assert router.choose(_request("job-b")) == 1  # a new session: least loaded


def test_prefix_routers_trade_overlap_against_the_weighted_load() -> None:
    views = [_Fixed(fa=1_500, hybrid=0), _Fixed(fa=1_000, hybrid=1_000)]
    fa = Router("prefix-fa", views, load_weight=1.0)
    hybrid = Router("prefix-hybrid", views, load_weight=1.0, junction_weight=0.5)
    assert fa.choose(_request()) == 0
    assert hybrid.choose(_request()) == 1  # 1,000 now beats 0.5 x 1,500 later
    assert hybrid.score(0, _request()) == 750.0
    longer = [_Fixed(fa=4_000, hybrid=0), _Fixed(fa=1_000, hybrid=1_000)]
    assert Router("prefix-hybrid", longer, junction_weight=0.5).choose(_request()) == 0
    assert Router("prefix-hybrid", longer, junction_weight=0.0).choose(_request()) == 1
    fa.outstanding[:] = [5_000, 0]  # 1500 - 5000 < 1000 - 0: the load wins
    assert fa.choose(_request()) == 1
    heavy = Router("prefix-fa", views, load_weight=0.0)
    heavy.outstanding[:] = [5_000, 0]
    assert heavy.choose(_request()) == 0  # weight 0: overlap alone


def test_the_default_load_weight_keeps_a_prefix_against_a_load_gap_longer_than_it() -> None:
    # A conversation's next turn: 6,000 tokens of prefix on replica 0, which has 20,000
    # outstanding tokens (mostly answers still to come) more than replica 1.
    views = [_Fixed(fa=6_000, hybrid=6_000), _Fixed(fa=0, hybrid=0)]
    assert FleetConfig().load_weight == LOAD_WEIGHT == 0.1
    for name in ("prefix-fa", "prefix-hybrid"):
        router = Router(name, views)
        router.outstanding[:] = [20_000, 0]
        assert router.choose(_request()) == 0  # the prefix stays together
        router.outstanding[:] = [70_000, 0]
        assert router.choose(_request()) == 1  # past ten tokens of load per token, the load wins
        at_one = Router(name, views, load_weight=1.0)
        at_one.outstanding[:] = [20_000, 0]
        assert at_one.choose(_request()) == 1  # one for one scatters the conversation


def _replica_cache() -> tuple[Engine, KVCacheManager]:
    groups = (FullAttentionSpec(block_size=BLOCK), MambaSpec(block_size=BLOCK))
    cache = KVCacheManager(CacheLayout(groups=groups, num_blocks=512))
    scheduler = Scheduler(SchedulerConfig(max_model_len=4_096), cache)
    executor = SimulatedExecutor(lambda plan: 0.01, seed=0)
    return Engine(scheduler, executor), cache


def _serve(engine: Engine, req_id: str, prompt: list[int]) -> None:
    request = Request(
        req_id=req_id,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=1, ignore_eos=True),
    )
    run_to_completion(engine, [request])


def test_prefix_fa_picks_a_replica_whose_mamba_group_cannot_serve_and_prefix_hybrid_does_not() -> (
    None
):
    shared = list(range(1_000, 1_000 + 20 * BLOCK))  # 640 tokens both replicas saw in part
    engine_a, cache_a = _replica_cache()
    engine_b, cache_b = _replica_cache()
    # A computed all 640 shared tokens (its state sits at their end); B only the first 384
    # plus a tail of its own, so B's state sits at 384.
    _serve(engine_a, "a", shared)
    _serve(engine_b, "b", [*shared[: 12 * BLOCK], *range(9_000, 9_016)])
    # The new request shares 512 tokens: A holds them in full attention but has no state at
    # 512 (nor anywhere before); B holds 384 with a state there.
    prompt = [*shared[: 16 * BLOCK], *range(20_000, 20_100)]
    hashes = cache_a.hasher.hash_tokens(prompt)
    request = RouteRequest("new", None, len(prompt), hashes)
    views = [PreciseView(cache_a), PreciseView(cache_b)]
    assert views[0].fa_overlap(request) == 16 * BLOCK
    assert views[1].fa_overlap(request) == 12 * BLOCK
    assert views[0].hybrid_hit(request) == 0
    assert views[1].hybrid_hit(request) == 12 * BLOCK
    assert Router("prefix-fa", views, load_weight=0.0).choose(request) == 0
    # 384 tokens now against a junction at 512 priced at 0.5: the hit wins.
    assert Router("prefix-hybrid", views, load_weight=0.0, junction_weight=0.5).choose(request) == 1
    # Querying the views changed neither cache: the same answer again.
    assert views[1].hybrid_hit(request) == 12 * BLOCK
    cache_a.check_invariants()
    cache_b.check_invariants()


def test_prefix_hybrid_places_a_shared_prefix_where_its_junction_state_will_be_kept() -> None:
    shared = list(range(1_000, 1_000 + 20 * BLOCK))
    engine_a, cache_a = _replica_cache()
    engine_b, cache_b = _replica_cache()
    # A computed all 640 shared tokens (its state sits at their end, none at 512); B computed
    # one shared block and a tail of its own, so B resumes the new request at 32 tokens now.
    _serve(engine_a, "a", shared)
    _serve(engine_b, "b", [*shared[:BLOCK], *range(9_000, 9_016)])
    prompt = [*shared[: 16 * BLOCK], *range(20_000, 20_100)]
    request = RouteRequest("new", None, len(prompt), cache_a.hasher.hash_tokens(prompt))
    views = [PreciseView(cache_a), PreciseView(cache_b)]
    assert views[0].hit_and_junction(request) == (0, 16 * BLOCK)
    assert views[1].hit_and_junction(request) == (BLOCK, BLOCK)
    # The reconciled hit alone takes B's 32 tokens; the junction A will keep is worth more.
    assert Router("prefix-hybrid", views, load_weight=0.0, junction_weight=0.0).choose(request) == 1
    assert Router("prefix-hybrid", views, load_weight=0.0).choose(request) == 0
    # Placed on A, the request keeps a state at the junction: the next request sharing the
    # prefix resumes there at once, where B could still give it only 32 tokens.
    _serve(engine_a, "new", prompt)
    follow = [*shared[: 16 * BLOCK], *range(40_000, 40_200)]
    after = RouteRequest("follow", None, len(follow), cache_a.hasher.hash_tokens(follow))
    assert views[0].hybrid_hit(after) == 16 * BLOCK
    assert views[1].hybrid_hit(after) == BLOCK
    cache_a.check_invariants()


def test_approximate_view_counts_routed_blocks_and_states_only_at_routed_prompt_ends() -> None:
    hasher_cache = _replica_cache()[1]
    shared = list(range(1_000, 1_000 + 20 * BLOCK))
    first = hasher_cache.hasher.hash_tokens(shared)
    view = ApproximateView(capacity=64, hash_block_size=BLOCK, state_grid=BLOCK, alignment=BLOCK)
    view.on_routed(RouteRequest("a", None, len(shared), first))
    prompt = [*shared[: 16 * BLOCK], *range(20_000, 20_100)]
    request = RouteRequest("n", None, len(prompt), hasher_cache.hasher.hash_tokens(prompt))
    assert view.fa_overlap(request) == 16 * BLOCK
    assert view.hybrid_hit(request) == 0  # the routed prompt's state is at 19 blocks, not 16
    longer = [*shared, *range(30_000, 30_040)]
    again = RouteRequest("m", None, len(longer), hasher_cache.hasher.hash_tokens(longer))
    assert view.hybrid_hit(again) == 19 * BLOCK  # floor((640 - 1) / 32) * 32 = 608
    small = ApproximateView(capacity=4, hash_block_size=BLOCK, state_grid=0, alignment=BLOCK)
    small.on_routed(RouteRequest("a", None, len(shared), first))
    assert small.fa_overlap(request) == 0  # the LRU kept only the last 4 blocks


def test_imbalance_is_max_over_mean() -> None:
    assert imbalance([100.0, 100.0]) == 1.0
    assert imbalance([300.0, 100.0]) == pytest.approx(1.5)
    assert imbalance([0.0, 0.0]) == 1.0


def test_fleet_config_names_a_bad_router_and_view() -> None:
    with pytest.raises(ConfigError, match="router"):
        FleetConfig(replicas=2, router="random")
    with pytest.raises(ConfigError, match="router_view"):
        FleetConfig(replicas=2, view="psychic")
    with pytest.raises(ConfigError, match="replicas"):
        FleetConfig(replicas=0)


SMALL = SimConfig(
    agents=AgentParams(num_agents=3), duration_s=60.0, warmup_s=10.0, preset="baseline"
)


@pytest.mark.parametrize("preset", PRESETS)
def test_one_replica_round_robin_reproduces_the_single_engine_summary(preset: str) -> None:
    config = replace(SMALL, preset=preset)
    single = run_simulation(config).summary
    fleet = run_fleet(config, FleetConfig(replicas=1, router="round-robin"))
    assert json.dumps(fleet.run.summary) == json.dumps(single)
    assert fleet.fleet["imbalance"] == 1.0
    assert fleet.fleet["hit_rate"] == pytest.approx(single["prefix_hit_rate"])


def test_a_fleet_under_the_default_preset_pins_its_sessions() -> None:
    fleet = run_fleet(replace(SMALL, preset=DEFAULT_PRESET), FleetConfig(replicas=2))
    assert fleet.run.summary["kv_pins_pinned"] > 0


def test_a_fleet_spreads_agents_over_its_replicas_and_repeats_on_a_seed() -> None:
    first = run_fleet(SMALL, FleetConfig(replicas=2, router="least-loaded"))
    again = run_fleet(SMALL, FleetConfig(replicas=2, router="least-loaded"))
    assert json.dumps(first.fleet) == json.dumps(again.fleet)
    assert json.dumps(first.run.summary) == json.dumps(again.run.summary)
    served = [row["requests_completed"] for row in first.fleet["per_replica"]]
    assert all(count > 0 for count in served)
    assert first.fleet["hit_rate"] <= first.fleet["global_ideal_hit_rate"] + 1e-12


runner = CliRunner()
CLI = ["simulate", "--agents", "3", "--duration", "60", "--warmup", "10", "--preset", "baseline"]


def _last_line(args: list[str]) -> str:
    result = runner.invoke(app, [*CLI, *args, "--json"])
    assert result.exit_code == 0, result.output
    return result.stdout.strip().splitlines()[-1]


def test_cli_one_replica_round_robin_prints_the_single_engine_json_plus_fleet() -> None:
    single = _last_line([])
    fleet_line = _last_line(["--replicas", "1", "--router", "round-robin"])
    payload = json.loads(fleet_line)
    fleet = payload.pop("fleet")
    assert json.dumps(payload) == single  # byte for byte, less the fleet report
    assert set(fleet) >= {"replicas", "router", "hit_rate", "global_ideal_hit_rate", "imbalance"}
    assert fleet["replicas"] == 1 and len(fleet["per_replica"]) == 1


def test_cli_same_seed_same_fleet_report_other_seed_another() -> None:
    args = ["--replicas", "2", "--router", "prefix-hybrid", "--router-view", "approximate"]
    first = _last_line(args)
    assert first == _last_line(args)
    assert first != _last_line([*args, "--seed", "1"])
    assert json.loads(first)["fleet"]["router"] == "prefix-hybrid"


def test_cli_names_a_bad_router() -> None:
    result = runner.invoke(app, [*CLI, "--replicas", "2", "--router", "random", "--json"])
    assert result.exit_code == 2
    assert "router (--router)='random' is invalid" in result.output


def test_cli_router_options_without_replicas_are_refused() -> None:
    result = runner.invoke(app, [*CLI, "--router", "prefix-fa", "--json"])
    assert result.exit_code == 2
    assert "add --replicas N" in result.output


# ----- prefill/decode disaggregation ------------------------------------------------------------


def test_transfer_time_is_the_latency_plus_the_bytes_over_the_link() -> None:
    link = Link("test", 50e9, 30e-6)
    assert link.transfer_s(1e9) == pytest.approx(30e-6 + 0.02)
    assert link.transfer_s(0) == 0.0  # nothing to move: no handoff cost
    h200 = get_gpu("H200")
    assert link_of("nvlink", h200).bytes_per_s == h200.link_bytes_per_s
    assert link_of("ib-ndr", h200).bytes_per_s == 50e9  # NDR 400 Gb/s
    with pytest.raises(ConfigError, match="pd_link"):
        link_of("carrier-pigeon", h200)


def test_handoff_bytes_follow_the_cache_layout() -> None:
    llama = get_model("llama-3.1-8b")
    # 32 layers x K and V x 8 KV heads x 128 dims x 2 bytes (bf16) per token; no state.
    assert handoff_bytes(llama, moved_tokens=1_000) == 1_000 * 32 * 2 * 8 * 128 * 2
    assert handoff_bytes(llama, moved_tokens=1_000, tp=2) == 1_000 * 32 * 2 * 4 * 128 * 2
    assert handoff_bytes(llama, moved_tokens=0) == 0.0
    qwen = get_model("qwen3-next-80b-a3b")
    state = qwen.state_bytes_per_sequence()
    assert state > 0
    assert handoff_bytes(qwen, moved_tokens=0) == state  # the state moves whatever is resident
    (full,) = [g for g in qwen.cache_groups() if isinstance(g, FullAttentionSpec)]
    per_token = qwen.kv_bytes_per_token(full)
    assert handoff_bytes(qwen, moved_tokens=12_000) == pytest.approx(12_000 * per_token + state)


def test_pd_spec_is_parsed_and_a_bad_one_named() -> None:
    assert parse_pd("3:5") == (3, 5)
    for bad in ("3", "0:2", "a:b", "2:-1"):
        with pytest.raises(ConfigError, match="pd"):
            parse_pd(bad)
    with pytest.raises(ConfigError, match="replicas"):
        FleetConfig(replicas=3, pd=(1, 1))


PD = FleetConfig(replicas=2, pd=(1, 1))


def _first_gaps(
    link: Link | None, admitted: list[int] | None = None
) -> tuple[list[float], FleetSimulation]:
    """Run SMALL on 1:1; `admitted` collects the tokens the decode replica scheduled for each
    handoff in the step that admitted it."""
    sim = fleet_simulation(SMALL, PD)
    if link is not None:
        sim.link = link
    if admitted is not None:
        engine = sim.replicas[1].engine
        step = engine.step

        def recording_step(now: float = 0.0) -> EngineStep:
            result = step(now)
            scheduled = dict(result.scheduled.num_scheduled_tokens)
            admitted.extend(scheduled[r] for r, _ in result.scheduled.new_reqs)
            return result

        engine.step = recording_step  # type: ignore[method-assign]
    recorder = sim.run(SMALL.duration_s)
    gaps = [r.gaps_s[0] for r in recorder.requests.values() if r.gaps_s]
    return gaps, sim


def test_disaggregated_requests_prefill_on_one_replica_and_decode_on_the_other() -> None:
    admitted: list[int] = []
    gaps, sim = _first_gaps(None, admitted)
    assert gaps and sim.transfer_s
    decoded = set(sim.decode_of)
    assert decoded and all(sim.replica_of[r] == 0 for r in decoded)
    assert set(sim.decode_of.values()) == {1}
    # The received prompt is computed at once (vLLM's KV connector): each handoff's admission
    # schedules one token (its first answer token), padded to a decode's 1 + K rows under MTP.
    lookahead = sim.replicas[1].scheduler.num_lookahead_tokens
    assert len(admitted) == len(decoded)
    assert set(admitted) == {1 + lookahead}
    assert sim.replicas[1].steps > sim.replicas[0].steps  # it runs the decodes


def test_disaggregated_steps_can_add_the_measured_scheduler_cpu() -> None:
    """The decode replica's steps are costed as any replica's (nothing received is charged),
    so --include-scheduler-cpu applies to a P/D fleet too."""
    config = replace(SMALL, include_scheduler_cpu=True)
    recorder = fleet_simulation(config, PD, cpu_clock=time.perf_counter).run(config.duration_s)
    assert any(r.gaps_s for r in recorder.requests.values())


def test_a_slower_link_delays_the_second_token_by_the_transfer() -> None:
    fast, _ = _first_gaps(None)
    slow_link = Link("slow", 1e9, 0.05)  # 1 GB/s and 50 ms a handoff
    slow, sim = _first_gaps(slow_link)
    assert min(sim.transfer_s) >= 0.05
    assert sum(slow) / len(slow) > sum(fast) / len(fast) + 0.05


def test_cli_pd_prints_the_handoffs_and_refuses_a_mismatched_replica_count() -> None:
    payload = json.loads(_last_line(["--pd", "1:1", "--pd-link", "ib-ndr"]))
    pd = payload["fleet"]["pd"]
    assert pd["prefill"] == 1 and pd["decode"] == 1 and pd["link"] == "ib-ndr"
    assert pd["handoffs"] > 0 and payload["fleet"]["gpus"] == 2
    result = runner.invoke(app, [*CLI, "--pd", "1:1", "--replicas", "3", "--json"])
    assert result.exit_code == 2
    assert "--pd 1:1 needs 2 replicas" in result.output


# ----- the fleet options of bench and sweep ----------------------------------------------------


def test_a_config_with_a_fleet_runs_on_the_fleet_and_refuses_a_bound() -> None:
    fleet = FleetConfig(replicas=2, router="session")
    run = run_simulation(replace(SMALL, fleet=fleet))
    direct = run_fleet(SMALL, fleet)
    assert run.fleet is not None and run.fleet["replicas"] == 2
    assert json.dumps(run.fleet) == json.dumps(direct.fleet)
    assert json.dumps(run.summary) == json.dumps(direct.run.summary)
    with pytest.raises(ConfigError, match="bounds are single-engine"):
        replace(SMALL, fleet=fleet, bound="free-prefill")


BENCH = ["bench", "--agents", "2", "--seeds", "1", "--duration", "40", "--warmup", "5"]
BENCH += ["--workers", "1", "--json"]


def _bench(args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.chdir(tmp_path)  # bench writes runs/NAME/ under the working directory
    result = runner.invoke(app, [*BENCH, "--name", "fleet", *args])
    assert result.exit_code == 0, result.output
    payload: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return payload


def test_bench_runs_every_configuration_on_the_fleet_and_reports_its_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = _bench(["--replicas", "2", "--router", "session"], tmp_path, monkeypatch)
    fleet = report["fleet"]
    assert (fleet["replicas"], fleet["gpus"], fleet["router"]) == (2, 2, "session")
    assert fleet["pd"] is None
    assert set(fleet["configurations"]) == {"baseline", "hybridserve"}
    for block in fleet["configurations"].values():
        (seed_report,) = block["per_seed"]
        assert len(seed_report["per_replica"]) == 2
        assert block["hit_rate"] == seed_report["hit_rate"]
        assert block["global_ideal_hit_rate"] >= block["hit_rate"]
    assert report["bounds"] == {}  # bounds are single-engine: not run on a fleet
    written = json.loads((tmp_path / "runs" / "fleet" / "report.json").read_text())
    assert written["fleet"] == fleet


def test_bench_pd_disaggregates_every_configuration_and_refuses_bounds_with_a_fleet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = _bench(["--pd", "1:1", "--pd-link", "ib-ndr"], tmp_path, monkeypatch)
    assert report["fleet"]["pd"] == {"prefill": 1, "decode": 1, "link": "ib-ndr"}
    roles = [
        r["role"]
        for r in report["fleet"]["configurations"]["hybridserve"]["per_seed"][0]["per_replica"]
    ]
    assert roles == ["prefill", "decode"]
    result = runner.invoke(app, [*BENCH, "--replicas", "2", "--bounds"])
    assert result.exit_code == 2
    assert "--bounds" in result.output and "single-engine" in result.output
    result = runner.invoke(app, [*BENCH, "--router", "prefix-fa"])
    assert result.exit_code == 2 and "add --replicas N" in result.output


def test_sweep_runs_every_trial_on_the_fleet() -> None:
    args = ["sweep", "--trials", "1", "--agents", "2", "--duration", "40", "--warmup", "5"]
    args += ["--workers", "1"]
    result = runner.invoke(app, [*args, "--replicas", "2", "--router", "least-loaded", "--json"])
    assert result.exit_code == 0, result.output
    trials = json.loads(result.stdout.strip().splitlines()[-1])["trials"]
    assert len(trials) == 2
    for trial in trials:
        assert trial["fleet"]["replicas"] == 2 and trial["fleet"]["router"] == "least-loaded"
        assert len(trial["fleet"]["per_replica"]) == 2
    plain = runner.invoke(app, [*args, "--json"])
    assert all(
        "fleet" not in t for t in json.loads(plain.stdout.strip().splitlines()[-1])["trials"]
    )
