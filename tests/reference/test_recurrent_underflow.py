"""The recurrent scans on decays that underflow float32: a decay below exp(LOG_DECAY_FLOOR) is
exactly zero, so no operation of a scan or a decode step ever sees a subnormal float (on which
an x86 CPU takes a slow path for every operation), and the results still equal the token loop."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hybridserve.executor.torch import cpu_kernels
from hybridserve.executor.torch.layers import gated_delta
from hybridserve.executor.torch.layers.gated_delta import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_step_in_place,
    unit_lower_inverse,
)
from hybridserve.executor.torch.layers.mamba2 import ssd_chunked, ssd_recurrent, ssd_step_in_place
from hybridserve.executor.torch.layers.recurrence import (
    LOG_DECAY_FLOOR,
    decay_exp,
    decay_within_chunks,
)

TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32


def _subnormals(value: Any) -> int:
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        magnitude = value.detach().abs()
        return int(((magnitude > 0) & (magnitude < TINY)).sum())
    if isinstance(value, list | tuple):
        return sum(_subnormals(item) for item in value)
    return 0


class SubnormalWatch(TorchFunctionMode):
    """Counts, per torch operation, the subnormal floats among its tensor inputs and results."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, int] = {}
        self.paused = False

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.paused:
            return result
        count = _subnormals(list(args)) + _subnormals(list(kwargs.values())) + _subnormals(result)
        if count:
            name = getattr(func, "__name__", str(func))
            self.seen[name] = self.seen.get(name, 0) + count
        return result


@pytest.fixture(autouse=True)
def uninitialized_memory_is_nan() -> Iterator[None]:
    """Fresh buffers (`new_empty`) hold NaN, not whatever bits were there (which can read as
    subnormal floats before the scan writes them)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def test_a_decay_below_the_floor_is_exactly_zero() -> None:
    logs = torch.tensor([-200.0, LOG_DECAY_FLOOR - 0.5, LOG_DECAY_FLOOR + 0.5, -1.0, 0.0])
    expected = [0.0, 0.0, math.exp(LOG_DECAY_FLOOR + 0.5), math.exp(-1.0), 1.0]
    torch.testing.assert_close(decay_exp(logs), torch.tensor(expected), rtol=1e-6, atol=0)
    cum = torch.tensor([0.0, -30.0, -70.0, -200.0])
    within = decay_within_chunks(cum)
    expected_within = torch.tensor(
        [
            [1.0, 0.0, 0.0, 0.0],
            [math.exp(-30.0), 1.0, 0.0, 0.0],
            [0.0, math.exp(-40.0), 1.0, 0.0],  # exp(-70) is below the floor
            [0.0, 0.0, 0.0, 1.0],
        ]
    )
    torch.testing.assert_close(within, expected_within, rtol=1e-6, atol=0)


def _fast_decay_scan_inputs(length: int) -> tuple[torch.Tensor, ...]:
    """Mamba2 inputs for 4 heads whose per-token log decays dt * a are a real model's (-1.6 to
    -0.05), cross the floor inside a chunk (-20 to -10) and reach a random checkpoint's (-100
    to -50)."""
    generator = torch.Generator().manual_seed(11)
    heads, head_dim, state_size = 4, 8, 16
    x = torch.randn(length, heads, head_dim, generator=generator)
    dt = torch.rand(length, heads, generator=generator) * 0.05 + 0.05
    a = torch.tensor([-1.0, -16.0, -200.0, -1000.0])
    b = torch.randn(length, 1, state_size, generator=generator)
    c = torch.randn(length, 1, state_size, generator=generator)
    state = torch.randn(heads, head_dim, state_size, generator=generator)
    return x, dt, a, b, c, state


def test_mamba2_scan_and_step_on_underflowing_decays_see_no_subnormal_float(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # the step's torch form, watched
    x, dt, a, b, c, state = _fast_decay_scan_inputs(200)
    assert float((dt * a).min()) < -90.0 < LOG_DECAY_FLOOR  # decays that underflow float32
    snapshots = (7, 64, 100)
    with SubnormalWatch() as watch:
        out, final, saved = ssd_chunked(x, dt, a, b, c, state, chunk_size=32, snapshots=snapshots)
        steps = [s.clone() for s in (state, state)]
        ssd_step_in_place(x[:2], dt[:2], a, b[:2], c[:2], steps)
    assert watch.seen == {}
    _check_equal((out, final, saved), ssd_recurrent(x, dt, a, b, c, state, snapshots=snapshots))


def _check_equal(chunked: tuple[Any, ...], loop: tuple[Any, ...]) -> None:
    """A chunked scan's (outputs, final state, snapshots) equal the token loop's (1e-5)."""
    (out, final, saved), (expected, expected_final, expected_saved) = chunked, loop
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(final, expected_final, atol=1e-5, rtol=0)
    for got, want in zip(saved, expected_saved, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_gated_delta_rule_and_step_on_underflowing_decays_see_no_subnormal_float(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Inside the UT transform's inverse, products of decays each above the floor can still
    # underflow (a path's decays multiply to one below it); the transform's entries whose
    # decay is below the floor are zeroed as it returns, so nothing after it sees them.
    watch = SubnormalWatch()

    def inverse_unwatched(lower: torch.Tensor) -> torch.Tensor:
        watch.paused = True
        try:
            return unit_lower_inverse(lower)
        finally:
            watch.paused = False

    monkeypatch.setattr(gated_delta, "unit_lower_inverse", inverse_unwatched)
    generator = torch.Generator().manual_seed(12)
    length, heads, dk, dv = 200, 4, 8, 8
    q = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=generator), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=generator), dim=-1)
    v = torch.randn(length, heads, dv, generator=generator)
    # Per-token log decays as in the Mamba2 test: a real model's, crossing the floor inside a
    # chunk, a random checkpoint's.
    rates = torch.tensor([1.0, 16.0, 200.0, 1000.0])
    g = -(torch.rand(length, heads, generator=generator) * 0.05 + 0.05) * rates
    beta = torch.rand(length, heads, generator=generator)
    state = torch.randn(heads, dk, dv, generator=generator)
    snapshots = (7, 64, 100)
    with watch:
        out, final, saved = gated_delta_rule_chunked(
            q, k, v, g, beta, state, chunk_size=32, snapshots=snapshots
        )
        steps = [s.clone() for s in (state, state)]
        gated_delta_step_in_place(q[:2], k[:2], v[:2], g[:2], beta[:2], steps)
    assert watch.seen == {}
    loop = gated_delta_rule_recurrent(q, k, v, g, beta, state, snapshots=snapshots)
    _check_equal((out, final, saved), loop)


def test_the_watch_sees_a_subnormal_float() -> None:
    # The watch itself: exp(-100) ~ 3.7e-44 is past float32's normal range.
    with SubnormalWatch() as watch:
        torch.tensor([-100.0, 0.0]).exp()
    assert watch.seen.get("exp", 0) == 1
