"""The one settings file (`--config`): its schema, its errors, and the order preset -> file ->
flags, the same for `serve` and `simulate`."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import pytest

from hybridserve.cli.serve_commands import build_app, read_settings_file
from hybridserve.cli.sim_backend import SimServingBackend
from hybridserve.cli.sim_commands import _bench_file_options, _file_options
from hybridserve.core.config import SchedulingPolicy
from hybridserve.core.errors import ConfigError
from hybridserve.engine.settings import (
    SettingsSources,
    load_settings_file,
    preset,
    resolve_settings,
)
from hybridserve.server.app import ServerSettings
from hybridserve.server.backend import serve_settings
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.run import simulated_engine

SHARED = """\
preset = "baseline"

[scheduler]
max_num_seqs = 96
max_num_batched_tokens = 4096
max_num_prefill_tokens_per_step = 1088
max_num_partial_prefills = 1
decode_prefill_min_decode_steps = 2
policy = "priority"

[cache]
retention = "boundary+predecessor"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "settings.toml"
    path.write_text(text)
    return path


def test_serve_and_simulate_apply_the_same_file_identically(tmp_path: Path) -> None:
    path = _write(tmp_path, SHARED)
    # serve: the app factory over the simulated backend, as `hybridserve serve --config` builds it.
    backend = SimServingBackend(max_model_len=32_768)
    served = build_app(backend, ServerSettings(), config_file=path).state.hybridserve.parts
    # simulate: the SimConfig fields `hybridserve simulate --config` takes from the file.
    options = _file_options(path)
    config = SimConfig(
        workload="poisson:rate=1", speculation="none", max_model_len=32_768, **options
    )
    simulated = simulated_engine(config)
    assert options["preset"] == "baseline"
    assert asdict(served.scheduler.config) == asdict(simulated.scheduler.config)
    assert served.scheduler.config.max_num_seqs == 96
    assert served.scheduler.config.policy is SchedulingPolicy.PRIORITY
    assert served.scheduler.config.target_mixed_step_ms == 0.0  # the baseline preset's
    assert served.layout.retention == simulated.layout.retention
    assert served.layout.retention.kind.value == "boundary+predecessor"


def test_settings_resolve_preset_then_file_then_flags(tmp_path: Path) -> None:
    path = _write(tmp_path, SHARED)
    file = load_settings_file(path)
    backend = SimServingBackend(max_model_len=8192)
    flags = (("max_num_seqs", 8), ("target_mixed_step_ms", None))
    chosen = serve_settings(backend, SettingsSources(file=file, flags=flags, retention="dense"))
    assert chosen.scheduler.max_num_prefill_tokens_per_step == 1088  # the file over the preset
    assert chosen.scheduler.max_num_batched_tokens == 4096  # the file
    assert chosen.scheduler.max_num_seqs == 8  # the flag over the file
    assert chosen.scheduler.max_model_len == 8192  # the backend's context limit
    assert chosen.retention.kind.value == "dense"  # the flag over the file
    first = serve_settings(backend, SettingsSources(preset="decode-first", file=file))
    assert first.scheduler.target_mixed_step_ms == 60.0  # --preset beats the file's preset


def test_policy_given_by_name_is_coerced_to_the_enum() -> None:
    chosen = resolve_settings(
        "baseline", quantum=1, max_model_len=4096, scheduler=(("policy", "priority"),)
    )
    assert chosen.scheduler.policy is SchedulingPolicy.PRIORITY
    with pytest.raises(ConfigError, match=r"scheduler\.policy"):
        resolve_settings("baseline", quantum=1, max_model_len=4096, flags={"policy": "lifo"})


def test_hybridserve_preset_is_vllm_with_the_adaptive_budget_deadline_and_pinning() -> None:
    ours = preset("hybridserve", quantum=544, max_model_len=4096)
    vllm = preset("baseline", quantum=544, max_model_len=4096)
    chosen = replace(
        vllm.scheduler,
        max_num_seqs=512,
        adaptive_budget_itl_ms=75.0,
        adaptive_budget_queue_ms=2000.0,
        adaptive_budget_pressure_itl_ms=88.0,
        adaptive_budget_calm_itl_ms=60.0,
        adaptive_budget_context_weight=True,
        waiting_deadline_ms=12_000.0,
        kv_pin_fraction=0.5,
        kv_pin_exact_tail=True,
    )
    assert ours.scheduler == chosen and ours.retention == vllm.retention
    assert ours.scheduler.max_num_batched_tokens == vllm.scheduler.max_num_batched_tokens
    assert ours.lookahead_block_hashes


def test_the_fixed_budget_preset_is_the_measured_overload_setting() -> None:
    fixed = preset("fixed-budget", quantum=544, max_model_len=4096)
    vllm = preset("baseline", quantum=544, max_model_len=4096)
    assert fixed.scheduler == replace(
        vllm.scheduler,
        max_num_batched_tokens=2048,
        max_num_seqs=512,
        kv_pin_fraction=0.5,
        kv_pin_exact_tail=True,
    )
    overload = load_settings_file(Path(__file__).parents[2] / "docs" / "agents_overload.toml")
    assert overload.preset == "baseline"
    from_file = resolve_settings(
        "baseline", quantum=544, max_model_len=4096, scheduler=overload.scheduler
    )
    assert from_file == fixed  # docs/agents_overload.toml, the measured setting, is this preset


