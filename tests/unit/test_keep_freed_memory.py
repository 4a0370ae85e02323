"""The torch executor's CPU processes keep freed memory for reuse: a freed 64 MiB tensor's pages
stay with the process (glibc would unmap them, and the next tensor of that size would fault
every page in again), and the switch turns it off. Each case runs in a process of its own: the
allocator's policy is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
import torch
from hybridserve.executor.torch.runtime import keep_freed_memory

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

kept = keep_freed_memory()
t = torch.ones(16 * 2**20)  # 64 MiB, every page touched
held = rss()
del t
print(json.dumps({"kept": kept, "returned_mib": (held - rss()) / 2**20}))
"""


def _probe(switch: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDSERVE_KEEP_FREED_MEMORY"}
    if switch is not None:
        env["HYBRIDSERVE_KEEP_FREED_MEMORY"] = switch
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(
    not os.path.exists("/proc/self/status") or not sys.platform.startswith("linux"),
    reason="reads the resident set from /proc (glibc)",
)
def test_a_freed_tensor_stays_with_the_process_unless_switched_off() -> None:
    on, off = _probe(None), _probe("0")
    assert on["kept"] is True and off["kept"] is False
    assert isinstance(on["returned_mib"], float) and isinstance(off["returned_mib"], float)
    assert on["returned_mib"] < 8, on  # kept for the next tensor
    assert off["returned_mib"] > 56, off  # glibc's default: unmapped on free
