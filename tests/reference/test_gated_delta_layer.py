"""The gated delta net layer against transformers' Qwen3NextGatedDeltaNet (CPU, float32)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.executor.torch import cpu_kernels
from hybridserve.executor.torch.layers.gated_delta import (
    GatedDeltaNet,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from tests.reference.recurrent_layer import (
    RecurrentLayerChecks,
    check_chunked_equals_loop,
    check_decodes_batched,
    check_scan_result,
    count_kernel_calls,
    inputs,
    perturb,
    snapshot_counts,
)

transformers = pytest.importorskip("transformers")


def tiny_config(value_head_dim: int = 6) -> transformers.Qwen3NextConfig:
    return transformers.Qwen3NextConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=value_head_dim,
        linear_conv_kernel_dim=4,
        intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        initializer_range=0.1,
    )


# A value head of 6 takes the rule's torch form; one of 16 its C kernel where this CPU has
# AVX-512 (elsewhere both are the torch form).
@pytest.fixture(scope="module", params=[6, 16], ids=["value-head-6", "value-head-16"])
def layers(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, GatedDeltaNet]:
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    torch.manual_seed(0)
    config = tiny_config(request.param)
    reference = Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    perturb(reference)
    ours = GatedDeltaNet(config.to_dict(), layer_index=0).eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


class TestAgainstTransformers(RecurrentLayerChecks):
    SEQ_LEN = 80  # longer than transformers' 64-token chunk
    CUTS = ([37], [5, 70], [16, 33, 64])
    DECODE_LEN = 24
    SNAPSHOT_PREFIX = 50
    SNAPSHOTS = (16, 32, 33)
    SPLIT = 40


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
def test_chunked_rule_equals_token_by_token_rule(chunk_size: int) -> None:
    generator = torch.Generator().manual_seed(3)
    length, heads, dk, dv = 29, 3, 5, 4

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    q = rand(length, heads, dk) / math.sqrt(dk)
    k = torch.nn.functional.normalize(rand(length, heads, dk), dim=-1)
    v, state = rand(length, heads, dv), rand(heads, dk, dv)
    g = -torch.rand(length, heads, generator=generator)
    beta = torch.rand(length, heads, generator=generator)
    expected, expected_state, _ = gated_delta_rule_recurrent(q, k, v, g, beta, state)
    out, final, _ = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(final, expected_state, atol=1e-5, rtol=0)


def random_rule_inputs(
    length: int, *, key_heads: int, value_heads: int, dk: int = 8, dv: int = 6, seed: int = 5
) -> tuple[torch.Tensor, ...]:
    """q, k (per key head), v, g, beta and a starting state shaped as the layer makes them (the
    C kernel takes value heads that are multiples of 16)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(
        torch.randn(length, key_heads, dk, generator=generator), dim=-1
    )
    k = torch.nn.functional.normalize(
        torch.randn(length, key_heads, dk, generator=generator), dim=-1
    )
    v = torch.randn(length, value_heads, dv, generator=generator)
    g = -torch.rand(length, value_heads, generator=generator) * 0.3
    beta = torch.rand(length, value_heads, generator=generator)
    state = torch.randn(value_heads, dk, dv, generator=generator)
    return q * dk**-0.5, k, v, g, beta, state


