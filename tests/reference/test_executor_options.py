"""Executor options: `--threads` (all cores by default, bad values named), compiled dense
layers giving the same tokens, oneDNN-packed linears (same results as `F.linear`), the reused
gather buffers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch import load_model
from hybridserve.executor.torch.executor import compile_dense_layers
from hybridserve.executor.torch.forward import GatherBuffers
from hybridserve.executor.torch.layers import packed as packed_module
from hybridserve.executor.torch.layers.mlp import GatedMLP
from hybridserve.executor.torch.layers.packed import (
    INTEL_FEW_ROWS,
    INTEL_MIN_PACKED_ROWS,
    MIN_PACKED_ROWS,
    SINGLE_ROW_ELEMENTS,
    PackedLinear,
    pack_linears,
    packing_available,
    project_qkv,
)
from hybridserve.executor.torch.runtime import set_threads
from tests.reference.helpers import hybrid_generate, make_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        architectures=["LlamaForCausalLM"],
    )
    path = tmp_path_factory.mktemp("options")
    make_checkpoint(config, path)
    return path


def test_threads_default_to_every_core_the_process_may_use() -> None:
    assert set_threads(None) == len(os.sched_getaffinity(0))
    assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    assert set_threads(1) == 1
    assert torch.get_num_threads() == 1


def test_threads_below_one_are_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--threads"):
        set_threads(0)


def test_generate_refuses_zero_threads_before_loading(folder: Path, tmp_path: Path) -> None:
    source = tmp_path / "ids.jsonl"
    source.write_text("[1, 2, 3]\n")
    result = CliRunner().invoke(
        app, ["generate", "--model", str(folder), "--token-ids", str(source), "--threads", "0"]
    )
    assert result.exit_code != 0
    assert "--threads=0" in result.output
    assert "loading" not in result.output


def test_serve_refuses_threads_for_the_simulated_executor() -> None:
    result = CliRunner().invoke(app, ["serve", "--executor", "sim", "--threads", "2"])
    assert result.exit_code != 0
    assert "--threads=2" in result.output


def test_compiled_dense_layers_give_the_same_tokens(folder: Path) -> None:
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    plain = hybrid_generate(folder, prompts, max_tokens=6)
    model = load_model(folder)
    assert compile_dense_layers(model, backend="eager") == 2 * 3 + 1  # 2 MLPs, 5 norms
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    assert len(mlps) == 2 and all(m._compiled_call_impl is not None for m in mlps)
    compiled = hybrid_generate(model, prompts, max_tokens=6)
    assert compiled.tokens == plain.tokens


def test_packed_linears_match_plain_linears_at_every_row_count() -> None:
    torch.manual_seed(0)
    plain = torch.nn.Linear(48, 40, bias=True)
    packed = torch.nn.Linear(48, 40, bias=True)
    packed.load_state_dict(plain.state_dict())
    holder = torch.nn.Sequential(packed)
    if not packing_available(packed.weight.device, packed.weight.dtype):
        pytest.skip("this torch build has no oneDNN linear packing")
    assert pack_linears(holder) == 1
    assert isinstance(holder[0], PackedLinear) and holder[0].weight is packed.weight
    for rows in (1, MIN_PACKED_ROWS, 3, 16, 128, 129, 600):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(holder(x), plain(x), atol=1e-5, rtol=0)


def _kernel_calls(layer: torch.nn.Module, rows: int, kernel: str) -> int:
    from torch.profiler import profile

    with profile() as prof:
        layer(torch.randn(rows, layer.in_features))
    return sum(e.count for e in prof.key_averages() if e.key == kernel)


def test_one_row_reads_the_packed_weight_only_of_a_large_linear() -> None:
    # The rule for CPUs other than Intel's (their BLAS reads one row of a large weight slowly).
    if not packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no oneDNN linear packing")
    packed_kernel = "mkldnn::_linear_pointwise"
    small = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    large = torch.nn.Sequential(torch.nn.Linear(512, SINGLE_ROW_ELEMENTS // 512 + 1))
    amd = "AuthenticAMD"
    assert pack_linears(small, vendor=amd) == 1 and pack_linears(large, vendor=amd) == 1
    assert _kernel_calls(small[0], 1, packed_kernel) == 0
    assert _kernel_calls(small[0], 2, packed_kernel) == 1
    assert _kernel_calls(small[0], 600, packed_kernel) == 1  # a prefill chunk reads it too
    assert _kernel_calls(large[0], 1, packed_kernel) == 1
    for rows in (1, 2):
        x = torch.randn(rows, 512)
        plain = torch.nn.functional.linear(x, large[0].weight, large[0].bias)
        torch.testing.assert_close(large(x), plain, atol=1e-5, rtol=0)


def test_on_intel_without_the_few_row_kernel_up_to_three_rows_read_the_plain_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no oneDNN linear packing")
    monkeypatch.setattr(packed_module.cpu_kernels, "load", lambda: None)
    packed_kernel = "mkldnn::_linear_pointwise"
    large = torch.nn.Sequential(torch.nn.Linear(512, SINGLE_ROW_ELEMENTS // 512 + 1))
    assert pack_linears(large, vendor="GenuineIntel") == 1
    calls = [_kernel_calls(large[0], rows, packed_kernel) for rows in (1, 2, 3, 4, 64)]
    assert calls == [0, 0, 0, 1, 1] and INTEL_MIN_PACKED_ROWS == 4


class _CountingKernels:
    """The loaded kernels with `few_rows_linear`'s row counts recorded."""

    def __init__(self, kernels: object) -> None:
        self.kernels, self.rows = kernels, []

    def few_rows_linear(self, x: torch.Tensor, *rest: object) -> object:
        self.rows.append(x.shape[0])
        return self.kernels.few_rows_linear(x, *rest)  # type: ignore[attr-defined]


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_on_intel_four_to_eight_rows_go_through_the_few_row_kernel(
    monkeypatch: pytest.MonkeyPatch, vendor: str
) -> None:
    loaded = packed_module.cpu_kernels.load()
    if not packing_available(torch.device("cpu"), torch.float32) or loaded is None:
        pytest.skip("no oneDNN linear packing or no CPU kernels here")
    if not loaded.few_rows_built:
        pytest.skip("this CPU has no AVX-512: the few-row linear kernel is not built")
    counting = _CountingKernels(loaded)
    monkeypatch.setattr(packed_module.cpu_kernels, "load", lambda: counting)
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(48, 40, bias=True))
    attention = torch.nn.Module()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, torch.nn.Linear(48, 16, bias=False))
    linear = torch.nn.functional.linear
    assert pack_linears(head, vendor=vendor) == 1 and pack_linears(attention, vendor=vendor) == 3
    sizes = (1, 3, 4, 8, 9, 64)
    for rows in sizes:  # under inference mode, as the executor runs (no gradients)
        x = torch.randn(rows, 48)
        with torch.inference_mode():
            got, fused_qkv = head(x), torch.cat(project_qkv(attention, x), dim=-1)
        torch.testing.assert_close(got, linear(x, head[0].weight, head[0].bias), atol=1e-5, rtol=0)
        unfused = torch.cat(
            [linear(x, getattr(attention, n).weight) for n in ("q_proj", "k_proj", "v_proj")], -1
        )
        torch.testing.assert_close(fused_qkv, unfused, atol=1e-5, rtol=0)
    expected = [r for r in sizes for _ in range(2) if INTEL_MIN_PACKED_ROWS <= r <= INTEL_FEW_ROWS]
    assert counting.rows == (expected if vendor == "GenuineIntel" else [])
    with torch.enable_grad():  # a product that needs gradients is left to torch
        head(torch.randn(5, 48, requires_grad=True))
    assert counting.rows == (expected if vendor == "GenuineIntel" else [])


