"""The CPU paged decode kernel: against gather-and-softmax on random paged caches, through the
attention metadata and ForwardContext against the gather path, and its build's fallbacks."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.executor.torch import cpu_kernels
from hybridserve.executor.torch.forward import ChunkSpan, ForwardContext, build_attention_meta

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.CpuKernels:
    loaded = cpu_kernels.load()
    if loaded is None:
        pytest.skip("no C compiler here for the CPU paged decode kernel")
    return loaded


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lows: list[int],
    ends: list[int],
    block_size: int,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    out = []
    group = q.shape[1] // k.shape[1]
    for b, (low, end) in enumerate(zip(lows, ends, strict=True)):
        pos = torch.arange(low, end)
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        kb = k[slots].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, K, D]
        vb = v[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.einsum("hd,hkd->hk", q[b].double(), kb.double()) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out.append(torch.einsum("hk,hkd->hd", torch.softmax(scores, -1), vb.double()))
    return torch.stack(out).float()


@settings(max_examples=40, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 3, 4, 9, 17]),
    dim=st.sampled_from([8, 24, 64, 256]),
    dim_v=st.sampled_from([None, 16]),
    block_size=st.sampled_from([1, 5, 16]),
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=5),
    window=st.sampled_from([None, 1, 7, 33]),
    softcap=st.sampled_from([None, 5.0]),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_equals_softmax_attention_over_the_gathered_keys(
    kernel: cpu_kernels.CpuKernels,
    kv_heads: int,
    group: int,
    dim: int,
    dim_v: int | None,
    block_size: int,
    lengths: list[int],
    window: int | None,
    softcap: float | None,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    per_request = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_request) + 3
    # Blocks in a shuffled order (no request's blocks consecutive by chance), block 0 unused.
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(per_request)
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(per_request):
        tables[b, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    slots = num_blocks * block_size
    # K and V are views into wider rows (the last dimension dense, the others strided).
    k = torch.randn(slots, kv_heads + 1, dim, generator=gen)[:, 1:]
    v = torch.randn(slots, kv_heads, dim_v or dim, generator=gen) * 3
    q = torch.randn(len(lengths), kv_heads * group, dim, generator=gen)
    ends = lengths
    lows = [max(0, n - window) if window else 0 for n in lengths]
    end_t, low_t = torch.tensor(ends), torch.tensor(lows)
    order = torch.argsort(end_t - low_t, descending=True, stable=True)
    scale = dim**-0.5 * 2
    got = kernel.paged_decode(
        q, k, v, tables, low_t, end_t, order, block_size=block_size, scale=scale, softcap=softcap
    )
    want = _reference(q, k, v, tables, lows, ends, block_size, scale, softcap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("low", "end", "softcap"), [(0, 300, None), (37, 300, 5.0), (0, 127, None)]
)
def test_a_lone_decode_split_across_threads_equals_the_softmax_over_its_keys(
    kernel: cpu_kernels.CpuKernels, low: int, end: int, softcap: float | None
) -> None:
    # One request with one KV head is one job: with two threads its positions are split in two
    # parts whose partial softmaxes are merged (127 positions: too few to split).
    gen = torch.Generator().manual_seed(5)
    block_size, blocks = 16, 20
    tables = (torch.randperm(blocks, generator=gen)).view(1, blocks)
    k = torch.randn(blocks * block_size, 1, 64, generator=gen)
    v = torch.randn(blocks * block_size, 1, 64, generator=gen)
    q = torch.randn(1, 4, 64, generator=gen) * 3
    lows, ends = torch.tensor([low]), torch.tensor([end])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = kernel.paged_decode(
            q, k, v, tables, lows, ends, torch.tensor([0]), block_size=16, scale=0.125,
            softcap=softcap,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    want = _reference(q, k, v, tables, [low], [end], block_size, 0.125, softcap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def _mixed_step(paged: bool, window: int | None) -> tuple[torch.Tensor, ForwardContext]:
    """One step of two prefill chunks and three decodes (one past a block boundary, one of a
    single token) over a paged cache holding their earlier tokens."""
    gen = torch.Generator().manual_seed(3)
    block, kv_heads, heads, dim = 4, 2, 6, 16
    spans = [
        ChunkSpan(0, 1, 9, (5, 2, 7)),
        ChunkSpan(1, 6, 3, (3, 9)),
        ChunkSpan(7, 1, 4, (1, 4)),
        ChunkSpan(8, 5, 0, (6, 8)),
        ChunkSpan(13, 1, 0, (10,)),
    ]
    meta = build_attention_meta(
        spans, block_size=block, window=window, device=torch.device("cpu"), paged_decodes=paged
    )

    class Cache:
        k = torch.randn(11 * block, kv_heads, dim, generator=gen)
        v = torch.randn(11 * block, kv_heads, dim, generator=gen)

        def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.k, self.v

    ctx = ForwardContext(
        Cache(),  # type: ignore[arg-type]
        layer_group=[0],
        attention={0: meta},
        states={},
        num_tokens=14,
    )
    q = torch.randn(14, heads, dim, generator=gen)
    k = torch.randn(14, kv_heads, dim, generator=gen)
    v = torch.randn(14, kv_heads, dim, generator=gen)
    return ctx.attention(0, q, k, v, scale=0.25), ctx


@pytest.mark.parametrize("window", [None, 3])
def test_decodes_attend_in_place_and_match_the_gather_path(
    kernel: cpu_kernels.CpuKernels, window: int | None
) -> None:
    paged, paged_ctx = _mixed_step(True, window)
    gathered, gather_ctx = _mixed_step(False, window)
    torch.testing.assert_close(paged, gathered, atol=1e-5, rtol=1e-5)
    # The decodes gather nothing: only the two prefill chunks' keys are gathered. Under the
    # window of 3 (pieces of 2 queries), the 5-token chunk's last piece is one query too.
    meta = paged_ctx.attention_meta[0]
    rows = [0, 7, 13] if window is None else [0, 7, 12, 13]
    assert meta.decodes is not None and meta.decodes.rows.tolist() == rows
    assert all(c.num_queries > 1 for c in meta.calls)
    assert paged_ctx.gathered_keys < gather_ctx.gathered_keys


def _composite_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool
) -> torch.Tensor:
    h = x.double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * ((1.0 + weight.double()) if offset else weight.double())).float()


@settings(max_examples=30, deadline=None)
@given(
    shape=st.sampled_from([(1, 640), (3, 4, 256), (0, 8), (7, 1), (300, 576), (2, 5, 33)]),
    offset=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_norm_kernel_equals_the_textbook_rms_norm(
    kernel: cpu_kernels.CpuKernels,
    shape: tuple[int, ...],
    offset: bool,
    strided: bool,
    seed: int,
) -> None:
    # 300 x 576 runs its rows on the threads; a strided input is made contiguous first.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape[:-1], shape[-1] * 2, generator=gen) * 3
    x = x[..., ::2] if strided else x[..., : shape[-1]]
    weight = torch.randn(shape[-1], generator=gen)
    got = kernel.rms_norm(x, weight, 1e-6, offset)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, _composite_norm(x, weight, 1e-6, offset), atol=1e-5, rtol=1e-5)


def test_the_norm_layer_runs_the_kernel_and_its_torch_form_agrees(
    kernel: cpu_kernels.CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridserve.executor.torch.layers.norm import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6, offset=True)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(5, 64)
    calls: list[int] = []
    original = kernel.rms_norm

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel, "rms_norm", counted)
    with torch.no_grad():
        fast = norm(x)
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
        plain = norm(x)
    assert calls == [1]
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(
    rows=st.sampled_from([0, 1, 3, 40]),
    inter=st.sampled_from([1, 17, 64, 2048]),
    activation=st.sampled_from(["gelu_pytorch_tanh", "gelu_new", "silu"]),
    seed=st.integers(0, 2**16),
)
def test_the_activation_product_kernel_equals_torchs_gate_activation_times_up(
    kernel: cpu_kernels.CpuKernels, rows: int, inter: int, activation: str, seed: int
) -> None:
    from hybridserve.executor.torch.layers.mlp import activation as torch_activation

    # 40 x 2048 runs its rows on the threads.
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(seed)) * 4
    got = kernel.act_mul(gate_up, activation)
    assert got is not None and got.shape == (rows, inter) and got.is_contiguous()
    expected = torch_activation(activation)(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_activation_product_kernel_leaves_other_activations_to_torch(
    kernel: cpu_kernels.CpuKernels,
) -> None:
    assert kernel.act_mul(torch.randn(2, 8), "gelu") is None  # the erf GELU: not in the kernel
    assert kernel.act_mul(torch.randn(2, 8), "relu") is None


def test_a_fused_mlp_runs_the_activation_kernel_and_its_torch_form_agrees(
    kernel: cpu_kernels.CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridserve.executor.torch.layers.mlp import GatedMLP
    from hybridserve.executor.torch.layers.packed import fused, pack_linears, packing_available

    if not packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no oneDNN linear packing")
    torch.manual_seed(0)
    mlp = GatedMLP(32, 48, "gelu_pytorch_tanh").eval()
    x = torch.randn(6, 32)
    with torch.no_grad():
        reference = mlp(x)  # separate projections, the in-place torch activation
    assert pack_linears(mlp) == 3 and fused(mlp, "fused_gate_up") is not None
    _check_runs_the_activation_kernel_once(kernel, monkeypatch, mlp, x, reference)


def _check_runs_the_activation_kernel_once(
    kernel: cpu_kernels.CpuKernels,
    monkeypatch: pytest.MonkeyPatch,
    mlp: torch.nn.Module,
    x: torch.Tensor,
    reference: torch.Tensor,
) -> None:
    """`mlp(x)` calls `act_mul` once, and it and the torch form (no kernels) equal `reference`."""
    calls: list[int] = []
    original = kernel.act_mul

    def counted(*args: object, **kwargs: object) -> torch.Tensor | None:
        calls.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    with torch.no_grad():
        monkeypatch.setattr(kernel, "act_mul", counted)
        fast = mlp(x)
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
        plain = mlp(x)
    assert calls == [1]
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, reference, atol=1e-5, rtol=1e-5)


def test_granites_shared_mlp_runs_the_activation_kernel_and_its_torch_form_agrees(
    kernel: cpu_kernels.CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridserve.executor.torch.models.granite_hybrid import SharedMLP

    torch.manual_seed(0)
    mlp = SharedMLP(32, 48, "silu").eval()
    x = torch.randn(6, 32)
    with torch.no_grad():
        gate, up = torch.nn.functional.linear(x, mlp.input_linear.weight).chunk(2, dim=-1)
        reference = torch.nn.functional.linear(
            torch.nn.functional.silu(gate) * up, mlp.output_linear.weight
        )
    _check_runs_the_activation_kernel_once(kernel, monkeypatch, mlp, x, reference)


def _ssm_step_inputs(
    batch: int, heads: int, groups: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list]:
    gen = torch.Generator().manual_seed(seed)
    head_dim, state_size = 8, 16
    x = torch.randn(batch, heads, head_dim, generator=gen)
    dt = torch.rand(batch, heads, generator=gen) * 2.0
    a = -torch.rand(heads, generator=gen) * 60.0  # some decays below the floor: exactly zero
    b = torch.randn(batch, groups, state_size, generator=gen)
    c = torch.randn(batch, groups, state_size, generator=gen)
    states = [torch.randn(heads, head_dim, state_size, generator=gen) for _ in range(batch)]
    return x, dt, a, b, c, states


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 9),
    groups_and_ratio=st.sampled_from([(1, 1), (1, 4), (2, 2), (4, 1), (2, 16)]),
    seed=st.integers(0, 1000),
)
def test_the_ssm_step_kernel_equals_the_torch_step(
    kernel: cpu_kernels.CpuKernels, batch: int, groups_and_ratio: tuple[int, int], seed: int
) -> None:
    from hybridserve.executor.torch.layers import mamba2

    groups, ratio = groups_and_ratio  # 2 x 16 heads x 8 requests runs on the threads
    x, dt, a, b, c, states = _ssm_step_inputs(batch, groups * ratio, groups, seed)
    fast_states = [s.clone() for s in states]
    calls: list[int] = []
    original = kernel.ssm_step

    def counted(*args: object) -> torch.Tensor | None:
        calls.append(1)
        return original(*args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel, "ssm_step", counted)
        fast = mamba2.ssd_step_in_place(x, dt, a, b, c, fast_states)
        patch.setattr(cpu_kernels, "load", lambda: None)
        plain = mamba2.ssd_step_in_place(x, dt, a, b, c, states)
    assert calls == [1]
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
    for got, want in zip(fast_states, states, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_ssm_step_kernel_leaves_states_it_cannot_read_to_torch(
    kernel: cpu_kernels.CpuKernels,
) -> None:
    x, dt, a, b, c, states = _ssm_step_inputs(2, 4, 2, seed=0)
    strided = [s.transpose(1, 2).contiguous().transpose(1, 2) for s in states]  # not dense
    before = [s.clone() for s in strided]
    decay, xdt = torch.exp(dt * a), dt[:, :, None] * x
    assert kernel.ssm_step(strided, decay, xdt, b, c) is None
    assert kernel.ssm_step([s.double() for s in states], decay, xdt, b, c) is None
    assert kernel.ssm_step(states[:1], decay, xdt, b, c) is None  # one state for two requests
    assert all(torch.equal(s, t) for s, t in zip(strided, before, strict=True))


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 9),
    channels=st.sampled_from([1, 5, 64, 2304]),
    width=st.integers(1, 5),
    with_bias=st.booleans(),
    act=st.sampled_from([None, "silu"]),
    seed=st.integers(0, 1000),
)
def test_the_conv_step_kernel_equals_the_torch_conv_step(
    kernel: cpu_kernels.CpuKernels,
    batch: int,
    channels: int,
    width: int,
    with_bias: bool,
    act: str | None,
    seed: int,
) -> None:
    from hybridserve.executor.torch.layers.recurrence import conv_step

    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(batch, channels + 3, generator=gen)
    x = rows[:, 2 : 2 + channels]  # rows of a wider projection, as the layer's are
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen) if with_bias else None
    states = [torch.randn(channels, width - 1, generator=gen) for _ in range(batch)]
    expected, expected_states = conv_step(x, torch.stack(states), weight, bias)
    if act == "silu":
        expected = torch.nn.functional.silu(expected)
    got = kernel.conv_step(states, x, weight, bias, act)
    assert got is not None
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(states), expected_states, atol=0, rtol=0)


def test_the_conv_step_kernel_leaves_what_it_cannot_run_to_torch(
    kernel: cpu_kernels.CpuKernels,
) -> None:
    x, weight = torch.randn(2, 6), torch.randn(6, 4)
    states = [torch.randn(6, 3) for _ in range(2)]
    before = [s.clone() for s in states]
    assert kernel.conv_step(states, x, weight, None, "gelu") is None  # not in the kernel
    assert kernel.conv_step(states, x.double(), weight, None, None) is None
    assert kernel.conv_step([s.t().contiguous().t() for s in states], x, weight, None, None) is None
    assert kernel.conv_step(states[:1], x, weight, None, None) is None
    assert all(torch.equal(s, t) for s, t in zip(states, before, strict=True))


@pytest.fixture(scope="module")
def few_rows(kernel: cpu_kernels.CpuKernels) -> cpu_kernels.CpuKernels:
    if not kernel.few_rows_built:
        pytest.skip("this CPU has no AVX-512: the few-row linear kernel is not built")
    return kernel


def _few_rows_on(
    threads: int,
    kernels: cpu_kernels.CpuKernels,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The kernel's product on `threads` threads (the tests' one thread restored after)."""
    torch.set_num_threads(threads)
    try:
        got = kernels.few_rows_linear(x, weight, bias)
    finally:
        torch.set_num_threads(1)
    assert got is not None
    return got


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 19),
    in_features=st.integers(1, 80),
    out_features=st.integers(1, 23),
    with_bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_the_few_rows_linear_equals_torchs_linear(
    few_rows: cpu_kernels.CpuKernels,
    rows: int,
    in_features: int,
    out_features: int,
    with_bias: bool,
    threads: int,
    seed: int,
) -> None:
    # Row counts past one block of 8, widths not a multiple of 16 (the masked columns), output
    # counts not a multiple of the 4-row tile.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    expected = torch.nn.functional.linear(
        x.double(), weight.double(), None if bias is None else bias.double()
    ).float()
    got = _few_rows_on(threads, few_rows, x, weight, bias)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_the_few_rows_linear_splits_a_large_weight_across_threads(
    few_rows: cpu_kernels.CpuKernels,
) -> None:
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(8, 1_000, generator=gen), torch.randn(1_030, 1_000, generator=gen)
    expected = (x.double() @ weight.double().T).float()
    got = _few_rows_on(2, few_rows, x, weight, None)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-5)


