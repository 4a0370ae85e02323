"""The repository stands on its own: its data/ folder holds what the tests and default commands
read, `HYBRIDSERVE_DATA` points elsewhere, and nothing reads a folder outside the checkout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridserve.cli.app import default_trace_path
from hybridserve.core.paths import DATA_ENV, REPO_DATA_DIR, data_dir, data_path

ROOT = Path(__file__).resolve().parents[2]


def test_data_folder_defaults_to_the_repository_data_folder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(DATA_ENV, raising=False)
    assert data_dir() == ROOT / "data" == REPO_DATA_DIR
    assert default_trace_path() == ROOT / "data" / "traces" / "conversation_trace.jsonl"


def test_environment_variable_points_the_data_folder_elsewhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert data_path("traces", "x.jsonl") == tmp_path / "traces" / "x.jsonl"
    assert default_trace_path() is None  # no trace there: cache-replay falls back to synthetic
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "conversation_trace.jsonl").write_text("")
    assert default_trace_path() == tmp_path / "traces" / "conversation_trace.jsonl"


def test_every_file_the_data_readme_lists_is_shipped() -> None:
    readme = (ROOT / "data" / "README.md").read_text()
    names = set(re.findall(r"^\| `([\w.-]+)`", readme, flags=re.MULTILINE))
    assert {"conversation_trace.jsonl", "burst_agents_fa16", "priority_fa16"} <= names
    shipped = {p.name for p in (ROOT / "data").rglob("*")} | {
        p.stem for p in (ROOT / "data").rglob("*.jsonl")
    }
    assert names <= shipped, sorted(names - shipped)
    for required in ("vllm-recordings/FORMAT.md", "gpu-datasheets.json", "gpu-measurements.json"):
        assert (ROOT / "data" / required).is_file(), required
    assert "licence" in readme.lower() and "do not copy" not in readme.lower()


def test_nothing_in_the_repository_reads_a_folder_beside_the_checkout() -> None:
    outside = re.compile(r"\.\./shared|parents\[[2-9]\] / \"shared\"|\"shared\" / \"data\"")
    offenders = []
    for folder in ("hybridserve", "tests", "benchmarks", "docs"):
        for path in (ROOT / folder).rglob("*"):
            readable = path.suffix in {".py", ".md", ".toml"} and path != Path(__file__)
            if readable and outside.search(path.read_text(encoding="utf-8")):
                offenders.append(str(path.relative_to(ROOT)))
    for name in ("README.md", "Makefile", "pyproject.toml"):
        if outside.search((ROOT / name).read_text(encoding="utf-8")):
            offenders.append(name)
    assert offenders == []