def test_executor_packs_cpu_float32_linears_unless_told_not_to(folder: Path) -> None:
    from hybridserve.executor.torch.executor import TorchExecutor

    model = load_model(folder)
    if not packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no oneDNN linear packing")
    executor = TorchExecutor(model, num_blocks=16, block_size=4)
    # 2 layers x (4 attention + 3 MLP projections) + the output head.
    assert executor.num_packed_linears == 2 * 7 + 1
    unpacked = TorchExecutor(load_model(folder), num_blocks=16, block_size=4, packed_linears=False)
    assert unpacked.num_packed_linears == 0
    assert not any(isinstance(m, PackedLinear) for m in unpacked.model.modules())


def test_packing_fuses_qkv_and_gate_up_into_one_product_over_shared_weights(
    folder: Path,
) -> None:
    from hybridserve.executor.torch.executor import TorchExecutor
    from hybridserve.executor.torch.layers.mlp import GatedMLP
    from hybridserve.executor.torch.layers.packed import FusedProjection, fused

    if not packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no oneDNN linear packing")
    executor = TorchExecutor(load_model(folder), num_blocks=16, block_size=4)
    modules = list(executor.model.modules())
    attention = [m for m in modules if hasattr(m, "q_proj")]
    mlps = [m for m in modules if isinstance(m, GatedMLP)]
    assert len(attention) == len(mlps) == 2
    torch.manual_seed(0)
    for module, name, siblings in [
        *((m, "fused_qkv", ("q_proj", "k_proj", "v_proj")) for m in attention),
        *((m, "fused_gate_up", ("gate_proj", "up_proj")) for m in mlps),
    ]:
        projection = fused(module, name)
        assert isinstance(projection, FusedProjection)
        linears = [getattr(module, sibling) for sibling in siblings]
        # The siblings stay plain linears whose weights are views into the fused one: no copy.
        assert not any(isinstance(linear, PackedLinear) for linear in linears)
        start = projection.weight.data_ptr()
        end = start + projection.weight.numel() * projection.weight.element_size()
        assert all(start <= linear.weight.data_ptr() < end for linear in linears)
        for rows in (1, 3, 4, 64):  # F.linear under the row rule, the packed copy above it
            x = torch.randn(rows, linears[0].in_features)
            for part, linear in zip(projection(x), linears, strict=True):
                expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
                torch.testing.assert_close(part, expected, atol=1e-5, rtol=0)
    unpacked = TorchExecutor(load_model(folder), num_blocks=16, block_size=4, packed_linears=False)
    assert not any(fused(m, "fused_qkv") for m in unpacked.model.modules())


