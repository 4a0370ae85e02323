"""The torch timer's shared-prefix shapes (`calibrate --decode-shared-fraction`): the requests'
tables begin with the same blocks, then blocks of their own; a prefix that is not whole
blocks, or longer than a context, is refused naming the shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.calibrate import StepTimer, executor_for
from hybridserve.executor.torch.loader import load_model
from hybridserve.sim.calibration_fit import Grid, request_tokens


def test_a_shared_prefix_shape_gives_every_request_the_same_first_blocks(
    calib_checkpoint: Path,
) -> None:
    model = load_model(calib_checkpoint, dtype=torch.float32)
    executor = executor_for(model, max_tokens=4 * 130, max_requests=4, device="cpu")
    timer = StepTimer(executor, vocab_size=4096, seed=0)
    grid = Grid(decode_batches=(4,), decode_context_tokens=(128,), decode_shared_fraction=0.5)
    shape = request_tokens(grid.shapes()[-1])
    assert shape == [(1, 128, 64)] * 4
    chunks = timer._chunks(shape)
    tables = [chunk.block_ids[0] for chunk in chunks]
    assert {t[:4] for t in tables} == {(1, 2, 3, 4)}  # 64 tokens: 4 shared blocks
    own = [b for t in tables for b in t[4:]]
    assert len(own) == len(set(own)) == 4 * 5  # 129 tokens a request: 9 blocks, 5 its own
    assert all(s > 0 for s in timer.time(shape, repeats=1))  # the executor runs it
    for bad in ([(1, 128, 60)] * 2, [(1, 32, 64)] * 2):
        with pytest.raises(ConfigError, match="whole blocks"):
            timer._chunks(bad)