def test_the_few_rows_linear_leaves_what_it_cannot_read_to_torch(
    few_rows: cpu_kernels.CpuKernels,
) -> None:
    x, weight, bias = torch.randn(3, 32), torch.randn(20, 32), torch.randn(20)
    assert few_rows.few_rows_linear(x.double(), weight, None) is None
    assert few_rows.few_rows_linear(x, weight.t().contiguous().t(), None) is None  # strided
    assert few_rows.few_rows_linear(x, weight, bias[:10]) is None
    assert few_rows.few_rows_linear(x[:, :16], weight, None) is None  # widths differ
    assert few_rows.few_rows_linear(x.unsqueeze(0), weight, None) is None
    strided_rows = torch.randn(3, 64)[:, ::2]  # x is made contiguous, not refused
    got = few_rows.few_rows_linear(strided_rows, weight, bias)
    assert got is not None
    torch.testing.assert_close(got, torch.nn.functional.linear(strided_rows, weight, bias))


def test_greedy_rows_give_the_first_maximum_of_each_row(kernel: cpu_kernels.CpuKernels) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(37, 262_144 // 8, generator=gen)
    logits[3, 100] = logits[3, 9000] = 50.0  # a tie: the first wins
    logits[5, -1] = 60.0  # the maximum at the last entry
    got = kernel.greedy_rows(logits)
    assert got == logits.max(dim=-1).indices.tolist() and got[3] == 100
    assert kernel.greedy_rows(logits[:1]) == [int(logits[0].argmax())]  # one row, one thread


def test_greedy_sampling_takes_its_argmax_from_the_kernel(
    kernel: cpu_kernels.CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridserve.executor.torch.sampler import verify_batch

    seen: list[int] = []
    original = kernel.greedy_rows

    def spy(logits: torch.Tensor) -> list[int] | None:
        seen.append(logits.shape[0])
        return original(logits)

    monkeypatch.setattr(kernel, "greedy_rows", spy)
    logits = torch.randn(5, 300)
    logits[0, 7] = 9.0
    out = verify_batch(logits, [((), None, 0), ((3, 4), None, 0), ((), None, 0)])
    assert seen == [5] and out[0] == (7,)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_greedy_rows_leave_a_batch_with_a_non_finite_value_to_the_exact_path(
    kernel: cpu_kernels.CpuKernels, value: float
) -> None:
    from hybridserve.executor.torch.sampler import verify_batch

    logits = torch.randn(4, 1000)
    logits[2, 17] = value
    assert kernel.greedy_rows(logits) is None
    # The batch's answers are the exact path's: a -inf (a masked token) leaves its row usable.
    requests = [((), None, 0)] * 4
    out = verify_batch(logits, requests)
    want = logits.max(dim=-1).indices.tolist()
    assert out[:2] == [(want[0],), (want[1],)] and out[3] == (want[3],)
    assert out[2] == ((want[2],) if value == float("-inf") else ())


@pytest.fixture
def fresh_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_kernels.load.cache_clear()
    yield
    cpu_kernels.load.cache_clear()


def test_without_a_compiler_the_kernel_is_absent_and_says_why(
    fresh_load: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.load() is None
    assert "no C compiler (/nonexistent/cc)" in caplog.text


def test_a_failed_build_is_absent_and_reports_the_compiler_error(
    fresh_load: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "COMPILE_FLAGS", ("-no-such-flag-at-all",))
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.load() is None
    assert "could not be built" in caplog.text and "no-such-flag-at-all" in caplog.text


def test_the_switch_turns_the_kernel_off(fresh_load: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDSERVE_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None


def test_loading_the_kernel_keeps_denormal_floats(kernel: cpu_kernels.CpuKernels) -> None:
    # Linked with -ffast-math, the library would switch the CPU to flush denormals to zero for
    # the whole process on load.
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0 and (tiny / 2).item() != 0.0
