"""Reference tests run on CPU in float32 with one thread (CI has two shared cores)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the reference tests need torch (pip install .[test])")
pytest.importorskip("transformers", reason="the reference tests need transformers")

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> object:
    """CLI commands set torch's threads to every core by default; later tests keep one."""
    yield
    torch.set_num_threads(1)
