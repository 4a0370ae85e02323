"""Mamba2 mixer (Bamba, Granite 4 hybrid): causal conv1d + selective state space scan, with state.

A request's state is `conv` `[conv_dim, kernel - 1]` (the last inputs of the short convolution)
and `ssm` `[num_heads, head_dim, state_size]`. Chunks continue exactly from a saved state, so
tokens [0, a) then [a, b) give the same result as [0, b) at once.

Per token t and head h (dt = softplus(dt_raw + dt_bias) clamped to the time-step limit, A < 0):
    S <- exp(dt A) S + dt x_t B_t^T;   y_t = S C_t + D x_t
then y is gated by silu(z), RMS-normalised per group and projected out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.layers.gated_delta import State, causal_conv1d, segments
from hybridserve.executor.torch.layers.mlp import activation

if TYPE_CHECKING:
    from hybridserve.executor.torch.forward import ForwardContext


def json_float(value: Any) -> float:
    """A float from config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


@dataclass(frozen=True, slots=True)
class Mamba2Dims:
    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    time_step_limit: tuple[float, float]
    act: str
    eps: float

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner_size + 2 * self.num_groups * self.state_size

    @classmethod
    def from_bamba_config(cls, config: dict[str, Any]) -> Mamba2Dims:
        """The `mamba_*` keys of Bamba and GraniteMoeHybrid configs."""
        hidden = int(config["hidden_size"])
        inner = int(config.get("mamba_expand", 2)) * hidden
        num_heads = int(config["mamba_n_heads"])
        head_dim = config.get("mamba_d_head", "auto")
        head_dim = inner // num_heads if head_dim in (None, "auto") else int(head_dim)
        if head_dim * num_heads != inner:
            raise ConfigError(
                "config.mamba_d_head",
                head_dim,
                f"mamba_d_head * mamba_n_heads must equal mamba_expand * hidden_size = {inner}",
            )
        num_groups = int(config.get("mamba_n_groups", 1))
        if num_heads % num_groups:
            raise ConfigError(
                "config.mamba_n_groups", num_groups, f"use a divisor of mamba_n_heads={num_heads}"
            )
        limit = config.get("time_step_limit") or (0.0, float("inf"))
        if len(limit) != 2:
            raise ConfigError("config.time_step_limit", limit, "give [min, max]")
        return cls(
            hidden_size=hidden,
            num_heads=num_heads,
            head_dim=head_dim,
            num_groups=num_groups,
            state_size=int(config["mamba_d_state"]),
            conv_kernel=int(config.get("mamba_d_conv", 4)),
            chunk_size=int(config.get("mamba_chunk_size", 256)),
            conv_bias=bool(config.get("mamba_conv_bias", True)),
            proj_bias=bool(config.get("mamba_proj_bias", False)),
            time_step_limit=(json_float(limit[0]), json_float(limit[1])),
            act=str(config.get("hidden_act", "silu")),
            eps=float(config.get("rms_norm_eps", 1e-6)),
        )


def ssd_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. x `[L, H, P]`, dt `[L, H]` (discretised), a `[H]`, b and c `[L, H, N]`,
    state `[H, P, N]`; returns y `[L, H, P]` (without the D skip) and the final state."""
    outputs = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * a)[:, None, None]
        state = state * decay + (dt[t][:, None] * x[t])[:, :, None] * b[t][:, None, :]
        outputs.append(torch.einsum("hpn,hn->hp", state, c[t]))
    return torch.stack(outputs), state


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result as `ssd_recurrent`, `chunk_size` tokens per matmul (state space duality).

    With cumulative log decay s_t = sum_{u<=t} dt_u a inside a chunk:
    y_t = e^{s_t} S0 C_t + sum_{r<=t} e^{s_t - s_r} (C_t.B_r) dt_r x_r and
    S = e^{s_C} S0 + sum_r e^{s_C - s_r} dt_r x_r B_r^T.
    """
    length = x.shape[0]
    pad = (-length) % chunk_size
    # Padding with dt = 0 leaves the state unchanged after the last token.
    x, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, b, c))
    dt = F.pad(dt, (0, 0, 0, pad))
    num_chunks = x.shape[0] // chunk_size

    def per_chunk(t: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, N, C, ...]
        return t.reshape(num_chunks, chunk_size, *t.shape[1:]).movedim(2, 0)

    xc, dtc, bc, cc = (per_chunk(t) for t in (x, dt, b, c))
    cum = (dtc * a[:, None, None]).cumsum(dim=-1)  # [H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    scores = (cc @ bc.transpose(-1, -2)) * decay  # [H, N, C, C]
    xdt = xc * dtc[..., None]  # [H, N, C, P]
    within = scores @ xdt
    c_decayed = cc * cum.exp()[..., None]
    x_to_end = xdt * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()  # [H, N]
    outputs = []
    for n in range(num_chunks):
        outputs.append(within[:, n] + c_decayed[:, n] @ state.transpose(-1, -2))
        state = state * chunk_decay[:, n, None, None] + x_to_end[:, n].transpose(-1, -2) @ bc[:, n]
    out = torch.cat(outputs, dim=1).transpose(0, 1)  # [L + pad, H, P]
    return out[:length], state


