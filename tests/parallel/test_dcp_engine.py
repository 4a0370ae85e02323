"""`--dcp N` end to end: the Engine on rank 0 drives N TorchExecutor ranks over gloo on CPU.

Tiny models give the same greedy tokens at DCP 1, 2 and 4, including a request that resumes
from a cached prefix whose length is a multiple of `block_size * N`, chunked prefill and a
decode batch that mixes requests: a full-attention Llama (DCP 1 also matches transformers), a
hybrid Bamba (Mamba2 state replicated on every rank, attention sharded) and a sparse-MLA
DeepSeek-V3.2 (latent KV and indexer keys sharded, query heads split and all-gathered for every
row, the indexer's top-k chosen across ranks).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine.settings import SettingsSources
from hybridserve.offline.runtime import DcpJob, DcpOutcome, run_dcp_job
from hybridserve.parallel import DcpGroup
from hybridserve.parallel.launch import find_free_port, run_ranks
from tests.parallel import dcp_workers as w
from tests.reference.helpers import make_checkpoint, transformers_greedy

BLOCK_SIZE = 4
SHARED = 37  # tokens request b shares with request a
MAX_TOKENS = 6
TIMEOUT_S = 180


def _prompts() -> dict[str, tuple[int, ...]]:
    rng = random.Random(7)
    a = tuple(rng.randrange(3, 90) for _ in range(40))
    return {
        "a": a,
        "b": a[:SHARED] + tuple(rng.randrange(3, 90) for _ in range(5)),
        "c": tuple(rng.randrange(3, 90) for _ in range(11)),
    }


def _job(model_path: Path) -> DcpJob:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()

    def request(name: str) -> Request:
        return Request(req_id=name, prompt_token_ids=prompts[name], sampling=params)

    # b and c arrive after a finished: b resumes from a's cached prefix while c prefills, and
    # both then decode in one batch. A budget of 16 tokens splits every prefill into chunks.
    return DcpJob(
        model_path=str(model_path),
        waves=((request("a"),), (request("b"), request("c"))),
        num_blocks=64,
        block_size=BLOCK_SIZE,
        # b's hit on a hybrid model needs a's predecessor state kept (the presets keep
        # vLLM's boundary only).
        settings=SettingsSources(
            flags=(("max_num_batched_tokens", 16),), retention="boundary+predecessor"
        ),
    )


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    make_checkpoint(config, folder, seed=3)
    return folder


@pytest.fixture(scope="module")
def bamba_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.reference.test_bamba import VOCAB, _bamba_config

    assert max(max(p) for p in _prompts().values()) < VOCAB
    folder = tmp_path_factory.mktemp("tiny-bamba")
    make_checkpoint(_bamba_config(), folder, seed=5)
    return folder


@pytest.fixture(scope="module")
def sparse_mla_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3.2: MLA with the DSA indexer keeping the top 8 keys per query (prompts are up
    to 42 tokens, so selection matters), MoE after the first layer, yarn RoPE."""
    from tests.reference.test_deepseek import INDEX_TOPK, _build

    assert INDEX_TOPK < SHARED
    folder = tmp_path_factory.mktemp("tiny-deepseek-v32")
    _build("v32", folder)
    return folder


MODELS = ("llama", "bamba", "sparse_mla")


@pytest.fixture(scope="module")
def all_outcomes(
    llama_path: Path, bamba_path: Path, sparse_mla_path: Path
) -> dict[int, dict[str, DcpOutcome]]:
    """outcomes[width][model], every model run on one group per width."""
    jobs = {
        "llama": _job(llama_path),
        "bamba": _job(bamba_path),
        "sparse_mla": _job(sparse_mla_path),
    }
    results = {1: w.run_engine_jobs(DcpGroup(), jobs)}
    for width in (2, 4):
        per_rank = run_ranks(w.run_engine_jobs, width, jobs, timeout_s=TIMEOUT_S)
        assert all(set(r.values()) == {None} for r in per_rank[1:])  # only rank 0 schedules
        results[width] = per_rank[0]
    return results  # type: ignore[return-value]


@pytest.fixture(scope="module")
def outcomes(all_outcomes: dict[int, dict[str, DcpOutcome]]) -> dict[int, DcpOutcome]:
    return {width: by_model["llama"] for width, by_model in all_outcomes.items()}


