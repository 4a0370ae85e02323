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

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.layers.mlp import activation
from hybridserve.executor.torch.layers.recurrence import (
    GATED_DELTA_LOOP_MAX_TOKENS,
    SPAN_CHUNKS,
    State,
    causal_conv1d,
    check_snapshots,
    conv_step,
    decay_within_chunks,
    decode_batch,
    in_spans,
    scan_chunk_size,
    snapshots_by_chunk,
    to_chunks,
)

if TYPE_CHECKING:
    from hybridserve.executor.torch.forward import ForwardContext


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    snapshots: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Token by token. q, k `[L, Hk, Dk]` (normalised and scaled; each key head serves Hv / Hk
    value heads), v `[L, Hv, Dv]`, g and beta `[L, Hv]`, state `[Hv, Dk, Dv]`; returns outputs
    `[L, Hv, Dv]`, the final state and the states after each count in `snapshots`."""
    outputs, saved = [], []
    wanted = set(snapshots)
    batched = state[None]  # one request: a batch of one for gated_delta_step
    for t in range(q.shape[0]):
        step = slice(t, t + 1)
        out, batched = gated_delta_step(q[step], k[step], v[step], g[step], beta[step], batched)
        outputs.append(out[0])
        if t + 1 in wanted:
            saved.append(batched[0])
    return torch.stack(outputs), batched[0], saved


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of `gated_delta_rule_recurrent` for each of B requests: q, k `[B, Hk, Dk]`,
    v `[B, Hv, Dv]`, g and beta `[B, Hv]`, state `[B, Hv, Dk, Dv]`; returns `[B, Hv, Dv]` and
    the new states."""
    ratio = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    state = state * g.exp()[:, :, None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - predicted) * beta[:, :, None]
    state = state + k[:, :, :, None] * delta[:, :, None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    chunk_size: int = 64,
    snapshots: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The same result as `gated_delta_rule_recurrent`, `chunk_size` tokens per matmul: the
    chunkwise gated delta rule (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", 2024) in
    its WY / UT-transform form.

    Inside a chunk with cumulative log decay c_t, the written values u_t solve the unit lower
    triangular system u_t + beta_t sum_{s<t} e^{c_t - c_s} (k_t.k_s) u_s = beta_t (v_t - e^{c_t}
    k_t^T S0), so u = T beta V - (T beta e^c K) S0 with T = (I + tril(diag(beta) K K^T * decay,
    -1))^-1 (the UT transform); then o_t = e^{c_t} q_t^T S0 + sum_{s<=t} e^{c_t - c_s} (q_t.k_s)
    u_s and the state after j tokens is e^{c_j} S0 + sum_{s<=j} e^{c_j - c_s} k_s u_s^T (j = C
    carries to the next chunk; other j are the snapshots). Everything but the carry across
    chunks is batched over all chunks; q.k and k.k are computed once per key head.
    """
    size = max(1, min(chunk_size, v.shape[0]))

    def scan(
        tokens: slice, start: torch.Tensor, local: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        return _gated_delta_span(
            q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens], start, size, local
        )

    return in_spans(scan, v.shape[0], state, span=size * SPAN_CHUNKS, snapshots=snapshots)


def _gated_delta_span(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    size: int,
    snapshots: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`gated_delta_rule_chunked` over one span of whole chunks of `size` tokens."""
    length, num_heads, dim_v = v.shape
    # Zero padding (k = 0, beta = 0, g = 0) leaves the state unchanged after the last token.
    qc, kc, vc, gc, bc = to_chunks((q, k, v, g, beta), size)  # q, k: [N, Hk, C, Dk]
    num_chunks, num_key_heads = kc.shape[:2]
    ratio = num_heads // num_key_heads

    def by_key_head(x: torch.Tensor) -> torch.Tensor:  # [N, Hv, ...] -> [N, Hk, Hv / Hk, ...]
        return x.view(num_chunks, num_key_heads, ratio, *x.shape[2:])

    def by_value_head(x: torch.Tensor) -> torch.Tensor:  # [N, Hk, Hv / Hk, ...] -> [N, Hv, ...]
        return x.reshape(num_chunks, num_heads, *x.shape[3:])

    cum = gc.cumsum(dim=-1)  # [N, Hv, C]
    decay = by_key_head(decay_within_chunks(cum))
    kk = (kc @ kc.transpose(-1, -2))[:, :, None] * decay * by_key_head(bc)[..., :, None]
    transform = unit_lower_inverse(by_value_head(kk).tril(-1))
    values = transform @ (vc * bc[..., None])
    k_scaled = kc[:, :, None] * by_key_head(bc * cum.exp())[..., None]
    reads = transform @ by_value_head(k_scaled)
    attn = by_value_head((qc @ kc.transpose(-1, -2))[:, :, None] * decay)
    q_decayed = by_value_head(qc[:, :, None] * by_key_head(cum.exp())[..., None])
    k_heads = by_value_head(kc[:, :, None].expand(-1, -1, ratio, -1, -1))
    # The carry to the next chunk: S <- e^{c_C} S + (k e^{c_C - c})^T u.
    k_to_end = (k_heads * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [N, Hv, 1, 1]
    wanted = snapshots_by_chunk(snapshots, size)
    out = torch.empty_like(vc)
    saved: list[torch.Tensor] = []
    # Both reads of the chunk's starting state, k (for u) and q (for the output), in one
    # batched product; the carry updates a private copy of the state in place.
    from_state = torch.cat((reads, q_decayed), dim=2)  # [N, Hv, 2C, Dk]
    k_to_end = k_to_end.contiguous()
    state = state.clone()
    for n in range(num_chunks):
        read = from_state[n] @ state
        u = values[n] - read[:, :size]
        torch.baddbmm(read[:, size:], attn[n], u, out=out[n])
        offsets = wanted.get(n, [])
        inside = [j for j in offsets if j < size]
        saved.extend(_state_after(state, k_heads[n], cum[n], u, j) for j in inside)
        state.mul_(chunk_decay[n]).baddbmm_(k_to_end[n], u)
        if len(inside) < len(offsets):
            saved.append(state.clone())
    return out.transpose(1, 2).reshape(-1, num_heads, dim_v)[:length], state, saved


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower triangular A `[..., C, C]` by doubling: with T the inverse
    of each diagonal block of size s, the inverse of a block of size 2s has T11, T22 on its
    diagonal and -T22 A21 T11 below (log2 C batched matmul levels; C a power of two or not)."""
    size = lower.shape[-1]
    padded = 1 << (size - 1).bit_length()
    a = F.pad(lower, (0, padded - size, 0, padded - size))
    lead = a.shape[:-2]
    t = torch.eye(padded, dtype=a.dtype, device=a.device).expand_as(a).contiguous()
    s = 1
    while s < padded:
        blocks = padded // s
        t_blocks = t.view(*lead, blocks, s, blocks, s)
        a_blocks = a.view(*lead, blocks, s, blocks, s)

        def diagonal(x: torch.Tensor, offset: int) -> torch.Tensor:  # [..., pairs, s, s]
            return torch.diagonal(x, offset=-offset, dim1=-4, dim2=-2).movedim(-1, -3)

        t_diag, below = diagonal(t_blocks, 0), diagonal(t_blocks, 1)[..., 0::2, :, :]
        a_below = diagonal(a_blocks, 1)[..., 0::2, :, :]
        below.copy_(-(t_diag[..., 1::2, :, :] @ a_below @ t_diag[..., 0::2, :, :]))
        s *= 2
    return t[..., :size, :size]


def _state_after(
    state: torch.Tensor, k: torch.Tensor, cum: torch.Tensor, u: torch.Tensor, j: int
) -> torch.Tensor:
    """The delta-rule state after the first j tokens of a chunk that started from `state`:
    e^{c_j} S0 + sum_{s<=j} e^{c_j - c_s} k_s u_s^T; k `[H, C, Dk]`, cum `[H, C]`, u `[H, C, Dv]`.
    """
    end = cum[:, j - 1 : j]
    k_to_j = k[:, :j] * (end - cum[:, :j]).exp()[..., None]
    return torch.baddbmm(state * end.exp()[..., None], k_to_j.transpose(-1, -2), u[:, :j])


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
        chunk_size: int | None = None,
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

    def _inputs(
        self, conv_out: torch.Tensor, b: torch.Tensor, a: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k `[L, Hk, Dk]` (normalised, q scaled), v `[L, Hv, Dv]`, g and beta `[L, Hv]` from
        the activated conv output and the raw b, a of L tokens."""
        n = conv_out.shape[0]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.float().reshape(n, self.num_k_heads, self.head_k_dim)
        k = k.float().reshape(n, self.num_k_heads, self.head_k_dim)
        q = l2_normalize(q) * self.head_k_dim**-0.5
        k = l2_normalize(k)
        v = v.float().reshape(n, self.num_v_heads, self.head_v_dim)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v, g, beta

    def _decode(
        self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, state: State
    ) -> tuple[torch.Tensor, State]:
        """One token for each of B requests (states stacked `[B, ...]`): `[B, Hv, Dv]` and the
        new states."""
        conv_out, conv_state = conv_step(mixed, state["conv"], self.conv1d.weight[:, 0], None)
        q, k, v, g, beta = self._inputs(self.act(conv_out), b, a)
        out, ssm = gated_delta_step(q, k, v, g, beta, state["ssm"].float())
        return out, {"conv": conv_state, "ssm": ssm}

    def _mix(
        self,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        state: State,
        snapshots: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, State, list[State]]:
        """Conv and delta rule over one request's chunk: `[L, Hv, Dv]`, the new state and the
        states after each count in `snapshots`."""
        n = mixed.shape[0]
        check_snapshots(snapshots, n)
        weight = self.conv1d.weight[:, 0]
        conv_out, conv_state, conv_saved = causal_conv1d(
            mixed, state["conv"], weight, None, snapshots
        )
        q, k, v, g, beta = self._inputs(self.act(conv_out), b, a)
        ssm = state["ssm"].float()
        if n <= GATED_DELTA_LOOP_MAX_TOKENS:
            out, ssm, ssm_saved = gated_delta_rule_recurrent(
                q, k, v, g, beta, ssm, snapshots=snapshots
            )
        else:
            out, ssm, ssm_saved = gated_delta_rule_chunked(
                q, k, v, g, beta, ssm, chunk_size=self._chunk_size(q.device), snapshots=snapshots
            )
        saved = [{"conv": c, "ssm": s} for c, s in zip(conv_saved, ssm_saved, strict=True)]
        return out, {"conv": conv_state, "ssm": ssm}, saved

    def _chunk_size(self, device: torch.device) -> int:
        return self.chunk_size if self.chunk_size is not None else scan_chunk_size(device)

    def _finish(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = self.norm(out.to(z.dtype), z)
        return self.out_proj(normed.reshape(out.shape[0], -1))

    def forward_sequence(
        self, x: torch.Tensor, state: State, snapshots: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, State, list[State]]:
        """One request's tokens `[L, hidden]` from `state`: the output, the final state and the
        states after each count in `snapshots`."""
        mixed, z, b, a = self._project(x)
        out, state, saved = self._mix(mixed, b, a, state, snapshots)
        return self._finish(out, z), state, saved

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The flat batch `[T, hidden]`; each request's chunk continues from its loaded state
        and its requested snapshots are saved through `ctx`."""
        mixed, z, b, a = self._project(x)
        out = x.new_empty(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=torch.float32)
        decodes, others = decode_batch(ctx.state_chunks(self.layer_index))
        if decodes:
            index = torch.tensor([c.rows.start for c in decodes], device=x.device)
            states = ctx.load_states(self.layer_index, decodes)
            stepped, states = self._decode(mixed[index], b[index], a[index], states)
            out.index_copy_(0, index, stepped)
            ctx.save_states(self.layer_index, decodes, states)
        for chunk in others:
            state = ctx.load_state(self.layer_index, chunk)
            rows = chunk.rows
            out[rows], _, saved = self._mix(mixed[rows], b[rows], a[rows], state, chunk.snapshots)
            for count, snapshot in zip(chunk.snapshots, saved, strict=True):
                ctx.save_state(self.layer_index, chunk, count, snapshot)
        return self._finish(out, z)