def test_no_file_and_no_flags_is_the_preset_itself() -> None:
    expected = preset("hybridserve", quantum=544, max_model_len=4096)
    assert resolve_settings("hybridserve", quantum=544, max_model_len=4096) == expected


def test_top_level_retention_is_accepted_with_a_deprecation_naming_the_new_spelling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, 'preset = "baseline"\nretention = "dense"\n')
    loaded = load_settings_file(path)
    assert loaded.retention == "dense"
    assert len(loaded.deprecations) == 1
    assert "[cache]" in loaded.deprecations[0] and "retention = 'dense'" in loaded.deprecations[0]
    read_settings_file(path)
    assert "deprecated" in capsys.readouterr().err
    backend = SimServingBackend(max_model_len=4096)
    served = build_app(backend, ServerSettings(), config_file=path).state.hybridserve.parts
    assert served.layout.retention.kind.value == "dense"


def test_top_level_and_cache_retention_together_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, 'retention = "dense"\n[cache]\nretention = "boundary"\n')
    with pytest.raises(ConfigError, match="keep only that one"):
        load_settings_file(path)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[scheduler]\nmax_seqs = 64\n", "scheduler.max_seqs"),
        ("[scheduler]\nmax_num_seqs = 'many'\n", "scheduler.max_num_seqs"),
        ("[scheduler]\nenable_chunked_prefill = 1\n", "scheduler.enable_chunked_prefill"),
        ("[scheduler]\ntarget_mixed_step_ms = 'fast'\n", "scheduler.target_mixed_step_ms"),
        ("[scheduler]\npolicy = 'lifo'\n", "scheduler.policy"),
        ("[cache]\nretention = 'sometimes'\n", "retention"),
        ("[cache]\nretention = 3\n", "cache.retention"),
        ("[cache]\nsize = 3\n", "cache.size"),
        ('preset = "fastest"\n', "preset"),
        ("scheduler = 3\n", "scheduler"),
        ("[engine]\nx = 1\n", "config"),
        ("[scheduler\n", "config"),
        ('preset = "baseline"\n[scheduler]\nkv_pin_exact_tail = true\n', "kv_pin_exact_tail"),
    ],
)
def test_a_bad_settings_file_names_the_key_and_the_fix(
    tmp_path: Path, text: str, field: str
) -> None:
    with pytest.raises(ConfigError, match=field) as caught:
        load_settings_file(_write(tmp_path, text))
    assert "is invalid:" in str(caught.value)


def test_a_file_is_validated_over_the_preset_it_names(tmp_path: Path) -> None:
    # Exact tails need a pin fraction: the hybridserve preset has one, the baseline none.
    text = "[scheduler]\nkv_pin_fraction = 0.3\n"
    on_ours = load_settings_file(_write(tmp_path, 'preset = "hybridserve"\n' + text))
    assert on_ours.scheduler == (("kv_pin_fraction", 0.3),)
    with pytest.raises(ConfigError, match="kv_pin_exact_tail"):
        load_settings_file(
            _write(tmp_path, 'preset = "baseline"\n[scheduler]\nkv_pin_exact_tail = true\n')
        )
    off = "[scheduler]\nkv_pin_fraction = 0.0\nkv_pin_exact_tail = false\n"
    assert load_settings_file(_write(tmp_path, 'preset = "hybridserve"\n' + off)).scheduler


def test_bench_refuses_a_file_that_picks_a_preset(tmp_path: Path) -> None:
    path = _write(tmp_path, 'preset = "baseline"\n[scheduler]\nmax_num_seqs = 8\n')
    with pytest.raises(ConfigError, match="bench compares the presets itself"):
        _bench_file_options(path)
    plain = _write(tmp_path, "[scheduler]\nmax_num_seqs = 8\n")
    assert _bench_file_options(plain) == {"overrides": (("max_num_seqs", 8),), "retention": None}


def test_the_shipped_overload_file_is_the_tuned_vllm_setting_plus_the_agent_controls() -> None:
    """docs/agents_overload.toml spells out what the README's 80-agent measurement ran
    (docs/e1_results_80_agents.json: the hybridserve preset, no overrides, against the stored
    20-agent search of vLLM's knobs as --tuned): the baseline preset, those vLLM knobs, and the
    preset's tool-call pinning with exact tails."""
    import json

    from hybridserve.sim.experiment import read_tuned

    docs = Path(__file__).resolve().parents[2] / "docs"
    options = _file_options(docs / "agents_overload.toml")
    tuned, _ = read_tuned(SimConfig(), docs / "sweep_vllm_e1_20_agents.json")
    assert options["preset"] == tuned.preset == "baseline"
    assert options["retention"] is None and tuned.retention == "boundary"  # the preset's own
    run = json.loads((docs / "e1_results_80_agents.json").read_text())
    assert run["baseline"] == "vllm-tuned" and run["controls"] == {}
    assert run["by_agents"]["80"]["hybridserve"]["job_goodput_per_hour"] > 0
    ours = preset("hybridserve", quantum=544, max_model_len=4096).scheduler
    agent = {"kv_pin_fraction": ours.kv_pin_fraction, "kv_pin_exact_tail": ours.kv_pin_exact_tail}
    assert dict(options["overrides"]) == {**dict(tuned.overrides), **agent}


def test_the_simulated_backend_keeps_the_presets_token_budget() -> None:
    backend = SimServingBackend(max_model_len=8192)
    assert backend.default_max_num_batched_tokens is None
    assert serve_settings(backend, SettingsSources()).scheduler.max_num_batched_tokens == 8192