def test_dcp_1_matches_transformers_greedy(llama_path: Path, outcomes: dict[int, DcpOutcome]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_path)).eval()
    for name, prompt in _prompts().items():
        expected, _ = transformers_greedy(model, prompt, MAX_TOKENS)
        assert outcomes[1].tokens[name] == expected, name


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("width", [2, 4])
def test_greedy_tokens_are_identical_at_every_dcp_width(
    all_outcomes: dict[int, dict[str, DcpOutcome]], width: int, model: str
) -> None:
    assert all_outcomes[width][model].tokens == all_outcomes[1][model].tokens
    assert all(len(t) == MAX_TOKENS for t in all_outcomes[width][model].tokens.values())


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("width", [1, 2, 4])
def test_the_prefix_hit_is_a_whole_number_of_sharded_blocks(
    all_outcomes: dict[int, dict[str, DcpOutcome]], width: int, model: str
) -> None:
    unit = BLOCK_SIZE * width  # one block id covers block_size tokens on each of N ranks
    hit = all_outcomes[width][model].hit_tokens["b"]
    assert hit == SHARED // unit * unit
    assert hit > 0 and hit % unit == 0
    assert all_outcomes[width][model].hit_tokens["c"] == 0


def _cli_outputs(stdout: str) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "ids.jsonl"
    path.write_text("".join(json.dumps(list(p)) + "\n" for p in _prompts().values()))
    return path


def test_generate_cli_gives_the_same_tokens_with_dcp_2(llama_path: Path, token_file: Path):
    from typer.testing import CliRunner

    from hybridserve.cli import app

    args = ["generate", "--model", str(llama_path), "--token-ids", str(token_file)]
    args += ["--max-tokens", "5", "--block-size", "4", "--json", "--device", "cpu"]
    runner = CliRunner()
    single = runner.invoke(app, args)
    assert single.exit_code == 0, single.output
    sharded = runner.invoke(app, [*args, "--dcp", "2"])
    assert sharded.exit_code == 0, sharded.output
    assert _cli_outputs(sharded.stdout) == _cli_outputs(single.stdout)
    assert len(_cli_outputs(single.stdout)) == 3


def test_generate_cli_joins_a_torchrun_group(llama_path: Path, token_file: Path):
    args = ["generate", "--model", str(llama_path), "--token-ids", str(token_file)]
    args += ["--max-tokens", "5", "--block-size", "4", "--json", "--device", "cpu"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launcher += ["--master-port", str(find_free_port()), "-m", "hybridserve.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*launcher, *args, "--dcp", "2"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    reference = _job(llama_path)  # the same prompts, greedy: compare with the DCP-1 engine
    single = run_dcp_job(
        DcpGroup(), replace(reference, waves=(reference.waves[0] + reference.waves[1],))
    )
    assert single is not None
    expected = [single.tokens[name][:5] for name in ("a", "b", "c")]
    assert _cli_outputs(done.stdout) == expected  # printed once, by rank 0


def test_generate_under_torchrun_refuses_a_world_size_other_than_dcp(
    llama_path: Path, token_file: Path
):
    args = ["generate", "--model", str(llama_path), "--token-ids", str(token_file), "--dcp", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0"}
    env |= {"WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}
    done = subprocess.run(
        [sys.executable, "-m", "hybridserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--dcp=2 is invalid: torchrun started WORLD_SIZE=1" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_rank_that_cannot_start_stops_every_rank_with_its_reason() -> None:
    started = time.monotonic()
    reports = run_ranks(w.report_ready, 2, 1, timeout_s=TIMEOUT_S)
    assert reports == ["DCP ranks could not start: rank 1: could not load the model"] * 2
    assert time.monotonic() - started < 60  # answered at once, not at the group's timeout
    assert run_ranks(w.report_ready, 2, -1, timeout_s=TIMEOUT_S) == ["started", "started"]


def test_a_bad_model_path_fails_the_dcp_job_with_a_clear_error(tmp_path: Path) -> None:
    job = DcpJob(model_path=str(tmp_path / "missing"), waves=(), num_blocks=8)
    with pytest.raises(RuntimeError, match="does not exist"):
        run_ranks(run_dcp_job, 2, job, timeout_s=TIMEOUT_S)


def test_an_interleave_of_two_tokens_gives_the_same_tokens(
    llama_path: Path, outcomes: dict[int, DcpOutcome]
) -> None:
    per_rank = run_ranks(run_dcp_job, 2, _job(llama_path), interleave=2, timeout_s=TIMEOUT_S)
    assert per_rank[0].tokens == outcomes[1].tokens
    assert per_rank[0].hit_tokens["b"] == 32
