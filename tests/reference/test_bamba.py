"""Mamba2 hybrids (Bamba; Granite 4 hybrid) under the TorchExecutor equal transformers.

The same checks as the Qwen3-Next reference tests: single request (tokens and logits within
1e-4, a prefill piece spanning several 16-token scan chunks), chunked prefill of a mixed batch,
prefix-cache resume from a state snapshot, preemption with recompute, n-gram speculation, and a
zeroed state carry that the comparisons must catch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch import cpu_kernels
from hybridserve.executor.torch.models.bamba import BambaForCausalLM
from hybridserve.executor.torch.models.granite_hybrid import GraniteMoeHybridForCausalLM
from tests.benchmark_module import load_benchmark
from tests.reference.helpers import make_checkpoint
from tests.reference.state_model_checks import VOCAB, StateModelChecks, check_single_request


def _bamba_config() -> Any:
    from transformers import BambaConfig

    return BambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        max_position_embeddings=1024,
        initializer_range=0.1,
        tie_word_embeddings=False,
        architectures=["BambaForCausalLM"],
    )


def _granite_config(num_experts: int) -> Any:
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        shared_intermediate_size=24,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        num_local_experts=num_experts,
        num_experts_per_tok=2,
        position_embedding_type="rope",
        embedding_multiplier=2.0,
        residual_multiplier=0.7,
        attention_multiplier=0.3,
        logits_scaling=2.0,
        max_position_embeddings=1024,
        initializer_range=0.1,
        tie_word_embeddings=False,
        architectures=["GraniteMoeHybridForCausalLM"],
    )


CONFIGS = {"bamba": _bamba_config, "granite_moe_hybrid": lambda: _granite_config(4)}


def _perturb(model: Any) -> None:
    """Non-trivial norms, skip and step biases, a slow state decay (a lost state shows), and
    larger embeddings (greedy outputs repeat, so n-gram drafts get accepted)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=gen).mul(0.45).add(0.05).log())
            elif "norm" in name or name.endswith(("dt_bias", ".D")):
                param.add_(torch.randn(param.shape, generator=gen) * 0.2)
        model.get_input_embeddings().weight.mul_(4.0)


def _saved(config: Any, folder: Any) -> Any:
    hf_model = make_checkpoint(config, folder)
    _perturb(hf_model)
    hf_model.save_pretrained(str(folder))
    return folder, hf_model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _saved(CONFIGS[request.param](), tmp_path_factory.mktemp(request.param))


def test_granite_hybrid_without_experts_matches_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    check_single_request(*_saved(_granite_config(0), tmp_path_factory.mktemp("granite_dense")))


def test_granite_4h_benchmark_layout_matches_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """benchmarks/hybrid_checkpoint.py's Granite 4.0-H layout (no positional embedding, one
    Mamba2 group, tied embeddings, micro's multipliers, its own init) at its tiny shape."""
    module = load_benchmark("hybrid_checkpoint")
    config = module.make_config("hybrid", module.SHAPES["tiny"])
    folder = tmp_path_factory.mktemp("granite_4h_layout")
    check_single_request(folder, make_checkpoint(config, folder))


class TestAgainstTransformers(StateModelChecks):
    """The shared state-model checks on Bamba and Granite 4 hybrid (the `checkpoint` fixture)."""


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"mamba_d_head": 12}, "config.mamba_d_head"),
        ({"mamba_n_groups": 3}, "config.mamba_n_groups"),
        ({"attn_layer_indices": [1, 9]}, "config.attn_layer_indices"),
        ({"time_step_limit": [0.0]}, "config.time_step_limit"),
    ],
)
def test_unsupported_bamba_config_values_name_the_field(change: dict[str, Any], field: str) -> None:
    config = _bamba_config().to_dict()
    with pytest.raises(ConfigError) as error:
        BambaForCausalLM({**config, **change})
    assert error.value.field == field


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layer_types": ["mamba", "conv", "mamba", "mamba"]}, "config.layer_types[1]"),
        ({"position_embedding_type": "alibi"}, "config.position_embedding_type"),
    ],
)
def test_unsupported_granite_config_values_name_the_field(
    change: dict[str, Any], field: str
) -> None:
    config = _granite_config(0).to_dict()
    with pytest.raises(ConfigError) as error:
        GraniteMoeHybridForCausalLM({**config, **change})
    assert error.value.field == field


def _step_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    import json

    module = load_benchmark("step_profile")
    folder = tmp_path / "bamba"
    if not folder.exists():
        make_checkpoint(_bamba_config(), folder)
    common = ["--model", str(folder), "--threads", "1", "--block-size", "16"]
    old_argv = sys.argv
    sys.argv = ["step_profile.py", *common, "--timed", "2", "--profiled", "1", *argv]
    try:
        module.main()
    finally:
        sys.argv = old_argv
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_step_profile_script_times_and_ranks_a_hybrids_decode_and_prefill_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    decode = _step_profile(tmp_path, capsys, "--requests", "3", "--prompt-tokens", "20")
    prefill = _step_profile(
        tmp_path, capsys, "--mode", "prefill", "--prompt-tokens", "40", "--num-blocks", "64"
    )
    if cpu_kernels.load() is not None:  # its decodes read their keys in place
        assert decode["gathered_keys_last_step"] == 0
    for report, requests in ((decode, 3), (prefill, 1)):
        assert report["requests"] == requests and report["step_ms_median"] > 0
        ops = report["top_ops"]
        assert ops and all(o["self_cpu_ms_per_step"] >= 0 for o in ops)
        shares = [o["share"] for o in ops]
        assert shares == sorted(shares, reverse=True) and sum(shares) <= 1.0001


def test_step_profile_refuses_a_pool_too_small_for_its_decode_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 3 requests of 20 + 23 tokens need 3 blocks of 16 in each of Bamba's cache groups: with 7
    # only one decodes at a time, and profiling that as a batch of 3 would report a batch of 1.
    with pytest.raises(SystemExit, match="--num-blocks 7: only 1 of --requests 3"):
        _step_profile(
            tmp_path, capsys, "--requests", "3", "--prompt-tokens", "20", "--num-blocks", "7"
        )


def test_a_hybrid_model_skips_the_warm_up(tmp_path: Path) -> None:
    from hybridserve.executor.torch import load_model
    from hybridserve.executor.torch.executor import TorchExecutor

    make_checkpoint(_bamba_config(), tmp_path)
    executor = TorchExecutor(load_model(tmp_path), num_blocks=32, block_size=4)
    assert executor.warm_up(64) == 0  # its state slots would need reserving
