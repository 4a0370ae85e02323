"""The layers' fast forms (fused RMS norm, in-place MLP activation, rotary halves updated in
place) compute what their textbook forms compute, on every dtype and activation they serve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.executor.torch.layers.mlp import GatedMLP
from hybridserve.executor.torch.layers.norm import RMSNorm
from hybridserve.executor.torch.layers.rotary import Rotary

torch.set_num_threads(1)


def composite_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool
) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (37, 640), (5, 4, 256)])
def test_float32_rms_norm_equals_the_composite_form(offset: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6, offset=offset)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(*shape) * 3
    expected = composite_rms_norm(x, norm.weight, 1e-6, offset)
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)


def test_bfloat16_rms_norm_keeps_the_float32_composite_form() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6, offset=True)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    assert torch.equal(norm(x), composite_rms_norm(x, norm.weight, 1e-6, True))


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu"])
def test_gated_mlp_equals_down_of_act_gate_times_up(act: str) -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(32, 96, act)
    x = torch.randn(7, 32)
    reference = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "gelu_new": lambda t: F.gelu(t, approximate="tanh"),
        "relu": F.relu,
    }[act]
    with torch.no_grad():
        expected = mlp.down_proj(reference(mlp.gate_proj(x)) * mlp.up_proj(x))
        assert torch.equal(mlp(x), expected)


def test_rotary_equals_the_rotate_half_formula() -> None:
    torch.manual_seed(0)
    rotary = Rotary(64, 10_000.0)
    positions = torch.tensor([0, 1, 5, 300, 4095])
    q, k = torch.randn(5, 4, 64), torch.randn(5, 1, 64)
    cos, sin = rotary.cos_sin(positions, torch.float32)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., 32:], x[..., :32]), dim=-1)

    got_q, got_k = rotary(positions, q, k)
    torch.testing.assert_close(got_q, q * cos + rotate_half(q) * sin, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, k * cos + rotate_half(k) * sin, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got_q, q)  # the inputs are left as they were, the output is new
