"""Configs, requests and the step contract: validation and the request state machine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig, SpeculativeMethod
from hybridserve.core.errors import ConfigError, IllegalTransition, RequestError
from hybridserve.core.plan import ScheduledChunk, StepPlan
from hybridserve.core.request import (
    MIN_TEMPERATURE,
    MIN_TOP_P,
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
)
from hybridserve.kvcache import CacheLayout, FullAttentionSpec, MambaSpec, Retention
from hybridserve.kvcache.spec import ChunkedLocalSpec, SlidingWindowSpec


@pytest.mark.parametrize(
    "module",
    [
        "hybridserve.kvcache",
        "hybridserve.core",
        "hybridserve.scheduler",
        "hybridserve.engine",
        "hybridserve.cli",
    ],
)
def test_importing_the_core_leaves_torch_and_numpy_out(module: str) -> None:
    code = f"import sys, {module}; print(sorted({{'torch', 'numpy'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("method", "drops"),
    [
        ("eagle", False),  # vLLM 0.33: lookahead block hashes, no drop
        ("eagle3", False),
        ("mtp", False),
        ("eagle-legacy", True),
        ("eagle3-legacy", True),
        ("mtp-legacy", True),
        ("dflash", False),
        ("dspark", False),
        ("ngram", False),
        ("draft_model", False),
        ("none", False),
    ],
)
def test_only_eagle_style_methods_drop_the_target_tail(method: str, drops: bool) -> None:
    assert SpeculativeConfig.from_name(method).drops_target_tail is drops


def test_unknown_speculative_method_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"speculative.method='medusa'.*eagle"):
        SpeculativeConfig.from_name("medusa")


def test_speculative_tokens_without_a_method_is_rejected() -> None:
    with pytest.raises(ConfigError, match="num_speculative_tokens=2"):
        SpeculativeConfig(method=SpeculativeMethod.NONE, num_speculative_tokens=2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"decode_prefill_min_decode_steps": 2}, "decode_prefill_min_decode_steps"),
        (
            {"max_num_prefill_tokens_per_step": 512, "decode_prefill_max_wait_ms": 100.0},
            "decode_prefill_max_wait_ms",
        ),
        (
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 100, "max_model_len": 200},
            "max_num_batched_tokens",
        ),
    ],
)
def test_scheduler_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == f"scheduler.{field}"


def test_scheduler_controls_default_off() -> None:
    config = SchedulerConfig()
    assert config.max_num_prefill_tokens_per_step == 0
    assert config.max_num_partial_prefills == 0
    assert config.decode_prefill_min_decode_steps == 0
    assert config.decode_prefill_max_wait_ms == 0
    assert config.target_mixed_step_ms == 0


def test_configs_are_frozen() -> None:
    config = SchedulerConfig()
    with pytest.raises(AttributeError):
        config.max_num_seqs = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"groups": ()}, "groups"),
        ({"groups": (FullAttentionSpec(block_size=16),), "num_blocks": 1}, "num_blocks"),
        (
            {"groups": (FullAttentionSpec(block_size=16),), "alignment_tokens": 24},
            "alignment_tokens",
        ),
        ({"groups": (FullAttentionSpec(block_size=16),), "hash_block_size": 5}, "hash_block_size"),
        ({"groups": (FullAttentionSpec(block_size=16),), "hash_algo": "md5"}, "hash_algo"),
        (
            {
                "groups": (ChunkedLocalSpec(block_size=4, chunk=8),),
                "speculative": SpeculativeConfig.from_name("eagle"),
            },
            "groups[0]",
        ),
    ],
)
def test_cache_layout_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    kwargs.setdefault("num_blocks", 16)
    with pytest.raises(ConfigError) as info:
        CacheLayout(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_layout_derives_page_and_defaults_alignment_to_it() -> None:
    layout = CacheLayout(
        groups=(FullAttentionSpec(block_size=16), MambaSpec(block_size=48)), num_blocks=8
    )
    assert layout.page_tokens == 48 and layout.alignment_tokens == 48
    assert layout.hash_block_size == 16


def test_group_spec_rejects_bad_sizes() -> None:
    with pytest.raises(ConfigError, match=r"swa\.window"):
        SlidingWindowSpec(block_size=16, window=0)
    with pytest.raises(ConfigError, match=r"chunked_local\.chunk"):
        ChunkedLocalSpec(block_size=16, chunk=24)


def test_retention_parse_errors_name_the_choices() -> None:
    assert Retention.parse("interval:4096").interval_tokens == 4096
    with pytest.raises(ConfigError, match="boundary"):
        Retention.parse("sometimes")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_sampling_params_accept_every_64_bit_seed() -> None:
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 9.9e-6])
def test_temperature_below_the_floor_samples_greedily(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, top_p=0.5).numerically_safe()
    assert params.temperature == 0.0
    assert SamplingParams(temperature=MIN_TEMPERATURE).numerically_safe().temperature > 0


def test_top_p_below_float32_range_is_raised_to_the_floor() -> None:
    params = SamplingParams(temperature=1.0, top_p=1e-300).numerically_safe()
    assert params.top_p == MIN_TOP_P > 0
    assert SamplingParams(temperature=1.0, top_p=0.3).numerically_safe().top_p == 0.3


def test_request_without_prompt_is_rejected() -> None:
    with pytest.raises(RequestError, match="prompt_token_ids"):
        Request(req_id="r", prompt_token_ids=(), sampling=SamplingParams())


def make_request() -> Request:
    return Request(req_id="r1", prompt_token_ids=(1, 2, 3), sampling=SamplingParams())


def test_request_moves_only_along_the_transition_table() -> None:
    request = make_request()
    request.transition(RequestStatus.RUNNING)
    request.transition(RequestStatus.PREEMPTED)
    request.transition(RequestStatus.RUNNING)
    request.transition(RequestStatus.FINISHED_LENGTH)
    assert (
        request.status is RequestStatus.FINISHED_LENGTH
        and request.finish_reason is FinishReason.LENGTH
    )
    with pytest.raises(IllegalTransition):
        request.transition(RequestStatus.RUNNING)


def test_waiting_request_cannot_be_preempted_or_finish_normally() -> None:
    request = make_request()
    for target in (RequestStatus.PREEMPTED, RequestStatus.FINISHED_STOPPED):
        with pytest.raises(IllegalTransition):
            request.transition(target)
    request.transition(RequestStatus.FINISHED_ABORTED)
    assert request.finish_reason is FinishReason.ABORT


def test_request_counts_prompt_and_output_tokens() -> None:
    request = make_request()
    request.append_output_tokens([7, 8])
    assert request.num_tokens == 5 and list(request.all_token_ids) == [1, 2, 3, 7, 8]


def test_step_plan_counts_scheduled_tokens_with_drafts() -> None:
    chunk = ScheduledChunk("r1", 0, (1, 2, 3), ((1,),), True, num_draft_tokens=2)
    assert StepPlan(0, (chunk,)).num_scheduled_tokens == 3