class GroupedGatedRMSNorm(nn.Module):
    """`weight * rmsnorm_per_group(x * silu(gate))` (the gate is applied before the norm)."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        grouped = h.view(*h.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """Parameter names follow the Bamba checkpoints (`in_proj`, `conv1d`, `dt_bias`, `A_log`,
    `D`, `norm.weight`, `out_proj`)."""

    def __init__(self, dims: Mamba2Dims, layer_index: int) -> None:
        super().__init__()
        self.dims = dims
        self.layer_index = layer_index
        self.act = activation(dims.act)
        d = dims
        self.in_proj = nn.Linear(
            d.hidden_size, d.inner_size + d.conv_dim + d.num_heads, bias=d.proj_bias
        )
        self.conv1d = nn.Conv1d(
            d.conv_dim, d.conv_dim, d.conv_kernel, groups=d.conv_dim, bias=d.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(d.num_heads))
        self.A_log = nn.Parameter(torch.zeros(d.num_heads))
        self.D = nn.Parameter(torch.ones(d.num_heads))
        self.norm = GroupedGatedRMSNorm(d.inner_size, d.inner_size // d.num_groups, d.eps)
        self.out_proj = nn.Linear(d.inner_size, d.hidden_size, bias=d.proj_bias)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        d = self.dims
        return {
            "conv": (d.conv_dim, d.conv_kernel - 1),
            "ssm": (d.num_heads, d.head_dim, d.state_size),
        }

    def zero_state(self, device: torch.device | None = None) -> State:
        return {
            name: torch.zeros(shape, dtype=torch.float32, device=device)
            for name, shape in self.state_shapes().items()
        }

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gate z `[T, inner]`, conv input `[T, conv_dim]`, raw dt `[T, H]`."""
        d = self.dims
        z, xbc, dt = self.in_proj(x).split([d.inner_size, d.conv_dim, d.num_heads], dim=-1)
        return z, xbc, dt

    def _mix(
        self, xbc: torch.Tensor, dt_raw: torch.Tensor, state: State
    ) -> tuple[torch.Tensor, State]:
        """Conv and scan over one segment of one request: y `[L, inner]` and the new state."""
        d, n = self.dims, xbc.shape[0]
        conv_out, conv_state = causal_conv1d(
            xbc, state["conv"], self.conv1d.weight[:, 0], self.conv1d.bias
        )
        conv_out = self.act(conv_out)
        group_dim = d.num_groups * d.state_size
        xs, b, c = conv_out.split([d.inner_size, group_dim, group_dim], dim=-1)
        ratio = d.num_heads // d.num_groups
        xs = xs.float().reshape(n, d.num_heads, d.head_dim)
        b = b.float().reshape(n, d.num_groups, d.state_size).repeat_interleave(ratio, dim=1)
        c = c.float().reshape(n, d.num_groups, d.state_size).repeat_interleave(ratio, dim=1)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())
        dt = dt.clamp(min=d.time_step_limit[0], max=d.time_step_limit[1])
        a = -torch.exp(self.A_log.float())
        ssm = state["ssm"].float()
        if n == 1:
            y, ssm = ssd_recurrent(xs, dt, a, b, c, ssm)
        else:
            y, ssm = ssd_chunked(xs, dt, a, b, c, ssm, d.chunk_size)
        y = y + xs * self.D.float()[:, None]
        return y.reshape(n, -1), {"conv": conv_state, "ssm": ssm}

    def _finish(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.norm(y.to(z.dtype), z))

    def forward_sequence(
        self, x: torch.Tensor, state: State, snapshots: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, State, list[State]]:
        """One request's tokens `[L, hidden]` from `state`: the output, the final state and the
        states after each count in `snapshots`."""
        z, xbc, dt = self._project(x)
        outs, saved = [], []
        for start, end in segments(x.shape[0], snapshots):
            y, state = self._mix(xbc[start:end], dt[start:end], state)
            outs.append(y)
            if end in snapshots:
                saved.append(state)
        return self._finish(torch.cat(outs), z), state, saved

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The flat batch `[T, hidden]`; each request's chunk continues from its loaded state
        and its requested snapshots are saved through `ctx`."""
        z, xbc, dt = self._project(x)
        y = x.new_empty(x.shape[0], self.dims.inner_size, dtype=torch.float32)
        for chunk in ctx.state_chunks(self.layer_index):
            state = ctx.load_state(self.layer_index, chunk)
            base = chunk.rows.start
            for start, end in segments(chunk.rows.stop - base, chunk.snapshots):
                rows = slice(base + start, base + end)
                y[rows], state = self._mix(xbc[rows], dt[rows], state)
                if end in chunk.snapshots:
                    ctx.save_state(self.layer_index, chunk, end, state)
        return self._finish(y, z)
