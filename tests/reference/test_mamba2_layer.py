"""The Mamba2 mixer against transformers' BambaMixer (CPU, float32)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridserve.executor.torch.layers.mamba2 import (
    Mamba2Dims,
    Mamba2Mixer,
    ssd_chunked,
    ssd_recurrent,
)

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
SEQ_LEN = 50  # several of the 16-token scan chunks


def tiny_config() -> transformers.BambaConfig:
    return transformers.BambaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        initializer_range=0.1,
    )


@pytest.fixture(scope="module")
def layers() -> tuple[torch.nn.Module, Mamba2Mixer]:
    from transformers.models.bamba.modeling_bamba import BambaMixer

    torch.manual_seed(0)
    config = tiny_config()
    reference = BambaMixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name == "A_log":
                # Slow decay so that the state carried across chunks matters to the output.
                param.copy_(torch.empty_like(param).uniform_(0.05, 0.5).log())
            else:
                param.add_(torch.randn_like(param) * 0.1)
    ours = Mamba2Mixer(Mamba2Dims.from_bamba_config(config.to_dict()), layer_index=0).eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def inputs(seed: int = 1, length: int = SEQ_LEN) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(length, 32, generator=generator)


def reference_output(reference: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(x[None])[0]


def run_in_pieces(ours: Mamba2Mixer, x: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    state = ours.zero_state()
    outs = []
    with torch.no_grad():
        for start, end in itertools.pairwise([0, *cuts, x.shape[0]]):
            out, state, _ = ours.forward_sequence(x[start:end], state)
            outs.append(out)
    return torch.cat(outs)


def test_whole_sequence_matches_transformers(layers: tuple[torch.nn.Module, Mamba2Mixer]) -> None:
    reference, ours = layers
    x = inputs()
    with torch.no_grad():
        out, _, _ = ours.forward_sequence(x, ours.zero_state())
    torch.testing.assert_close(out, reference_output(reference, x), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("cuts", [[21], [3, 40], [16, 17, 32]])
def test_chunks_with_carried_state_match_whole_sequence(
    layers: tuple[torch.nn.Module, Mamba2Mixer], cuts: list[int]
) -> None:
    reference, ours = layers
    x = inputs()
    out = run_in_pieces(ours, x, cuts)
    torch.testing.assert_close(out, reference_output(reference, x), atol=TOLERANCE, rtol=0)


def test_token_by_token_decode_matches_whole_sequence(
    layers: tuple[torch.nn.Module, Mamba2Mixer],
) -> None:
    reference, ours = layers
    x = inputs(length=20)
    out = run_in_pieces(ours, x, list(range(1, 20)))
    torch.testing.assert_close(out, reference_output(reference, x), atol=TOLERANCE, rtol=0)


def test_resuming_from_a_snapshot_matches_whole_sequence(
    layers: tuple[torch.nn.Module, Mamba2Mixer],
) -> None:
    reference, ours = layers
    x = inputs()
    expected = reference_output(reference, x)
    with torch.no_grad():
        _, _, saved = ours.forward_sequence(x[:40], ours.zero_state(), snapshots=(8, 16, 17))
        for count, state in zip((8, 16, 17), saved, strict=True):
            resumed, _, _ = ours.forward_sequence(x[count:], state)
            torch.testing.assert_close(resumed, expected[count:], atol=TOLERANCE, rtol=0)


def test_zeroed_state_at_a_chunk_boundary_is_detected(
    layers: tuple[torch.nn.Module, Mamba2Mixer],
) -> None:
    reference, ours = layers
    x = inputs()
    with torch.no_grad():
        head, _, _ = ours.forward_sequence(x[:25], ours.zero_state())
        tail, _, _ = ours.forward_sequence(x[25:], ours.zero_state())
    broken = torch.cat([head, tail])
    error = (broken - reference_output(reference, x)).abs().max().item()
    assert error > 100 * TOLERANCE


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
    length: int, *, heads: int, groups: int, seed: int = 5
) -> tuple[torch.Tensor, ...]:
    """x, dt, a, b, c (per group) and a starting state shaped as the mixer makes them."""
    generator = torch.Generator().manual_seed(seed)
    head_dim, state_size = 4, 6
    x = torch.randn(length, heads, head_dim, generator=generator)
    dt = torch.rand(length, heads, generator=generator) * 0.2
    a = -torch.rand(heads, generator=generator) - 0.1
    b = torch.randn(length, groups, state_size, generator=generator) * 0.5
    c = torch.randn(length, groups, state_size, generator=generator) * 0.5
    state = torch.randn(heads, head_dim, state_size, generator=generator)
    return x, dt, a, b, c, state


def snapshot_counts(length: int) -> tuple[int, ...]:
    """Counts inside chunks, at a chunk's end, just past it and at the end (as the cache asks)."""
    return tuple(
        sorted({n for n in (1, 5, 63, 64, 65, length // 2, length - 1, length) if 0 < n <= length})
    )


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


def test_layer_snapshots_equal_states_of_a_token_by_token_run(
    layers: tuple[torch.nn.Module, Mamba2Mixer],
) -> None:
    _, ours = layers
    x = inputs(length=70)
    counts = (3, 31, 64, 65, 70)
    with torch.no_grad():
        _, final, saved = ours.forward_sequence(x, ours.zero_state(), snapshots=counts)
        state, by_token = ours.zero_state(), {}
        for t in range(x.shape[0]):
            _, state, _ = ours.forward_sequence(x[t : t + 1], state)
            by_token[t + 1] = state
    for count, snapshot in zip(counts, saved, strict=True):
        for name in ("conv", "ssm"):
            torch.testing.assert_close(snapshot[name], by_token[count][name], atol=1e-5, rtol=0)
    torch.testing.assert_close(final["ssm"], by_token[70]["ssm"], atol=1e-5, rtol=0)
