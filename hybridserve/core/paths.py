"""Where the data the tests, benchmarks and default commands read lives.

The repository ships it in `data/` (traces, vLLM recordings, GPU datasheets and measurements;
`data/README.md` gives sources and licences). `HYBRIDSERVE_DATA` points at another folder of
the same layout, for an installed package or a larger copy.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "HYBRIDSERVE_DATA"
REPO_DATA_DIR = Path(__file__).resolve().parents[2] / "data"


def data_dir() -> Path:
    """`$HYBRIDSERVE_DATA` when set (and not empty), else the repository's `data/` folder."""
    override = os.environ.get(DATA_ENV, "").strip()
    return Path(override).expanduser() if override else REPO_DATA_DIR


def data_path(*parts: str) -> Path:
    """A path under the data folder (it may not exist: the caller says what is missing)."""
    return data_dir().joinpath(*parts)
