"""Gated delta net (Qwen3-Next linear attention): causal conv1d + gated delta rule, with state.

A request's state is two tensors: `conv` `[conv_dim, kernel - 1]`, the last inputs of the
short causal convolution, and `ssm` `[num_v_heads, head_k_dim, head_v_dim]`, the delta-rule
memory. Processing tokens [0, a) then [a, b) from the state after a equals processing [0, b)
at once; the layer saves the state at every count the step asks for (block boundaries the
cache keeps, and each draft position for speculative decoding).

Per token t and value head (q and k L2-normalised, q scaled by head_k_dim ** -0.5):
    S <- exp(g_t) * S;   S <- S + k_t (beta_t * (v_t - k_t^T S))^T;   o_t = q_t^T S
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.layers.mlp import activation

if TYPE_CHECKING:
    from hybridserve.executor.torch.forward import ForwardContext

State = dict[str, torch.Tensor]


def causal_conv1d(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of `x` `[L, C]` continuing from `conv_state` `[C, K - 1]`
    (the K - 1 inputs before x). Returns the output `[L, C]` (no activation) and the new state.
    `weight` is `[C, K]`."""
    num_channels, kernel = weight.shape
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [C, K - 1 + L]
    out = F.conv1d(window[None], weight[:, None, :].to(x.dtype), bias, groups=num_channels)[0]
    return out.t(), window[:, window.shape[1] - (kernel - 1) :].clone()


