"""Model loading in a thread that exits: its OpenMP workers go with it, so that the thread that
runs the steps (a server's engine thread) owns the only team (libgomp throttles every team's
workers once more are alive than there are cores)."""

from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")

from hybridserve.executor.torch.runtime import in_passing_thread  # noqa: E402


def _threads() -> set[str]:
    """This process's thread ids: threads other tests left behind may exit meanwhile, so the
    test follows the ids that the loading brings, not the count."""
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_the_loading_threads_openmp_workers_exit_with_it() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = _threads()

        def parallel_work() -> set[str]:
            x = torch.randn(512, 512)
            for _ in range(4):
                x = (x @ x).tanh()
            return _threads()

        brought = in_passing_thread(parallel_work) - before
        deadline = time.monotonic() + 5
        while brought & _threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(brought) >= 2  # the loading thread and its OpenMP worker
        assert not brought & _threads()  # all of them gone
    finally:
        torch.set_num_threads(threads)


def test_a_failure_while_loading_is_raised_in_the_caller() -> None:
    def fail() -> None:
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        in_passing_thread(fail)
    assert in_passing_thread(lambda: 7) == 7
