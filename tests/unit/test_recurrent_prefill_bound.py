"""benchmarks/recurrent_prefill.py's FLOP bound: the chunked forms' matrix-product FLOPs a token
at the layer shapes it runs (golden numbers worked by hand) and the bound's arithmetic."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.benchmark_module import load_benchmark

pytest.importorskip("torch")

GATED = {"key_heads": 16, "value_heads": 32, "head_k_dim": 128, "head_v_dim": 128}
MAMBA2 = {"heads": 128, "head_dim": 64, "groups": 8, "state_size": 128}


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("recurrent_prefill")


def test_flops_a_token_at_qwen3_next_and_nemotron_h_shapes(bench: ModuleType) -> None:
    # 2 x (32 x (3 x 128 x 128 + 2 x 32 x 128) + 16 x 2 x 32 x 128) = 3,932,160
    assert bench.flops_per_token("gated_delta", GATED, 32) == 3_932_160
    # 2 x (128 x (2 x 64 x 128 + 32 x 64) + 8 x 32 x 128) = 4,784,128
    assert bench.flops_per_token("mamba2", MAMBA2, 32) == 4_784_128
    # The state's share does not shrink with the chunk: only the within-chunk terms grow.
    assert bench.flops_per_token("gated_delta", GATED, 64) > 3_932_160


def test_bound_prices_the_measured_rate_against_the_products_rate(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "product_gflops", lambda name, shape, size: 157.28640)
    row = {"shape": GATED, "chunk_size": 32, "chunked_tokens_per_s": 20_000.0}
    row["loop_tokens_per_s"] = 5_000.0
    out = bench.bound("gated_delta", row)
    assert out["chunked_bound_tokens_per_s"] == 40_000.0  # 157.2864e9 / 3,932,160
    assert out["chunked_of_bound"] == 0.5 and out["bound_speedup_vs_loop"] == 8.0