@pytest.mark.parametrize("length", [1, 7, 64, 544, 4096])
@pytest.mark.parametrize("start", ["zero", "carried"])
def test_chunked_rule_with_snapshots_equals_token_loop(length: int, start: str) -> None:
    heads = (1, 2) if length == 4096 else (2, 4)
    q, k, v, g, beta, state = random_rule_inputs(length, key_heads=heads[0], value_heads=heads[1])
    if start == "zero":
        state = torch.zeros_like(state)
    counts = snapshot_counts(length)
    expected, expected_state, expected_saved = gated_delta_rule_recurrent(
        q, k, v, g, beta, state, snapshots=counts
    )
    for chunk_size in (32, 64):  # the CPU and GPU sizes
        out, final, saved = gated_delta_rule_chunked(
            q, k, v, g, beta, state, chunk_size=chunk_size, snapshots=counts
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(final, expected_state, atol=1e-5, rtol=0)
        assert len(saved) == len(counts)
        for count, got, want in zip(counts, saved, expected_saved, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"state after {count}")


def test_short_chunk_snapshots_equal_states_of_a_token_by_token_run(
    layers: tuple[torch.nn.Module, GatedDeltaNet],
) -> None:
    """A chunk short enough for the token loop (decode with two drafts)."""
    _, ours = layers
    x = inputs(length=3)
    with torch.no_grad():
        _, _, short = ours.forward_sequence(x, ours.zero_state(), snapshots=(1, 2, 3))
        state, by_token = ours.zero_state(), {}
        for t in range(x.shape[0]):
            _, state, _ = ours.forward_sequence(x[t : t + 1], state)
            by_token[t + 1] = state
    for count, snapshot in zip((1, 2, 3), short, strict=True):
        torch.testing.assert_close(snapshot["ssm"], by_token[count]["ssm"], atol=1e-5, rtol=0)


def test_snapshot_outside_the_chunk_is_refused(
    layers: tuple[torch.nn.Module, GatedDeltaNet],
) -> None:
    _, ours = layers
    with pytest.raises(ValueError, match="snapshots=\\(4, 11\\)"):
        ours.forward_sequence(inputs(length=10), ours.zero_state(), snapshots=(4, 11))


def test_a_steps_decodes_run_as_one_batch_and_its_prefill_alone(
    layers: tuple[torch.nn.Module, GatedDeltaNet],
) -> None:
    check_decodes_batched(layers[1], hidden_size=32)


def test_decays_past_the_floor_equal_the_loop_and_leave_the_callers_state_unwritten() -> None:
    """Every third token decays by e^-40 (a chunk's products fall far below the e^-80 floor the
    chunked rule clamps at): the outputs and states still equal the loop's, all finite, and the
    state passed in is not advanced in place."""
    q, k, v, g, beta, state = random_rule_inputs(200, key_heads=2, value_heads=4)
    g[::3] = -40.0
    check_chunked_equals_loop(
        gated_delta_rule_chunked, gated_delta_rule_recurrent, (q, k, v, g, beta, state)
    )


@pytest.fixture(scope="module")
def rule_kernel() -> cpu_kernels.CpuKernels:
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.gated_delta_built:
        pytest.skip("the CPU kernels have no AVX-512 build here (no chunked gated delta kernel)")
    return kernels


@pytest.mark.parametrize("length", [1, 7, 64, 544, 4096])
@pytest.mark.parametrize("start", ["zero", "carried"])
def test_the_c_kernel_rule_with_snapshots_equals_token_loop(
    rule_kernel: cpu_kernels.CpuKernels, length: int, start: str
) -> None:
    heads = (1, 2) if length == 4096 else (2, 4)
    q, k, v, g, beta, state = random_rule_inputs(
        length, key_heads=heads[0], value_heads=heads[1], dv=16
    )
    if start == "zero":
        state = torch.zeros_like(state)
    counts = snapshot_counts(length)
    before = state.clone()
    loop = gated_delta_rule_recurrent(q, k, v, g, beta, state, snapshots=counts)
    for chunk_size in (1, 7, 32, 64):
        got = rule_kernel.gated_delta_chunked(q, k, v, g, beta, state, chunk_size, counts)
        assert got is not None, "the kernel refused a shape it takes"
        check_scan_result(got, loop, counts)
    assert torch.equal(state, before)  # the caller's state is not advanced


@settings(max_examples=30, deadline=None)
@given(
    key_heads=st.integers(1, 3),
    ratio=st.sampled_from([1, 2, 3]),
    dk=st.sampled_from([4, 8, 13, 32]),
    dv=st.sampled_from([16, 32, 48, 80]),
    length=st.integers(1, 150),
    chunk_size=st.sampled_from([1, 5, 16, 32, 64]),
    threads=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_the_c_kernel_rule_equals_the_torch_form(
    rule_kernel: cpu_kernels.CpuKernels,
    key_heads: int,
    ratio: int,
    dk: int,
    dv: int,
    length: int,
    chunk_size: int,
    threads: int,
    data: st.DataObject,
) -> None:
    """Any head grouping, head sizes, chunk (whole or not) and thread count (work split by key
    heads or by value heads), with snapshots anywhere."""
    inputs = random_rule_inputs(
        length, key_heads=key_heads, value_heads=key_heads * ratio, dk=dk, dv=dv
    )
    counts = tuple(sorted(data.draw(st.sets(st.integers(1, length), max_size=4))))
    want = gated_delta_rule_chunked(*inputs, chunk_size=chunk_size, snapshots=counts, kernel=False)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = rule_kernel.gated_delta_chunked(*inputs, chunk_size, counts)
    finally:
        torch.set_num_threads(previous)
    assert got is not None
    check_scan_result(got, want, counts)


def test_the_c_kernel_rule_leaves_strong_decays_exact(
    rule_kernel: cpu_kernels.CpuKernels,
) -> None:
    """Log decays that cross the floor inside a chunk (a random checkpoint's) give the loop's
    result: entries below the floor are zero, as in the torch form."""
    q, k, v, _, beta, state = random_rule_inputs(200, key_heads=2, value_heads=4, dv=16)
    rates = torch.tensor([1.0, 16.0, 200.0, 1000.0])
    g = -(torch.rand(200, 4, generator=torch.Generator().manual_seed(1)) * 0.05 + 0.05) * rates
    counts = (7, 64, 100)
    got = rule_kernel.gated_delta_chunked(q, k, v, g, beta, state, 32, counts)
    assert got is not None
    loop = gated_delta_rule_recurrent(q, k, v, g, beta, state, snapshots=counts)
    check_scan_result(got, loop, counts)


def test_the_c_kernel_rule_refuses_what_it_does_not_take(
    rule_kernel: cpu_kernels.CpuKernels,
) -> None:
    """None (the caller takes the torch form) for a value head that is not a multiple of 16, a
    chunk past 64 tokens, snapshots out of order or past the end, and float64 inputs."""
    inputs = random_rule_inputs(20, key_heads=1, value_heads=2, dv=16)
    assert rule_kernel.gated_delta_chunked(*inputs, 65, ()) is None
    assert rule_kernel.gated_delta_chunked(*inputs, 32, (5, 3)) is None
    assert rule_kernel.gated_delta_chunked(*inputs, 32, (21,)) is None
    assert rule_kernel.gated_delta_chunked(*(t.double() for t in inputs), 32, ()) is None
    narrow = random_rule_inputs(20, key_heads=1, value_heads=2, dv=6)
    assert rule_kernel.gated_delta_chunked(*narrow, 32, ()) is None
    assert rule_kernel.gated_delta_chunked(*inputs, 32, (3, 20)) is not None


def test_the_rule_takes_the_c_kernel_on_the_cpu(
    rule_kernel: cpu_kernels.CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gated_delta_rule_chunked` calls the kernel for float32 CPU inputs, and its torch form
    with `kernel=False` or on inputs that require gradients (the kernel has no backward)."""
    calls = count_kernel_calls(monkeypatch, "gated_delta_chunked")
    inputs = random_rule_inputs(40, key_heads=1, value_heads=2, dv=16)
    gated_delta_rule_chunked(*inputs, chunk_size=32)
    assert len(calls) == 1
    gated_delta_rule_chunked(*inputs, chunk_size=32, kernel=False)
    q = inputs[0].clone().requires_grad_()
    gated_delta_rule_chunked(q, *inputs[1:], chunk_size=32)
    assert len(calls) == 1
