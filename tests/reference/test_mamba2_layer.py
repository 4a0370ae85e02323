"""The Mamba2 mixer against transformers' BambaMixer (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.executor.torch import cpu_kernels
from hybridserve.executor.torch.layers.mamba2 import (
    Mamba2Dims,
    Mamba2Mixer,
    ssd_chunked,
    ssd_recurrent,
)
from tests.reference.recurrent_layer import (
    RecurrentLayerChecks,
    check_chunked_equals_loop,
    check_decodes_batched,
    check_scan_result,
    count_kernel_calls,
    perturb,
    snapshot_counts,
)

transformers = pytest.importorskip("transformers")


def tiny_config(heads: int = 4) -> transformers.BambaConfig:
    return transformers.BambaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=heads,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        initializer_range=0.1,
    )


# 4 heads of 16 take the scan's C kernel where this CPU has AVX-512; 8 heads of 8 its torch form
# (elsewhere both are the torch form).
@pytest.fixture(scope="module", params=[4, 8], ids=["head-dim-16", "head-dim-8"])
def layers(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, Mamba2Mixer]:
    from transformers.models.bamba.modeling_bamba import BambaMixer

    torch.manual_seed(0)
    config = tiny_config(request.param)
    reference = BambaMixer(config, layer_idx=0).eval()
    perturb(reference)
    ours = Mamba2Mixer(Mamba2Dims.from_bamba_config(config.to_dict()), layer_index=0).eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


class TestAgainstTransformers(RecurrentLayerChecks):
    SEQ_LEN = 50  # several of the 16-token scan chunks
    CUTS = ([21], [3, 40], [16, 17, 32])
    DECODE_LEN = 20
    SNAPSHOT_PREFIX = 40
    SNAPSHOTS = (8, 16, 17)
    SPLIT = 25


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunked_scan_equals_token_by_token_scan(chunk_size: int) -> None:
    generator = torch.Generator().manual_seed(3)
    length, heads, head_dim, state_size = 29, 3, 4, 5

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    x, b, c = (
        rand(length, heads, head_dim),
        rand(length, heads, state_size),
        rand(length, heads, state_size),
    )
    dt = torch.rand(length, heads, generator=generator)
    a = -torch.rand(heads, generator=generator) - 0.1
    state = rand(heads, head_dim, state_size)
    expected, expected_state, _ = ssd_recurrent(x, dt, a, b, c, state)
    out, final, _ = ssd_chunked(x, dt, a, b, c, state, chunk_size=chunk_size)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(final, expected_state, atol=1e-5, rtol=0)


def random_scan_inputs(
    length: int,
    *,
    heads: int,
    groups: int,
    head_dim: int = 4,
    state_size: int = 6,
    seed: int = 5,
) -> tuple[torch.Tensor, ...]:
    """x, dt, a, b, c (per group) and a starting state shaped as the mixer makes them (the C
    kernel takes head sizes that are multiples of 16)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(length, heads, head_dim, generator=generator)
    dt = torch.rand(length, heads, generator=generator) * 0.2
    a = -torch.rand(heads, generator=generator) - 0.1
    b = torch.randn(length, groups, state_size, generator=generator) * 0.5
    c = torch.randn(length, groups, state_size, generator=generator) * 0.5
    state = torch.randn(heads, head_dim, state_size, generator=generator)
    return x, dt, a, b, c, state


