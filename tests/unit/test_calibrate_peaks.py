"""A CPU calibration's peaks are read between its rounds of steps, and the best of each rate is
kept: one reading slowed by load does not cap every fitted rate."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridserve.executor.torch.calibrate import (  # noqa: E402
    DevicePeaks,
    _stream_bytes_per_s,
    best_peaks,
    measure_steps,
)


class _Timer:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def time(self, shape: object, *, repeats: int) -> list[float]:
        self.calls.append("step")
        return [0.01 * repeats]


def test_peaks_are_read_before_every_round_and_after_the_last() -> None:
    torch.set_num_threads(1)
    timer = _Timer()
    measure_steps(
        timer,  # type: ignore[arg-type]
        [[(1, 10, 0)], [(4, 0, 0)]],
        rounds=3,
        repeats=1,
        between_rounds=lambda: timer.calls.append("peaks"),
    )
    assert timer.calls == ["peaks", "step", "step"] * 3 + ["peaks"]


def test_the_best_of_each_rate_is_kept() -> None:
    slow = DevicePeaks(fp32_flops=1.26e11, bf16_flops=3e11, copy_bytes_per_s=3.4e10, memory_bytes=8)
    fast = DevicePeaks(fp32_flops=1.94e11, bf16_flops=2e11, copy_bytes_per_s=3.0e10, memory_bytes=8)
    best = best_peaks([slow, fast])
    assert (best.fp32_flops, best.bf16_flops, best.copy_bytes_per_s) == (1.94e11, 3e11, 3.4e10)
    assert best_peaks([slow]) == slow
    with pytest.raises(ValueError, match="at least one reading"):
        best_peaks([])


def test_the_best_weight_stream_is_kept_and_an_unread_one_stays_unread() -> None:
    read = DevicePeaks(
        fp32_flops=1, bf16_flops=1, copy_bytes_per_s=1, memory_bytes=8,
        fp32_stream_bytes_per_s=2.1e10, bf16_stream_bytes_per_s=None,
    )  # fmt: skip
    better = DevicePeaks(
        fp32_flops=1, bf16_flops=1, copy_bytes_per_s=1, memory_bytes=8,
        fp32_stream_bytes_per_s=2.4e10, bf16_stream_bytes_per_s=None,
    )  # fmt: skip
    best = best_peaks([read, better])
    assert (best.fp32_stream_bytes_per_s, best.bf16_stream_bytes_per_s) == (2.4e10, None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_weight_stream_counts_the_matrix_bytes_one_row_reads(dtype: str) -> None:
    torch.set_num_threads(1)
    ticks = iter(range(100))  # every timed call takes one "second"
    rate = _stream_bytes_per_s(
        torch.device("cpu"), getattr(torch, dtype), 2, lambda: float(next(ticks)), 1 << 22
    )
    assert rate == 1 << 22  # 4 MiB of weights in one second, whatever the dtype