def test_packed_and_plain_linears_give_the_same_tokens(folder: Path) -> None:
    # The first step runs every prompt whole: 18 rows, packed; decodes run 5.
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [3, 4], [20, 21, 22, 23], [30, 31]]
    plain = hybrid_generate(load_model(folder), prompts, max_tokens=6, packed_linears=False)
    model = load_model(folder)
    packed = hybrid_generate(model, prompts, max_tokens=6)
    assert any(isinstance(m, PackedLinear) for m in model.modules()) == packing_available(
        torch.device("cpu"), torch.float32
    )
    assert packed.tokens == plain.tokens
    for req_id, logits in plain.logits.items():
        torch.testing.assert_close(
            torch.stack(packed.logits[req_id]), torch.stack(logits), atol=1e-5, rtol=0
        )


def test_gathers_reuse_one_buffer_and_equal_index_select_head_major() -> None:
    buffers = GatherBuffers()
    cache = torch.randn(64, 2, 8)
    first = buffers.gather("keys", cache, torch.tensor([5, 1, 9, 9]))
    torch.testing.assert_close(
        first, cache.index_select(0, torch.tensor([5, 1, 9, 9])).transpose(0, 1)
    )
    assert first.is_contiguous()  # each head's keys one [S, D] matrix
    pointer = first.data_ptr()
    second = buffers.gather("keys", cache, torch.tensor([3, 2]))  # fewer rows: same memory
    assert second.data_ptr() == pointer and second.shape == (2, 2, 8)
    torch.testing.assert_close(second, cache[[3, 2]].transpose(0, 1))
    other = buffers.gather("values", cache, torch.tensor([3, 2]))
    assert other.data_ptr() != pointer  # each role has its own buffer
    grown = buffers.gather("keys", cache, torch.arange(40))
    torch.testing.assert_close(grown, cache[:40].transpose(0, 1))
    # Grown with room to spare: a gather a few keys longer (a decode's next step) reuses it.
    longer = buffers.gather("keys", cache, torch.arange(44))
    assert longer.data_ptr() == grown.data_ptr()
    torch.testing.assert_close(longer, cache[:44].transpose(0, 1))


def test_serve_refuses_a_block_size_for_the_simulated_executor_or_below_one() -> None:
    result = CliRunner().invoke(app, ["serve", "--executor", "sim", "--block-size", "32"])
    assert result.exit_code != 0
    assert "--block-size=32" in result.output
    result = CliRunner().invoke(app, ["serve", "--executor", "torch", "--block-size", "0"])
    assert result.exit_code != 0
    assert "--block-size=0" in result.output


def test_a_warm_up_step_runs_its_tokens_and_changes_no_output(folder: Path) -> None:
    from hybridserve.executor.torch.executor import TorchExecutor

    executor = TorchExecutor(load_model(folder), num_blocks=16, block_size=4)
    # 30 tokens as prompts of 8 (8 + 8 + 8 + 6), forgotten afterwards.
    assert executor.warm_up(30, prompt_tokens=8) == 30
    assert not executor._requests and not executor._sampling and not executor._prompt_lens
    # The pool bounds it: 15 free blocks hold three 20-token prompts (5 blocks each).
    assert executor.warm_up(100, prompt_tokens=20) == 60
    assert executor.warm_up(0) == 0
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [3, 4]]
    cold = hybrid_generate(load_model(folder), prompts, max_tokens=5)
    warm = hybrid_generate(load_model(folder), prompts, max_tokens=5, warm_up_tokens=40)
    assert warm.tokens == cold.tokens
    for req_id, logits in cold.logits.items():
        torch.testing.assert_close(warm.logits[req_id], logits, atol=0, rtol=0)


def test_serve_refuses_a_negative_warm_up() -> None:
    result = CliRunner().invoke(app, ["serve", "--warm-up-tokens", "-1"])
    assert result.exit_code != 0
    assert "--warm-up-tokens=-1: use 0 (no warm-up) or more tokens" in result.output