@pytest.mark.parametrize("length", [1, 7, 64, 544, 4096])
@pytest.mark.parametrize("start", ["zero", "carried"])
def test_chunked_scan_with_snapshots_equals_token_loop(length: int, start: str) -> None:
    heads, groups = (2, 1) if length == 4096 else (4, 2)
    x, dt, a, b, c, state = random_scan_inputs(length, heads=heads, groups=groups)
    if start == "zero":
        state = torch.zeros_like(state)
    counts = snapshot_counts(length)
    expected, expected_state, expected_saved = ssd_recurrent(
        x, dt, a, b, c, state, snapshots=counts
    )
    for chunk_size in (32, 64):  # the CPU and GPU sizes
        out, final, saved = ssd_chunked(
            x, dt, a, b, c, state, chunk_size=chunk_size, snapshots=counts
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(final, expected_state, atol=1e-5, rtol=0)
        assert len(saved) == len(counts)
        for count, got, want in zip(counts, saved, expected_saved, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"state after {count}")


def test_a_batch_of_decodes_equals_each_request_decoded_alone(
    layers: tuple[torch.nn.Module, Mamba2Mixer],
) -> None:
    _, ours = layers
    torch.manual_seed(3)
    batch = 5
    shapes = ours.state_shapes()
    states = [{k: torch.randn(shape) * 0.5 for k, shape in shapes.items()} for _ in range(batch)]
    x = torch.randn(batch, 32)
    with torch.no_grad():
        _, xbc, dt = ours._project(x)
        stacked = {k: torch.stack([s[k] for s in states]) for k in shapes}
        y, new = ours._decode(xbc, dt, stacked)
        for i in range(batch):
            alone, state, saved = ours._mix(xbc[i : i + 1], dt[i : i + 1], states[i], (1,))
            torch.testing.assert_close(y[i], alone[0], atol=1e-6, rtol=0)
            for k in shapes:
                torch.testing.assert_close(new[k][i], state[k], atol=1e-6, rtol=0)
                torch.testing.assert_close(saved[0][k], state[k])


def test_a_steps_decodes_run_as_one_batch_and_its_prefill_alone(
    layers: tuple[torch.nn.Module, Mamba2Mixer],
) -> None:
    check_decodes_batched(layers[1], hidden_size=32, in_place_states=2)  # conv and SSM


def test_decodes_without_the_cpu_kernels_still_advance_their_states_where_they_lie(
    layers: tuple[torch.nn.Module, Mamba2Mixer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The torch forms of the conv and SSM steps on the same in-place state views.
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    check_decodes_batched(layers[1], hidden_size=32, in_place_states=2)


def test_decays_past_the_floor_equal_the_loop_and_leave_the_callers_state_unwritten() -> None:
    """A = -100 and dt 0.05: every token decays by e^-5, so within a 32-token chunk the
    products fall far below the e^-80 floor the chunked scan clamps at; the outputs and states
    still equal the loop's, all finite, and the state passed in is not advanced in place."""
    x, dt, a, b, c, state = random_scan_inputs(200, heads=4, groups=2)
    a, dt = torch.full_like(a, -100.0), torch.full_like(dt, 0.05)
    check_chunked_equals_loop(ssd_chunked, ssd_recurrent, (x, dt, a, b, c, state))


@pytest.fixture(scope="module")
def scan_kernel() -> cpu_kernels.CpuKernels:
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.ssd_built:
        pytest.skip("the CPU kernels have no AVX-512 build here (no chunked SSD kernel)")
    return kernels


@pytest.mark.parametrize("length", [1, 7, 64, 544, 4096])
@pytest.mark.parametrize("start", ["zero", "carried"])
def test_the_c_kernel_scan_with_snapshots_equals_token_loop(
    scan_kernel: cpu_kernels.CpuKernels, length: int, start: str
) -> None:
    heads, groups = (2, 1) if length == 4096 else (4, 2)
    x, dt, a, b, c, state = random_scan_inputs(length, heads=heads, groups=groups, head_dim=16)
    if start == "zero":
        state = torch.zeros_like(state)
    counts = snapshot_counts(length)
    before = state.clone()
    loop = ssd_recurrent(x, dt, a, b, c, state, snapshots=counts)
    for chunk_size in (1, 7, 16, 64):
        got = scan_kernel.ssd_chunked(x, dt, a, b, c, state, chunk_size, counts)
        assert got is not None, "the kernel refused a shape it takes"
        check_scan_result(got, loop, counts)
    assert torch.equal(state, before)  # the caller's state is not advanced


@settings(max_examples=30, deadline=None)
@given(
    groups=st.integers(1, 3),
    ratio=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([16, 32, 64]),
    state_size=st.sampled_from([1, 5, 16, 40]),
    length=st.integers(1, 150),
    chunk_size=st.sampled_from([1, 5, 16, 32, 64]),
    threads=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_the_c_kernel_scan_equals_the_torch_form(
    scan_kernel: cpu_kernels.CpuKernels,
    groups: int,
    ratio: int,
    head_dim: int,
    state_size: int,
    length: int,
    chunk_size: int,
    threads: int,
    data: st.DataObject,
) -> None:
    """Any grouping, head and state sizes, chunk (whole or not) and thread count (work split by
    groups or by heads), with snapshots anywhere."""
    inputs = random_scan_inputs(
        length, heads=groups * ratio, groups=groups, head_dim=head_dim, state_size=state_size
    )
    counts = tuple(sorted(data.draw(st.sets(st.integers(1, length), max_size=4))))
    want = ssd_chunked(*inputs, chunk_size=chunk_size, snapshots=counts, kernel=False)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = scan_kernel.ssd_chunked(*inputs, chunk_size, counts)
    finally:
        torch.set_num_threads(previous)
    assert got is not None
    check_scan_result(got, want, counts)


def test_the_c_kernel_scan_leaves_strong_decays_exact(scan_kernel: cpu_kernels.CpuKernels) -> None:
    """Log decays that cross the floor inside a chunk (a random checkpoint's) give the loop's
    result: weights below the floor are zero, as in the torch form."""
    x, dt, _, b, c, state = random_scan_inputs(200, heads=4, groups=2, head_dim=16)
    a = -torch.tensor([1.0, 16.0, 200.0, 1000.0])
    counts = (7, 64, 100)
    got = scan_kernel.ssd_chunked(x, dt, a, b, c, state, 16, counts)
    assert got is not None
    check_scan_result(got, ssd_recurrent(x, dt, a, b, c, state, snapshots=counts), counts)


def test_the_c_kernel_scan_refuses_what_it_does_not_take(
    scan_kernel: cpu_kernels.CpuKernels,
) -> None:
    """None (the caller takes the torch form) for a head size that is not a multiple of 16, a
    chunk past 64 tokens, snapshots out of order or past the end, and float64 inputs."""
    inputs = random_scan_inputs(20, heads=2, groups=1, head_dim=16)
    assert scan_kernel.ssd_chunked(*inputs, 65, ()) is None
    assert scan_kernel.ssd_chunked(*inputs, 16, (5, 3)) is None
    assert scan_kernel.ssd_chunked(*inputs, 16, (21,)) is None
    assert scan_kernel.ssd_chunked(*(t.double() for t in inputs), 16, ()) is None
    narrow = random_scan_inputs(20, heads=2, groups=1, head_dim=8)
    assert scan_kernel.ssd_chunked(*narrow, 16, ()) is None
    assert scan_kernel.ssd_chunked(*inputs, 16, (3, 20)) is not None


def test_the_scan_takes_the_c_kernel_on_the_cpu(
    scan_kernel: cpu_kernels.CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ssd_chunked` calls the kernel for float32 CPU inputs, and its torch form with
    `kernel=False`."""
    calls = count_kernel_calls(monkeypatch, "ssd_chunked")
    inputs = random_scan_inputs(40, heads=2, groups=1, head_dim=16)
    ssd_chunked(*inputs, chunk_size=16)
    assert len(calls) == 1
    ssd_chunked(*inputs, chunk_size=16, kernel=False)
    assert len(calls) == 1