def segments(num_tokens: int, snapshots: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """The [start, end) pieces of a chunk split at the snapshot counts (empty pieces dropped)."""
    start = 0
    for count in (*snapshots, num_tokens):
        if count > start:
            yield start, count
            start = count


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k `[L, H, Dk]` (normalised and scaled), v `[L, H, Dv]`, g and beta
    `[L, H]`, state `[H, Dk, Dv]`; returns outputs `[L, H, Dv]` and the final state."""
    outputs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outputs), state


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result as `gated_delta_rule_recurrent`, `chunk_size` tokens per matmul.

    Inside a chunk with cumulative log decay c_t, the written values u_t solve the unit lower
    triangular system u_t + beta_t sum_{s<t} e^{c_t - c_s} (k_t.k_s) u_s = beta_t (v_t - e^{c_t}
    k_t^T S0); then o_t = e^{c_t} q_t^T S0 + sum_{s<=t} e^{c_t - c_s} (q_t.k_s) u_s and
    S = e^{c_C} S0 + sum_s e^{c_C - c_s} k_s u_s^T.
    """
    length = q.shape[0]
    pad = (-length) % chunk_size
    # Padding with k = 0, beta = 0 and g = 0 leaves the state unchanged after the last token.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    num_chunks = q.shape[0] // chunk_size

    def per_chunk(x: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, N, C, ...]
        return x.reshape(num_chunks, chunk_size, *x.shape[1:]).movedim(2, 0)

    qc, kc, vc, gc, bc = (per_chunk(x) for x in (q, k, v, g, beta))
    cum = gc.cumsum(dim=-1)  # [H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = (kc @ kc.transpose(-1, -2)) * decay * bc[..., :, None]
    system = kk.tril(-1) + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    rhs_v = vc * bc[..., None]
    rhs_s = kc * (bc * cum.exp())[..., None]
    values = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, rhs_s, upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * cum.exp()[..., None]
    k_to_end = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()  # [H, N]
    outputs = []
    for n in range(num_chunks):
        u = values[:, n] - reads[:, n] @ state
        outputs.append(q_decayed[:, n] @ state + attn[:, n] @ u)
        state = state * chunk_decay[:, n, None, None] + k_to_end[:, n].transpose(-1, -2) @ u
    out = torch.cat(outputs, dim=1).transpose(0, 1)  # [L + pad, H, Dv]
    return out[:length], state


class GatedRMSNorm(nn.Module):
    """RMS norm of x over the head dim, times `weight`, times silu(gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """The `linear_attn` of Qwen3-Next and Qwen3.5; parameter names follow the checkpoints.

    Qwen3-Next (`fused_projections=True`) projects with `in_proj_qkvz` and `in_proj_ba`, laid out
    per key head group; Qwen3.5 with `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Both have `conv1d.weight`, `dt_bias`, `A_log`, `norm.weight` and `out_proj`.
    """

    def __init__(
        self,
        config: dict[str, Any],
        layer_index: int,
        *,
        fused_projections: bool = True,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.layer_index = layer_index
        self.chunk_size = chunk_size
        self.num_k_heads = int(config["linear_num_key_heads"])
        self.num_v_heads = int(config["linear_num_value_heads"])
        self.head_k_dim = int(config["linear_key_head_dim"])
        self.head_v_dim = int(config["linear_value_head_dim"])
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(
                "config.linear_num_value_heads",
                self.num_v_heads,
                f"use a multiple of linear_num_key_heads={self.num_k_heads}",
            )
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = int(config["linear_conv_kernel_dim"])
        self.act = activation(config.get("hidden_act", "silu"))
        self.fused_projections = fused_projections
        if fused_projections:
            self.in_proj_qkvz = nn.Linear(hidden, self.conv_dim + self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, float(config.get("rms_norm_eps", 1e-6)))
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            "conv": (self.conv_dim, self.kernel - 1),
            "ssm": (self.num_v_heads, self.head_k_dim, self.head_v_dim),
        }

    def zero_state(self, device: torch.device | None = None) -> State:
        return {
            name: torch.zeros(shape, dtype=torch.float32, device=device)
            for name, shape in self.state_shapes().items()
        }

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Mixed qkv `[T, conv_dim]` (all q, then k, then v), z `[T, Hv, Dv]`, b and a `[T, Hv]`."""
        n = x.shape[0]
        if not self.fused_projections:
            z = self.in_proj_z(x).view(n, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        # Qwen3-Next groups the projections by key head: [q_g, k_g, v_g..., z_g...] per group g.
        ratio = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(n, self.num_k_heads, -1)
        ba = self.in_proj_ba(x).view(n, self.num_k_heads, 2 * ratio)
        q, k, v, z = torch.split(
            qkvz,
            [self.head_k_dim, self.head_k_dim, ratio * self.head_v_dim, ratio * self.head_v_dim],
            dim=-1,
        )
        b, a = torch.split(ba, [ratio, ratio], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        z = z.reshape(n, self.num_v_heads, self.head_v_dim)
        return mixed, z, b.reshape(n, self.num_v_heads), a.reshape(n, self.num_v_heads)

    def _mix(
        self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, state: State
    ) -> tuple[torch.Tensor, State]:
        """Conv and delta rule over one segment of one request: `[L, Hv, Dv]` and the new state."""
        n = mixed.shape[0]
        conv_out, conv_state = causal_conv1d(mixed, state["conv"], self.conv1d.weight[:, 0], None)
        conv_out = self.act(conv_out)
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        ratio = self.num_v_heads // self.num_k_heads
        q = q.float().reshape(n, self.num_k_heads, self.head_k_dim)
        k = k.float().reshape(n, self.num_k_heads, self.head_k_dim)
        q = l2_normalize(q).repeat_interleave(ratio, dim=1) * self.head_k_dim**-0.5
        k = l2_normalize(k).repeat_interleave(ratio, dim=1)
        v = v.float().reshape(n, self.num_v_heads, self.head_v_dim)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        ssm = state["ssm"].float()
        if n == 1:
            out, ssm = gated_delta_rule_recurrent(q, k, v, g, beta, ssm)
        else:
            out, ssm = gated_delta_rule_chunked(q, k, v, g, beta, ssm, self.chunk_size)
        return out, {"conv": conv_state, "ssm": ssm}

    def _finish(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = self.norm(out.to(z.dtype), z)
        return self.out_proj(normed.reshape(out.shape[0], -1))

    def forward_sequence(
        self, x: torch.Tensor, state: State, snapshots: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, State, list[State]]:
        """One request's tokens `[L, hidden]` from `state`: the output, the final state and the
        states after each count in `snapshots`."""
        mixed, z, b, a = self._project(x)
        outs, saved = [], []
        for start, end in segments(x.shape[0], snapshots):
            out, state = self._mix(mixed[start:end], b[start:end], a[start:end], state)
            outs.append(out)
            if end in snapshots:
                saved.append(state)
        return self._finish(torch.cat(outs), z), state, saved

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The flat batch `[T, hidden]`; each request's chunk continues from its loaded state
        and its requested snapshots are saved through `ctx`."""
        mixed, z, b, a = self._project(x)
        out = x.new_empty(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=torch.float32)
        for chunk in ctx.state_chunks(self.layer_index):
            state = ctx.load_state(self.layer_index, chunk)
            base = chunk.rows.start
            num_tokens = chunk.rows.stop - base
            for start, end in segments(num_tokens, chunk.snapshots):
                rows = slice(base + start, base + end)
                out[rows], state = self._mix(mixed[rows], b[rows], a[rows], state)
                if end in chunk.snapshots:
                    ctx.save_state(self.layer_index, chunk, end, state)
        return self._finish(out, z)
