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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.layers.mlp import activation
from hybridserve.executor.torch.layers.recurrence import (
    GATED_DELTA_LOOP_MAX_TOKENS,
    State,
    causal_conv1d,
    check_snapshots,
    conv_step,
    decay_exp,
    decay_within_chunks,
    decode_batch,
    in_spans,
    kernel_scan,
    pad_to_chunks,
    snapshots_by_chunk,
    torch_chunk_size,
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
    batched = state[None].clone()  # a batch of one for gated_delta_step, advanced in place
    for t in range(q.shape[0]):
        step = slice(t, t + 1)
        out, batched = gated_delta_step(q[step], k[step], v[step], g[step], beta[step], batched)
        outputs.append(out[0])
        if t + 1 in wanted:
            saved.append(batched[0].clone())
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
    v `[B, Hv, Dv]`, g and beta `[B, Hv]`, state `[B, Hv, Dk, Dv]` (advanced in place: the
    caller's own copy); returns `[B, Hv, Dv]` and the state (`gated_delta_step_in_place` over
    its rows)."""
    return gated_delta_step_in_place(q, k, v, g, beta, state.unbind(0)), state


def gated_delta_step_in_place(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: Sequence[torch.Tensor],
) -> torch.Tensor:
    """`gated_delta_step` for B requests whose states `[Hv, Dk, Dv]` are B separate tensors (the
    cache's own slots, advanced where they lie, so a step copies no state in or out); returns
    `[B, Hv, Dv]`."""
    ratio = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    decay = decay_exp(g)[:, :, None, None]
    out = v.new_empty(v.shape)
    for i, state in enumerate(states):
        keys = k[i][:, None, :]  # [Hv, 1, Dk]
        predicted = torch.bmm(keys, state.mul_(decay[i]))  # [Hv, 1, Dv]
        delta = (v[i][:, None, :] - predicted).mul_(beta[i][:, None, None])
        state.addcmul_(keys.transpose(1, 2), delta)
        torch.bmm(q[i][:, None, :], state, out=out[i][:, None, :])
    return out


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    chunk_size: int | None = None,
    snapshots: tuple[int, ...] = (),
    kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The same result as `gated_delta_rule_recurrent`, `chunk_size` tokens per matmul: the
    chunkwise gated delta rule (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", 2024) in
    its WY / UT-transform form.

    Inside a chunk with cumulative log decay c_t, the written values u_t solve the unit lower
    triangular system u_t + beta_t sum_{s<t} e^{c_t - c_s} (k_t.k_s) u_s = beta_t (v_t - e^{c_t}
    k_t^T S0), so u = T diag(beta) (V - e^c K S0) with T = (I + tril(diag(beta) K K^T * decay,
    -1))^-1 (the UT transform); then o_t = e^{c_t} q_t^T S0 + sum_{s<=t} e^{c_t - c_s} (q_t.k_s)
    u_s and the state after j tokens is e^{c_j} S0 + sum_{s<=j} e^{c_j - c_s} k_s u_s^T (j = C
    carries to the next chunk; other j are the snapshots). The C x C terms are batched over a
    span's chunks (q.k and k.k once per key head); each chunk then reads its starting state with
    q and k in one product and writes it back in place.

    On the CPU (`kernel`, float32, no autograd) one call of the C kernel
    (`cpu_kernels.gated_delta_chunked`) does the same chunk after chunk, each value head's work
    on a chunk in one pass with its operands in cache; elsewhere, or where it does not take the
    shapes, plain torch. `chunk_size` None: `KERNEL_CHUNK_SIZE` for the kernel, else
    `scan_chunk_size` of the device (the result does not depend on it beyond rounding).
    """
    tensors = (q, k, v, g, beta, state)
    if kernel:
        done = kernel_scan(
            lambda kernels, size: kernels.gated_delta_chunked(*tensors, size, snapshots),
            tensors,
            chunk_size,
        )
        if done is not None:
            return done
    size = torch_chunk_size(v.device, v.shape[0], chunk_size)

    def scan(
        tokens: slice, start: torch.Tensor, local: tuple[int, ...], out: torch.Tensor
    ) -> list[torch.Tensor]:
        inputs = (q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens])
        return _gated_delta_span(*inputs, start, size, local, out)

    return in_spans(scan, v, state, chunk_size=size, snapshots=snapshots)


def _gated_delta_span(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    size: int,
    snapshots: tuple[int, ...],
    out: torch.Tensor,
) -> list[torch.Tensor]:
    """`gated_delta_rule_chunked` over one span: writes its outputs into `out` `[N * C, Hv, Dv]`,
    advances `state` in place and returns the snapshots. The inputs stay token major; only q
    and k are laid out by head (the C x C products and each chunk's state read need it)."""
    # Zero padding (k = 0, beta = 0, g = 0) leaves the state unchanged after the last token.
    q, k, v, g, beta = pad_to_chunks((q, k, v, g, beta), size)
    num_chunks, (num_key_heads, dim_k), (num_heads, dim_v) = (
        v.shape[0] // size,
        k.shape[1:],
        v.shape[1:],
    )
    ratio = num_heads // num_key_heads
    qk = q.new_empty(num_chunks, num_key_heads, 2 * size, dim_k)  # q then k of each chunk
    qk[:, :, :size].copy_(q.view(num_chunks, size, num_key_heads, dim_k).transpose(1, 2))
    qk[:, :, size:].copy_(k.view(num_chunks, size, num_key_heads, dim_k).transpose(1, 2))
    k_chunks = qk[:, :, size:]
    terms = _chunk_terms(qk, g, beta, size, ratio)
    values = v.view(num_chunks, size, num_heads, dim_v)
    out_chunks = out.view(num_chunks, size, num_heads, dim_v)
    by_key_head = state.view(num_key_heads, ratio, dim_k, dim_v)
    wanted = snapshots_by_chunk(snapshots, size)
    saved: list[torch.Tensor] = []
    for n in range(num_chunks):
        # The chunk's starting state read by q and k at once: [Hv, 2C, Dv].
        read = torch.matmul(qk[n][:, None], by_key_head).view(num_heads, 2 * size, dim_v)
        written = terms.transform[n] @ (
            values[n].transpose(0, 1) - terms.decay_in[n] * read[:, size:]
        )
        from_state = read[:, :size].mul_(terms.decay_in[n])
        out_chunks[n].copy_(torch.baddbmm(from_state, terms.attn[n], written).transpose(0, 1))
        offsets = wanted.get(n, [])
        inside = [j for j in offsets if j < size]
        saved.extend(_state_after(state, k_chunks[n], terms.cum[n], written, j) for j in inside)
        to_end = (k_chunks[n].transpose(-1, -2)[:, None] * terms.to_end[n]).view(
            num_heads, dim_k, size
        )
        state.mul_(terms.chunk_decay[n]).baddbmm_(to_end, written)
        if len(inside) < len(offsets):
            saved.append(state.clone())
    return saved


class _ChunkTerms(NamedTuple):
    """The per-chunk terms of a span that do not depend on the state (N chunks of C tokens)."""

    cum: torch.Tensor  # [N, Hv, C] cumulative log decay
    decay_in: torch.Tensor  # [N, Hv, C, 1] e^{c_t}
    to_end: torch.Tensor  # [N, Hk, Hv / Hk, 1, C] e^{c_C - c_s}
    chunk_decay: torch.Tensor  # [N, Hv, 1, 1] e^{c_C}
    transform: torch.Tensor  # [N, Hv, C, C] T diag(beta)
    attn: torch.Tensor  # [N, Hv, C, C] (q_t.k_s) e^{c_t - c_s}, s <= t


def _chunk_terms(
    qk: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, size: int, ratio: int
) -> _ChunkTerms:
    """q.k and k.k once per key head (`qk` `[N, Hk, 2C, Dk]`, q above k), then the decays and
    the UT transform per value head from the token-major g and beta `[N * C, Hv]`."""
    num_chunks, num_key_heads = qk.shape[:2]
    num_heads = num_key_heads * ratio
    gram = qk @ qk[:, :, size:].transpose(-1, -2)  # [N, Hk, 2C, C]: q.k above k.k
    cum = g.view(num_chunks, size, num_heads).transpose(1, 2).cumsum(dim=-1)
    betas = beta.view(num_chunks, size, num_heads).transpose(1, 2)
    decay = decay_within_chunks(cum).view(num_chunks, num_key_heads, ratio, size, size)
    lower = gram[:, :, None, size:] * decay * betas.reshape(decay.shape[:-1] + (1,))
    transform = unit_lower_inverse(lower.tril_(-1).view(num_chunks, num_heads, size, size))
    # Entries whose decay is below the floor are zero (products of decays above it, each on a
    # path of the inverse, can underflow there).
    transform.masked_fill_(decay.view(num_chunks, num_heads, size, size) == 0, 0.0)
    return _ChunkTerms(
        cum=cum,
        decay_in=decay_exp(cum)[..., None],
        to_end=decay_exp(cum[..., -1:] - cum).view(num_chunks, num_key_heads, ratio, 1, size),
        chunk_decay=decay_exp(cum[..., -1])[..., None, None],
        transform=transform.mul_(betas[..., None, :]),
        attn=(gram[:, :, None, :size] * decay).view(num_chunks, num_heads, size, size),
    )


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
    """The delta-rule state after the first j tokens of a chunk that started from `state`
    `[Hv, Dk, Dv]`: e^{c_j} S0 + sum_{s<=j} e^{c_j - c_s} k_s u_s^T; k `[Hk, C, Dk]` (one per
    key head), cum `[Hv, C]`, u `[Hv, C, Dv]`."""
    num_heads, num_key_heads = state.shape[0], k.shape[0]
    end = cum[:, j - 1 : j]
    keys = k[:, None, :j].expand(num_key_heads, num_heads // num_key_heads, j, k.shape[-1])
    k_to_j = keys.reshape(num_heads, j, -1) * decay_exp(end - cum[:, :j])[..., None]
    return torch.baddbmm(state * decay_exp(end)[..., None], k_to_j.transpose(-1, -2), u[:, :j])


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
        self,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        state: State,
        ssm_views: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, State]:
        """One token for each of B requests (states stacked `[B, ...]`): `[B, Hv, Dv]` and the
        new states. With `ssm_views` (each request's delta-rule state where it lies) those
        advance in place and only the conv states come back."""
        conv_out, conv_state = conv_step(mixed, state["conv"], self.conv1d.weight[:, 0], None)
        q, k, v, g, beta = self._inputs(self.act(conv_out), b, a)
        new: State = {"conv": conv_state}
        if ssm_views is not None:
            return gated_delta_step_in_place(q, k, v, g, beta, ssm_views), new
        # The loaded states are this step's copies (`load_states`): advanced in place.
        out, new["ssm"] = gated_delta_step(q, k, v, g, beta, state["ssm"].float())
        return out, new

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
                q, k, v, g, beta, ssm, chunk_size=self.chunk_size, snapshots=snapshots
            )
        saved = [{"conv": c, "ssm": s} for c, s in zip(conv_saved, ssm_saved, strict=True)]
        return out, {"conv": conv_state, "ssm": ssm}, saved

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
            views = ctx.state_views(self.layer_index, decodes, "ssm")
            names = None if views is None else ("conv",)
            states = ctx.load_states(self.layer_index, decodes, names)
            stepped, states = self._decode(mixed[index], b[index], a[index], states, views)
            out.index_copy_(0, index, stepped)
            ctx.save_states(self.layer_index, decodes, states)
            if views is not None:
                ctx.copy_state_views(self.layer_index, decodes, "ssm")
        for chunk in others:
            state = ctx.load_state(self.layer_index, chunk)
            rows = chunk.rows
            out[rows], _, saved = self._mix(mixed[rows], b[rows], a[rows], state, chunk.snapshots)
            for count, snapshot in zip(chunk.snapshots, saved, strict=True):
                ctx.save_state(self.layer_index, chunk, count, snapshot)
        return self._finish(out, z)
