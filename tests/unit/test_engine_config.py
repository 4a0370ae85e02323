"""One resolver configures every engine (`resolve_engine_config`): the sliding-window in-flight
cap, the preset's lookahead hashes, and `replay-vllm`'s recorded engines through it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from hybridserve.core.config import SpeculativeConfig
from hybridserve.engine.assembly import ModelCache, resolve_engine_config
from hybridserve.engine.settings import preset
from hybridserve.kvcache import FullAttentionSpec, SlidingWindowSpec
from hybridserve.recordings.recording import load_recording
from hybridserve.recordings.replay import recorded_config, replay_recording
from tests.conftest import require_data

GROUPS = (FullAttentionSpec(block_size=16), SlidingWindowSpec(block_size=16, window=64))


def test_the_in_flight_cap_is_one_steps_token_budget_unless_given() -> None:
    settings = preset("baseline", quantum=1, max_model_len=4096)
    model = ModelCache(groups=GROUPS)
    config = resolve_engine_config(settings, model, num_blocks=64)
    assert config.layout.max_in_flight_tokens == settings.scheduler.max_num_batched_tokens
    assert config.scheduler == settings.scheduler
    assert config.layout.retention == settings.retention
    given = resolve_engine_config(settings, model, num_blocks=64, max_in_flight_tokens=100)
    assert given.layout.max_in_flight_tokens == 100


def test_the_legacy_preset_drops_a_block_and_a_legacy_method_stays_legacy() -> None:
    mtp = ModelCache(groups=GROUPS[:1], speculative=SpeculativeConfig.from_name("mtp", 2))
    legacy = preset("legacy", quantum=1, max_model_len=4096)
    default = preset("hybridserve", quantum=1, max_model_len=4096)
    assert not resolve_engine_config(
        legacy, mtp, num_blocks=64
    ).layout.speculative.lookahead_block_hashes
    assert resolve_engine_config(
        default, mtp, num_blocks=64
    ).layout.speculative.lookahead_block_hashes
    named = replace(mtp, speculative=SpeculativeConfig.from_name("mtp-legacy", 2))
    spec = resolve_engine_config(default, named, num_blocks=64).layout.speculative
    assert spec.name == "mtp-legacy"
    ngram = replace(mtp, speculative=SpeculativeConfig.from_name("ngram", 2))
    # A method that reads no hidden state has no legacy form: the preset leaves it alone.
    assert (
        resolve_engine_config(legacy, ngram, num_blocks=64).layout.speculative == ngram.speculative
    )


def test_replay_caps_in_flight_tokens_at_the_recorded_budget_when_the_header_has_none() -> None:
    recording = load_recording(require_data("vllm-recordings", "threshold_fa16.jsonl"))
    assert recording.header["engine"].get("max_in_flight_tokens") is None
    config = recorded_config(recording)
    budget = recording.header["engine"]["max_num_scheduled_tokens"]
    assert config.layout.max_in_flight_tokens == budget == config.scheduler.max_num_batched_tokens


def test_replay_takes_the_in_flight_cap_the_header_logged(tmp_path: Path) -> None:
    source = require_data("vllm-recordings", "swa_fa32_swa16.jsonl")
    recording = load_recording(source)
    assert recording.header["engine"]["max_in_flight_tokens"] == 8192
    assert recorded_config(recording).layout.max_in_flight_tokens == 8192
    lines = source.read_text().splitlines()
    header = json.loads(lines[0])
    header["engine"]["max_in_flight_tokens"] = 4096
    (tmp_path / "half.jsonl").write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    halved = load_recording(tmp_path / "half.jsonl")
    assert recorded_config(halved).layout.max_in_flight_tokens == 4096
    # The sliding-window group's admission cap follows it, so the recorded steps diverge.
    assert replay_recording(halved).first_divergence is not None
