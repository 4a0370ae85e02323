"""`hybridserve generate` on a tiny checkpoint: JSON output, speculation, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app
from tests.reference.helpers import make_checkpoint, transformers_greedy


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("cli-llama")
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        eos_token_id=None,
        architectures=["LlamaForCausalLM"],
    )
    return folder, make_checkpoint(config, folder)


def test_generate_token_ids_json_matches_transformers(
    tiny_llama: tuple[Path, object], tmp_path: Path
) -> None:
    folder, reference = tiny_llama
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 10, 11, 12, 10]]
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    for drafting in ([], ["--spec", "ngram:3"]):
        result = CliRunner().invoke(
            app,
            ["generate", "--model", str(folder), "--token-ids", str(source), "--max-tokens",
             "6", "--json", "--device", "cpu", *drafting],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        for record, prompt in zip(records, prompts, strict=True):
            want, _ = transformers_greedy(reference, prompt, 6)
            assert record["token_ids"] == want


def test_generate_names_a_missing_model_path(tmp_path: Path) -> None:
    source = tmp_path / "p.jsonl"
    source.write_text("[1, 2, 3]\n")
    result = CliRunner().invoke(
        app, ["generate", "--model", str(tmp_path / "nope"), "--token-ids", str(source)]
    )
    assert result.exit_code == 2
    assert "--model" in result.output and "no such file or folder" in result.output


def test_generate_rejects_malformed_token_ids(
    tiny_llama: tuple[Path, object], tmp_path: Path
) -> None:
    source = tmp_path / "p.jsonl"
    source.write_text('{"ids": [1]}\n')
    result = CliRunner().invoke(
        app, ["generate", "--model", str(tiny_llama[0]), "--token-ids", str(source)]
    )
    assert result.exit_code == 2
    assert "p.jsonl:1" in result.output


def test_generate_refuses_a_token_id_outside_the_vocabulary(
    tiny_llama: tuple[Path, object], tmp_path: Path
) -> None:
    folder, _ = tiny_llama
    source = tmp_path / "oov.jsonl"
    source.write_text("[5, 6]\n[7, 64, 8]\n")
    for extra in ([], ["--dcp", "2"]):  # refused before any rank starts, too
        args = ["generate", "--model", str(folder), "--token-ids", str(source), *extra]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())
        assert "prompt 2 has token id 64" in text and "[0, 64)" in text


def test_generate_refuses_a_zero_block_size(
    tiny_llama: tuple[Path, object], tmp_path: Path
) -> None:
    folder, _ = tiny_llama
    source = tmp_path / "p.jsonl"
    source.write_text("[5, 6]\n")
    args = ["generate", "--model", str(folder), "--token-ids", str(source), "--block-size", "0"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "--block-size=0 is invalid" in result.output


def test_generate_resolves_the_preset_and_caps_in_flight_tokens_as_serve_does(
    tiny_llama: tuple[Path, object],
) -> None:
    from hybridserve.engine.settings import DEFAULT_PRESET, SettingsSources, preset
    from hybridserve.offline.runtime import GENERATE_MAX_MODEL_LEN, build_runtime

    folder, _ = tiny_llama
    for sources in (
        SettingsSources(),
        SettingsSources(preset="baseline"),
        SettingsSources(preset="baseline", flags=(("max_num_batched_tokens", 64),)),
    ):
        runtime = build_runtime(folder, num_blocks=64, settings=sources, load_tokenizer=False)
        scheduler = runtime.engine.scheduler.config
        want = preset(
            sources.preset or DEFAULT_PRESET, quantum=1, max_model_len=GENERATE_MAX_MODEL_LEN
        )
        want_budget = dict(sources.flags).get(
            "max_num_batched_tokens", want.scheduler.max_num_batched_tokens
        )
        assert scheduler.max_num_seqs == want.scheduler.max_num_seqs
        assert scheduler.max_num_batched_tokens == want_budget
        layout = runtime.engine.scheduler.cache.layout
        assert layout.max_in_flight_tokens == want_budget  # the sliding-window admission cap


def test_generate_takes_a_preset_and_a_settings_file_with_greedy_outputs_unchanged(
    tiny_llama: tuple[Path, object], tmp_path: Path
) -> None:
    folder, _ = tiny_llama
    source = tmp_path / "p.jsonl"
    source.write_text("[5, 6, 7, 8, 9]\n[10, 11, 12]\n")
    config = tmp_path / "settings.toml"
    config.write_text('preset = "baseline"\n\n[scheduler]\nmax_num_batched_tokens = 4\n')
    base = ["generate", "--model", str(folder), "--token-ids", str(source), "--json"]
    runs = [
        CliRunner().invoke(app, [*base, *extra])
        for extra in ([], ["--preset", "baseline"], ["--config", str(config)])
    ]
    assert all(run.exit_code == 0 for run in runs), [run.output for run in runs]
    outputs = [[line for line in run.stdout.splitlines() if line.startswith("{")] for run in runs]
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) == 2


def test_generate_refuses_a_bad_settings_file_before_loading_the_model(
    tiny_llama: tuple[Path, object], tmp_path: Path
) -> None:
    folder, _ = tiny_llama
    source = tmp_path / "p.jsonl"
    source.write_text("[5, 6]\n")
    config = tmp_path / "bad.toml"
    config.write_text("[scheduler]\nmax_num_seqz = 4\n")
    args = ["generate", "--model", str(folder), "--token-ids", str(source), "--config", str(config)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "scheduler.max_num_seqz" in result.output and "loading" not in result.output


def test_generate_sizes_its_pool_for_every_cache_group_of_the_model(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Gemma 3's four groups (three sliding-window, one full) each hold a 400-token prompt
    while it prefills: the default pool gives every group room, and the output is
    transformers'."""
    from hybridserve.offline.runtime import PoolFor, blocks_for, build_runtime
    from tests.reference.helpers import random_prompt
    from tests.reference.test_reference_models import _gemma3_config

    folder = tmp_path_factory.mktemp("cli-gemma3")
    reference = make_checkpoint(_gemma3_config(), folder)
    runtime = build_runtime(folder, num_blocks=PoolFor((400,), 4), load_tokenizer=False)
    assert len(runtime.executor.groups.specs) == 4
    assert runtime.executor.num_blocks == blocks_for(
        [400], max_tokens=4, block_size=16, num_groups=4
    )
    prompt = random_prompt(400, seed=9)
    source = tmp_path / "prompts.jsonl"
    source.write_text(json.dumps(prompt) + "\n")
    result = CliRunner().invoke(
        app,
        ["generate", "--model", str(folder), "--token-ids", str(source), "--max-tokens", "4",
         "--json", "--device", "cpu"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert record["token_ids"] == transformers_greedy(reference, prompt, 4)[0]
