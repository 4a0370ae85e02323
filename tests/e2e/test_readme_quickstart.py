"""The README's quick start runs as written on a fresh checkout: its `hybridserve bench` line, in
an empty folder, with no data folder other than the repository's own (`HYBRIDSERVE_DATA` unset),
prints where it wrote its report and plots, and they are there.

The venv line of the quick start is the install `make run` does; the test checks the two agree
rather than building a second environment.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def quick_start_lines() -> list[str]:
    section = README[README.index("## Quick start") :]
    section = section[: section.index("\n## ", 3)]
    block = re.search(r"```\n(.*?)```", section, flags=re.DOTALL)
    assert block is not None, "the quick start has no command block"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def test_the_quick_start_installs_what_make_run_installs() -> None:
    install = quick_start_lines()[0]
    extras = re.search(r"-e '\.\[([a-z,]+)\]'", install)
    assert extras is not None, install
    makefile = (ROOT / "Makefile").read_text()
    assert f"-e '.[{extras.group(1)}]'" in makefile, "the quick start and `make run` differ"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX paths in the README")
def test_the_quick_start_bench_runs_as_written_and_writes_its_report(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the quick start installs the sim extra")
    command = quick_start_lines()[1]
    argv = shlex.split(command)
    assert argv[0] == ".venv/bin/hybridserve", command
    argv[0] = str(Path(sys.executable).with_name("hybridserve"))
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDSERVE_DATA"}
    env["COLUMNS"] = "200"
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    files = re.search(r"files: (.+)", done.stdout.replace("\n", " "))
    assert files is not None, done.stdout[-2000:]
    folder = tmp_path / "runs"
    (run,) = list(folder.iterdir())
    written = {p.name for p in run.iterdir()}
    assert {"report.json", "itl_cdf.png", "ttft_cdf.png", "goodput.png", "timeline.png"} <= written
    assert str(run.relative_to(tmp_path)) in done.stdout
    report = json.loads((run / "report.json").read_text())
    ratio = report["ratios"]["job_goodput"]
    lo, hi = ratio["ci95"]
    assert lo <= ratio["mean"] <= hi
    assert len(ratio["per_seed"]) >= 2  # a CI needs paired seeds
    assert "baseline (vllm)" in done.stdout and "hybridserve" in done.stdout
