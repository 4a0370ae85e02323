"""Reference tests run on CPU in float32 with one thread (CI has two shared cores)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the reference tests need torch (pip install .[test])")
pytest.importorskip("transformers", reason="the reference tests need transformers")

torch.set_num_threads(1)
