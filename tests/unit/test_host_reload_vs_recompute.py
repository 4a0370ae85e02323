"""benchmarks/host_reload_vs_recompute.py: a reload's price is the link arithmetic, and on
every model and GPU of the catalog recomputing costs more than reloading (the host tier's
"always reload" rests on it)."""

from __future__ import annotations

from types import ModuleType

import pytest

from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.gpus import GPUS
from hybridserve.sim.model_profiles import MODELS
from hybridserve.sim.run import simulated_host_link
from tests.benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("host_reload_vs_recompute")


def test_a_reload_is_the_blocks_bytes_over_the_links_measured_rate(bench: ModuleType) -> None:
    row = bench._row("llama-3.1-8b", "H200", tokens=2_000, context=0)
    assert row["tokens"] == 2_000 and row["blocks"] == 125  # 16-token blocks, one group
    link, _ = simulated_host_link(
        SimConfig(model="llama-3.1-8b", gpu="H200", preset="baseline", host_memory_gib=1)
    )
    # 32 layers x 8 KV heads x 128 x K and V x 2 bytes x 16 tokens = 2 MiB a block
    assert link.bytes_per_block == 32 * 8 * 128 * 2 * 2 * 16
    expected_ms = 125 * link.bytes_per_block / (64e9 * 50 / 64) * 1e3
    assert row["reload_ms"] == pytest.approx(expected_ms, abs=1e-3)


def test_recomputing_costs_more_than_reloading_on_every_catalog_gpu_and_model(
    bench: ModuleType,
) -> None:
    rows = [bench._row(model, gpu, tokens=2_048, context=0) for model in MODELS for gpu in GPUS]
    assert all(row is not None for row in rows)  # an A100 runs bf16: every pair is served
    assert all(row["ratio"] > 1.0 for row in rows if row is not None)
