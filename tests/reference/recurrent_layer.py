"""The checks a recurrent layer (Mamba2 mixer, gated delta net) passes against its transformers
twin: whole sequences, chunks with the state carried, token-by-token decode, resuming from a
snapshot, and a meta-check that a dropped state is caught. A test module subclasses
`RecurrentLayerChecks` as `Test...`, sets the lengths and cuts, and defines a `layers` fixture
giving (transformers layer, our layer) with equal weights."""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
import torch

from hybridserve.executor.torch import cpu_kernels

TOLERANCE = 1e-4


def perturb(reference: torch.nn.Module) -> None:
    """Randomise a freshly built transformers layer away from its init, with a slow decay so
    that the state carried across chunks matters to the output."""
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name == "A_log":
                param.copy_(torch.empty_like(param).uniform_(0.05, 0.5).log())
            else:
                param.add_(torch.randn_like(param) * 0.1)


def inputs(length: int, seed: int = 1, hidden: int = 32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(length, hidden, generator=generator)


def reference_output(reference: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = reference(x[None])[0]
        return out


def run_in_pieces(ours: Any, x: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """Our layer over `x` cut at `cuts`, each piece starting from the state the last one left."""
    state = ours.zero_state()
    outs = []
    with torch.no_grad():
        for start, end in itertools.pairwise([0, *cuts, x.shape[0]]):
            out, state, _ = ours.forward_sequence(x[start:end], state)
            outs.append(out)
    return torch.cat(outs)


def snapshot_counts(length: int) -> tuple[int, ...]:
    """Counts inside chunks, at a chunk's end, just past it and at the end (as the cache asks)."""
    return tuple(
        sorted({n for n in (1, 5, 63, 64, 65, length // 2, length - 1, length) if 0 < n <= length})
    )


class RecurrentLayerChecks:
    SEQ_LEN: ClassVar[int]
    CUTS: ClassVar[tuple[list[int], list[int], list[int]]]  # where the chunked runs cut
    DECODE_LEN: ClassVar[int]  # tokens of the token-by-token run
    SNAPSHOT_PREFIX: ClassVar[int]  # tokens of the run that saves the snapshots
    SNAPSHOTS: ClassVar[tuple[int, ...]]
    SPLIT: ClassVar[int]  # where the meta-check restarts from a zero state

    def test_whole_sequence_matches_transformers(self, layers: tuple[torch.nn.Module, Any]) -> None:
        reference, ours = layers
        x = inputs(self.SEQ_LEN)
        with torch.no_grad():
            out, _, _ = ours.forward_sequence(x, ours.zero_state())
        torch.testing.assert_close(out, reference_output(reference, x), atol=TOLERANCE, rtol=0)

    @pytest.mark.parametrize("which", [0, 1, 2])
    def test_chunks_with_carried_state_match_whole_sequence(
        self, layers: tuple[torch.nn.Module, Any], which: int
    ) -> None:
        reference, ours = layers
        x = inputs(self.SEQ_LEN)
        out = run_in_pieces(ours, x, self.CUTS[which])
        torch.testing.assert_close(out, reference_output(reference, x), atol=TOLERANCE, rtol=0)

    def test_token_by_token_decode_matches_whole_sequence(
        self, layers: tuple[torch.nn.Module, Any]
    ) -> None:
        reference, ours = layers
        x = inputs(self.DECODE_LEN)
        out = run_in_pieces(ours, x, list(range(1, self.DECODE_LEN)))
        torch.testing.assert_close(out, reference_output(reference, x), atol=TOLERANCE, rtol=0)

    def test_resuming_from_a_snapshot_matches_whole_sequence(
        self, layers: tuple[torch.nn.Module, Any]
    ) -> None:
        reference, ours = layers
        x = inputs(self.SEQ_LEN)
        expected = reference_output(reference, x)
        with torch.no_grad():
            _, _, saved = ours.forward_sequence(
                x[: self.SNAPSHOT_PREFIX], ours.zero_state(), snapshots=self.SNAPSHOTS
            )
            for count, state in zip(self.SNAPSHOTS, saved, strict=True):
                resumed, _, _ = ours.forward_sequence(x[count:], state)
                torch.testing.assert_close(resumed, expected[count:], atol=TOLERANCE, rtol=0)

    def test_zeroed_state_at_a_chunk_boundary_is_detected(
        self, layers: tuple[torch.nn.Module, Any]
    ) -> None:
        reference, ours = layers
        x = inputs(self.SEQ_LEN)
        with torch.no_grad():
            head, _, _ = ours.forward_sequence(x[: self.SPLIT], ours.zero_state())
            tail, _, _ = ours.forward_sequence(x[self.SPLIT :], ours.zero_state())
        broken = torch.cat([head, tail])
        error = (broken - reference_output(reference, x)).abs().max().item()
        assert error > 100 * TOLERANCE

    def test_layer_snapshots_equal_states_of_a_token_by_token_run(
        self, layers: tuple[torch.nn.Module, Any]
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


def check_chunked_equals_loop(chunked: Any, loop: Any, inputs: tuple[torch.Tensor, ...]) -> None:
    """`chunked(*inputs)` (32-token chunks) against `loop(*inputs)`, both saving the state after
    50 and 64 tokens: outputs, final state and snapshots within 1e-5, all finite, and the state
    passed in (the last input) not advanced in place."""
    state = inputs[-1]
    before = state.clone()
    expected, expected_state, expected_saved = loop(*inputs, snapshots=(50, 64))
    out, final, saved = chunked(*inputs, chunk_size=32, snapshots=(50, 64))
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(final, expected_state, atol=1e-5, rtol=0)
    for got, want in zip(saved, expected_saved, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(state, before, atol=0, rtol=0)


class FakeStateContext:
    """A ForwardContext's state side for one layer: slots in a dict, calls counted. With
    `in_place`, decodes advance their SSM state where it lies (`state_views`), as the cache's
    slots do when no chunk reads another's."""

    def __init__(
        self, chunks: list, states: dict[int, dict[str, torch.Tensor]], *, in_place: bool = False
    ) -> None:
        self.chunks, self.states, self.calls = chunks, states, {"one": 0, "batch": 0}
        self.in_place = in_place

    def state_chunks(self, layer_index: int) -> list:
        return self.chunks

    def load_state(self, layer_index: int, chunk) -> dict[str, torch.Tensor]:
        self.calls["one"] += 1
        return {k: v.clone() for k, v in self.states[chunk.read_slot].items()}

    def save_state(self, layer_index: int, chunk, count: int, state) -> None:
        self.states[chunk.slots[chunk.snapshots.index(count)][0]] = state

    def load_states(self, layer_index: int, chunks: list, names=None) -> dict[str, torch.Tensor]:
        self.calls["batch"] += 1
        names = names or list(self.states[chunks[0].read_slot])
        return {k: torch.stack([self.states[c.read_slot][k] for c in chunks]) for k in names}

    def save_states(self, layer_index: int, chunks: list, states) -> None:
        for i, chunk in enumerate(chunks):
            slot = self.states.setdefault(chunk.slots[0][0], {})
            slot.update({k: v[i] for k, v in states.items()})

    def state_views(self, layer_index: int, chunks: list, name: str) -> list | None:
        if not self.in_place:
            return None
        views = []
        for chunk in chunks:
            start = self.states[chunk.read_slot][name].clone()
            views.append(self.states.setdefault(chunk.slots[0][0], {}).setdefault(name, start))
        return views

    def copy_state_views(self, layer_index: int, chunks: list, name: str) -> None:
        self.calls["views"] = self.calls.get("views", 0) + 1


def check_decodes_batched(
    ours: torch.nn.Module, *, hidden_size: int, in_place_states: int = 1
) -> None:
    """A recurrent layer's forward runs a step's decodes as one batch (one batched state load,
    or, where the states advance where they lie, none for the `in_place_states` of them that
    do) and its prefill chunk alone, each equal to the request run by itself."""
    from hybridserve.executor.torch.forward import StateChunk

    torch.manual_seed(4)
    shapes = ours.state_shapes()
    start = {s: {k: torch.randn(shape) * 0.5 for k, shape in shapes.items()} for s in (1, 2, 3)}
    # Rows 0-2: three decodes; rows 3-8: a 6-token prefill chunk saving after 6 tokens.
    chunks = [StateChunk(i, slice(i, i + 1), i + 1, (1,), ((10 + i,),)) for i in range(3)]
    chunks.append(StateChunk(3, slice(3, 9), 1, (6,), ((20,),)))
    x = torch.randn(9, hidden_size)
    for in_place in (False, True):
        ctx = FakeStateContext(chunks, dict(start), in_place=in_place)
        with torch.no_grad():
            y = ours.forward(x, ctx)  # type: ignore[arg-type]
        expected = {"one": 1, "batch": 1}
        if in_place:
            # Every state where it lies: no batched load at all.
            batch = int(in_place_states < len(ours.state_shapes()))
            expected = {"one": 1, "batch": batch, "views": in_place_states}
        assert ctx.calls == expected
        check_decodes_alone(ours, x, start, ctx, y)


def check_decodes_alone(
    ours: torch.nn.Module,
    x: torch.Tensor,
    start: dict[int, dict[str, torch.Tensor]],
    ctx: FakeStateContext,
    y: torch.Tensor,
) -> None:
    """`check_decodes_batched`'s comparisons: each decode and the prefill chunk run alone."""
    with torch.no_grad():
        for i in range(3):
            alone, state, _ = ours.forward_sequence(x[i : i + 1], start[i + 1])
            # A few float32 ulps: the output projection of three rows and of one need not sum
            # in the same order (CPUs differ: 1.1e-6 at a value of 1.5 on an AMD EPYC host).
            torch.testing.assert_close(y[i], alone[0], atol=1e-6, rtol=1e-6)
            for name in state:
                got = ctx.states[10 + i][name]
                torch.testing.assert_close(got, state[name], atol=1e-6, rtol=0, msg=name)
        prefill, state, _ = ours.forward_sequence(x[3:9], start[1])
        torch.testing.assert_close(y[3:9], prefill, atol=1e-5, rtol=0)
        torch.testing.assert_close(ctx.states[20]["conv"], state["conv"])


def check_scan_result(
    got: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]],
    want: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]],
    counts: tuple[int, ...],
) -> None:
    """A chunked scan's (outputs, final state, snapshots) equal to another's within 1e-5."""
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    assert len(got[2]) == len(counts)
    for count, a, b in zip(counts, got[2], want[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"state after {count}")


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """A list that grows by one at every call of `CpuKernels.<name>` (which still runs)."""
    calls: list[int] = []
    real = getattr(cpu_kernels.CpuKernels, name)

    def counted(self: cpu_kernels.CpuKernels, *args: object) -> object:
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(cpu_kernels.CpuKernels, name, counted)
    return calls
