"""The parallel tests share two CPU cores with everything else: one thread per process."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the parallel tests need the torch extra")
torch.set_num_threads(1)
