"""The gated MLP of Llama-family models: down(act(gate(x)) * up(x)).

The activation and the product run in place on the gate projection's output: two passes over
one fresh tensor instead of two new tensors. A Gemma 3 prefill of 8 x 256 tokens spent 128 ms
in `gelu` and 73 in the product before, 76 in `gelu_` and 17 in `mul_` after (18 layers of
2,048 x 2,048, 2 threads; docs/step_profile_gemma3_prefill_8x256_*.json). Same operations,
same results.

With packed weights (`layers/packed.py`) gate and up are one product of their concatenated
weight (`fused_gate_up`), and on the CPU the activation and the product run in one pass of the
row kernel (`cpu_kernels.act_mul`, tanh-GELU and SiLU) into a fresh `[rows, intermediate]`
(`gated_product`; Granite 4.0-H's shared MLP, whose one projection stacks gate and up, too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch import cpu_kernels
from hybridserve.executor.torch.layers.packed import fused

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


# In-place forms of the activations, for a tensor nothing else reads (a projection's output).
_IN_PLACE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": lambda x: F.silu(x, inplace=True),
    "gelu": lambda x: torch.ops.aten.gelu_(x),
    "gelu_pytorch_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "gelu_new": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "relu": lambda x: F.relu(x, inplace=True),
}


def in_place_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation `name`, applied in place to (and returning) its argument."""
    activation(name)  # a clear error for an unknown one
    return _IN_PLACE[name]


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ConfigError("config.hidden_act", name, f"use one of {sorted(_ACTIVATIONS)}") from None


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act_name = act
        self.act_in_place = in_place_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = fused(self, "fused_gate_up")
        if gate_up is None:
            hidden = self.act_in_place(self.gate_proj(x))
            return self.down_proj(hidden.mul_(self.up_proj(x)))
        both = gate_up.product(x)  # [rows, 2 x intermediate], the gate first
        return self.down_proj(gated_product(both, self.act_name))


def gated_product(both: torch.Tensor, act: str) -> torch.Tensor:
    """`act(gate) * up` of a fresh `[rows, 2 x intermediate]` projection, the gate first: one
    pass of the row kernel on a float32 CPU tensor (a new `[rows, intermediate]`), else the
    torch form in place on the gate's half (for an activation the kernel does not have, none
    built, another device or dtype, or under torch.compile)."""
    if both.device.type == "cpu" and both.dtype == torch.float32:
        kernels = None if torch.compiler.is_compiling() else cpu_kernels.load()
        product = kernels.act_mul(both, act) if kernels is not None else None
        if product is not None:
            return product
    gate, up = both.chunk(2, dim=-1)
    return in_place_activation(act)(gate).mul_(up).contiguous()
