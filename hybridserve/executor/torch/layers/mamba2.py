"""Mamba2 mixer (Bamba, Granite 4 hybrid): causal conv1d + selective state space scan, with state.

A request's state is `conv` `[conv_dim, kernel - 1]` (the last inputs of the short convolution)
and `ssm` `[num_heads, head_dim, state_size]`. Chunks continue exactly from a saved state, so
tokens [0, a) then [a, b) give the same result as [0, b) at once.

Per token t and head h (dt = softplus(dt_raw + dt_bias) clamped to the time-step limit, A < 0):
    S <- exp(dt A) S + dt x_t B_t^T;   y_t = S C_t + D x_t
then y is gated by silu(z), RMS-normalised per group and projected out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch import cpu_kernels
from hybridserve.executor.torch.layers.mlp import activation
from hybridserve.executor.torch.layers.recurrence import (
    MAMBA2_LOOP_MAX_TOKENS,
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
    *,
    snapshots: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Token by token. x `[L, H, P]`, dt `[L, H]` (discretised), a `[H]`, b and c `[L, G, N]`
    (G groups of H / G heads each), state `[H, P, N]`; returns y `[L, H, P]` (without the D
    skip), the final state and the states after each count in `snapshots`."""
    outputs, saved = [], []
    wanted = set(snapshots)
    batched = state[None].clone()  # one request: a batch of one for ssd_step, advanced in place
    for t in range(x.shape[0]):
        step = slice(t, t + 1)
        y, batched = ssd_step(x[step], dt[step], a, b[step], c[step], batched)
        outputs.append(y[0])
        if t + 1 in wanted:
            saved.append(batched[0].clone())
    return torch.stack(outputs), batched[0], saved


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of `ssd_recurrent` for each of B requests: x `[B, H, P]`, dt `[B, H]`, a `[H]`,
    b and c `[B, G, N]`, state `[B, H, P, N]` (advanced in place: the caller's own copy);
    returns y `[B, H, P]` and the state (`ssd_step_in_place` over its rows)."""
    return ssd_step_in_place(x, dt, a, b, c, state.unbind(0)), state


def ssd_step_in_place(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    states: Sequence[torch.Tensor],
) -> torch.Tensor:
    """`ssd_step` for B requests whose states `[H, P, N]` are B separate tensors (the cache's
    own slots, advanced where they lie, so a step copies no state in or out); returns y
    `[B, H, P]`. On the CPU, one call of the C kernel (`cpu_kernels.ssm_step`, one pass over
    each state); else the inputs' arithmetic is batched, the state updates one request at a
    time."""
    log_decay, xdt = dt * a, dt[:, :, None] * x  # [B, H], [B, H, P]
    kernels = cpu_kernels.for_tensor(x)
    if kernels is not None:
        # One pass over each state (the loop below reads it three times).
        y = kernels.ssm_step(states, decay_exp(log_decay), xdt, b, c)
        if y is not None:
            return y
    ratio = x.shape[1] // b.shape[1]
    b, c = b.repeat_interleave(ratio, dim=1), c.repeat_interleave(ratio, dim=1)
    decay = decay_exp(log_decay)[:, :, None, None]
    written = xdt[:, :, :, None]  # [B, H, P, 1]
    y = x.new_empty(x.shape)
    for i, state in enumerate(states):
        state.mul_(decay[i]).addcmul_(written[i], b[i][:, None, :])
        # y = S c as the row vector c times S^T: a [P, N] @ [N, 1] product per head took 7-8x
        # as long on the CPU (1.07 against 0.15 ms at 8 x 32 heads of 64 x 128).
        torch.bmm(c[i][:, None, :], state.transpose(1, 2), out=y[i][:, None, :])
    return y


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    *,
    chunk_size: int | None = None,
    snapshots: tuple[int, ...] = (),
    kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The same result as `ssd_recurrent`, `chunk_size` tokens per matmul: the chunked scan of
    state space duality (Dao and Gu, "Transformers are SSMs", 2024, the SSD algorithm).

    With cumulative log decay s_t = sum_{u<=t} dt_u a inside a chunk:
    y_t = e^{s_t} S0 C_t + sum_{r<=t} e^{s_t - s_r} (C_t.B_r) dt_r x_r, and the state after j
    tokens is e^{s_j} S0 + sum_{r<=j} e^{s_j - s_r} dt_r x_r B_r^T (j = C carries to the next
    chunk; other j are the snapshots). C_t.B_r is computed once per group, not per head.

    On the CPU (`kernel`, float32, no autograd) one call of the C kernel
    (`cpu_kernels.ssd_chunked`) does the same chunk after chunk, each head's work on a chunk in
    one pass with its operands in cache; elsewhere, or where it does not take the shapes, plain
    torch. `chunk_size` None: `KERNEL_CHUNK_SIZE` for the kernel, else `scan_chunk_size` of the
    device (the result does not depend on it beyond rounding).
    """
    tensors = (x, dt, a, b, c, state)
    if kernel:
        done = kernel_scan(
            lambda kernels, size: kernels.ssd_chunked(*tensors, size, snapshots),
            tensors,
            chunk_size,
        )
        if done is not None:
            return done
    size = torch_chunk_size(x.device, x.shape[0], chunk_size)

    def scan(
        tokens: slice, start: torch.Tensor, local: tuple[int, ...], out: torch.Tensor
    ) -> list[torch.Tensor]:
        inputs = (x[tokens], dt[tokens], a, b[tokens], c[tokens])
        return _ssd_span(*inputs, start, size, local, out)

    return in_spans(scan, x, state, chunk_size=size, snapshots=snapshots)


def _ssd_span(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    size: int,
    snapshots: tuple[int, ...],
    out: torch.Tensor,
) -> list[torch.Tensor]:
    """`ssd_chunked` over one span: writes y into `out` `[N * C, H, P]`, advances `state` in
    place and returns the snapshots. x stays token major; dt x is laid out by head once (the
    within-chunk product needs it), and the state's write reads x as it is."""
    # Zero padding (dt = 0) leaves the state unchanged after the last token.
    x, dt, b, c = pad_to_chunks((x, dt, b, c), size)
    num_chunks, (num_heads, head_dim), (groups, state_size) = (
        x.shape[0] // size,
        x.shape[1:],
        b.shape[1:],
    )
    ratio = num_heads // groups
    steps = dt.view(num_chunks, size, num_heads).transpose(1, 2)  # [N, H, C]
    tokens = x.view(num_chunks, size, num_heads, head_dim)
    xdt = x.new_empty(num_chunks, num_heads, size, head_dim)
    torch.mul(tokens.transpose(1, 2), steps[..., None], out=xdt)
    bc, cc = (
        t.view(num_chunks, size, groups, state_size).transpose(1, 2).contiguous() for t in (b, c)
    )
    cum = (steps * a[:, None]).cumsum(dim=-1)  # [N, H, C]
    scores = (cc @ bc.transpose(-1, -2))[:, :, None]  # [N, G, 1, C, C], once per group
    decay = decay_within_chunks(cum).view(num_chunks, groups, ratio, size, size)
    weights = decay.mul_(scores).view(num_chunks, num_heads, size, size)
    decay_in = decay_exp(cum).view(num_chunks, groups, ratio, size, 1)
    # dt_r e^{s_C - s_r}: the weight of token r's write in the state the chunk carries.
    to_end = (decay_exp(cum[..., -1:] - cum) * steps).transpose(1, 2)[..., None]  # [N, C, H, 1]
    chunk_decay = decay_exp(cum[..., -1])[..., None, None]  # [N, H, 1, 1]
    out_chunks = out.view(num_chunks, size, groups, ratio, head_dim).permute(0, 2, 3, 1, 4)
    by_group = state.view(groups, ratio * head_dim, state_size)
    wanted = snapshots_by_chunk(snapshots, size)
    saved: list[torch.Tensor] = []
    for n in range(num_chunks):
        within = torch.bmm(weights[n], xdt[n]).view(groups, ratio, size, head_dim)
        # C_t S_h^T for every head h of a group in one matmul: [C, N] @ [N, heads * P].
        from_state = (cc[n] @ by_group.transpose(-1, -2)).view(groups, size, ratio, head_dim)
        torch.addcmul(within, from_state.transpose(1, 2), decay_in[n], out=out_chunks[n])
        offsets = wanted.get(n, [])
        saved.extend(_state_after(state, xdt[n], bc[n], cum[n], j) for j in offsets if j < size)
        written = (tokens[n] * to_end[n]).view(size, groups, ratio * head_dim).transpose(0, 1)
        state.mul_(chunk_decay[n])
        by_group.baddbmm_(written.transpose(-1, -2), bc[n])
        if offsets and offsets[-1] == size:
            saved.append(state.clone())
    return saved


def _state_after(
    state: torch.Tensor, xdt: torch.Tensor, b: torch.Tensor, cum: torch.Tensor, j: int
) -> torch.Tensor:
    """The SSM state after the first j tokens of a chunk that started from `state` `[H, P, N]`:
    e^{s_j} S0 + sum_{r<=j} e^{s_j - s_r} dt_r x_r B_r^T; xdt `[H, C, P]`, b `[G, C, N]`,
    cum `[H, C]`. The heads of a group share B: one [heads * P, j] @ [j, N] matmul per group."""
    groups, num_heads, head_dim = b.shape[0], state.shape[0], state.shape[1]
    end = cum[:, j - 1 : j]
    x_to_j = (xdt[:, :j] * decay_exp(end - cum[:, :j])[..., None]).transpose(-1, -2)  # [H, P, j]
    written = x_to_j.reshape(groups, -1, j) @ b[:, :j]  # [G, heads * P, N]
    return written.view(num_heads, head_dim, -1).add_(state * decay_exp(end)[..., None])


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
    `D`, `norm.weight`, `out_proj`).

    `scan_chunk_size` is the tokens per matmul of the chunked scan (None: by device and form, see
    `ssd_chunked`); the result does not depend on it. The checkpoint's `mamba_chunk_size`
    is the size its GPU kernels use; plain torch runs faster with smaller chunks.
    """

    def __init__(
        self, dims: Mamba2Dims, layer_index: int, *, scan_chunk_size: int | None = None
    ) -> None:
        super().__init__()
        self.dims = dims
        self.scan_chunk_size = scan_chunk_size
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

    def _inputs(
        self, conv_out: torch.Tensor, dt_raw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `[L, H, P]`, dt `[L, H]` (discretised), a `[H]`, b and c `[L, G, N]` from the
        activated conv output and the raw dt of L tokens."""
        d, n = self.dims, conv_out.shape[0]
        group_dim = d.num_groups * d.state_size
        xs, b, c = conv_out.split([d.inner_size, group_dim, group_dim], dim=-1)
        xs = xs.float().reshape(n, d.num_heads, d.head_dim)
        b = b.float().reshape(n, d.num_groups, d.state_size)
        c = c.float().reshape(n, d.num_groups, d.state_size)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())
        dt = dt.clamp(min=d.time_step_limit[0], max=d.time_step_limit[1])
        return xs, dt, -torch.exp(self.A_log.float()), b, c

    def _decode(
        self,
        xbc: torch.Tensor,
        dt_raw: torch.Tensor,
        state: State,
        ssm_views: Sequence[torch.Tensor] | None = None,
        conv_views: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, State]:
        """One token for each of B requests (`xbc` `[B, conv_dim]`, states stacked `[B, ...]`):
        y `[B, inner]` and the new states. With `ssm_views` (each request's SSM state where
        it lies, `[H, P, N]`) those advance in place and only the conv states come back; with
        `conv_views` too, the conv states shift in place (the C kernel's conv and activation
        in one call) and nothing comes back."""
        weight, new = self.conv1d.weight[:, 0], {}
        kernels = cpu_kernels.for_tensor(xbc)
        activated = None
        if conv_views is not None and kernels is not None:
            activated = kernels.conv_step(conv_views, xbc, weight, self.conv1d.bias, self.dims.act)
        if activated is None:
            # The states where they lie, gathered, or the loaded ones.
            conv_state = state["conv"] if conv_views is None else torch.stack(list(conv_views))
            conv_out, new["conv"] = conv_step(xbc, conv_state, weight, self.conv1d.bias)
            if conv_views is not None:
                for view, row in zip(conv_views, new.pop("conv"), strict=True):
                    view.copy_(row)
            activated = self.act(conv_out)
        xs, dt, a, b, c = self._inputs(activated, dt_raw)
        if ssm_views is not None:
            y = ssd_step_in_place(xs, dt, a, b, c, ssm_views)
        else:
            # The loaded states are this step's copies (`load_states`): advanced in place.
            y, new["ssm"] = ssd_step(xs, dt, a, b, c, state["ssm"].float())
        y = y + xs * self.D.float()[:, None]
        return y.reshape(xbc.shape[0], -1), new

    def _mix(
        self, xbc: torch.Tensor, dt_raw: torch.Tensor, state: State, snapshots: tuple[int, ...]
    ) -> tuple[torch.Tensor, State, list[State]]:
        """Conv and scan over one request's chunk: y `[L, inner]`, the new state and the states
        after each count in `snapshots`."""
        n = xbc.shape[0]
        check_snapshots(snapshots, n)
        conv_out, conv_state, conv_saved = causal_conv1d(
            xbc, state["conv"], self.conv1d.weight[:, 0], self.conv1d.bias, snapshots
        )
        xs, dt, a, b, c = self._inputs(self.act(conv_out), dt_raw)
        ssm = state["ssm"].float()
        if n <= MAMBA2_LOOP_MAX_TOKENS:
            y, ssm, ssm_saved = ssd_recurrent(xs, dt, a, b, c, ssm, snapshots=snapshots)
        else:
            y, ssm, ssm_saved = ssd_chunked(
                xs, dt, a, b, c, ssm, chunk_size=self.scan_chunk_size, snapshots=snapshots
            )
        y = y + xs * self.D.float()[:, None]
        saved = [{"conv": cs, "ssm": s} for cs, s in zip(conv_saved, ssm_saved, strict=True)]
        return y.reshape(n, -1), {"conv": conv_state, "ssm": ssm}, saved

    def _finish(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.norm(y.to(z.dtype), z))

    def forward_sequence(
        self, x: torch.Tensor, state: State, snapshots: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, State, list[State]]:
        """One request's tokens `[L, hidden]` from `state`: the output, the final state and the
        states after each count in `snapshots`."""
        z, xbc, dt = self._project(x)
        y, state, saved = self._mix(xbc, dt, state, snapshots)
        return self._finish(y, z), state, saved

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The flat batch `[T, hidden]`; each request's chunk continues from its loaded state
        and its requested snapshots are saved through `ctx`."""
        z, xbc, dt = self._project(x)
        y = x.new_empty(x.shape[0], self.dims.inner_size, dtype=torch.float32)
        decodes, others = decode_batch(ctx.state_chunks(self.layer_index))
        if decodes:
            index = torch.tensor([c.rows.start for c in decodes], device=x.device)
            views = ctx.state_views(self.layer_index, decodes, "ssm")
            conv_views = (
                None if views is None else ctx.state_views(self.layer_index, decodes, "conv")
            )
            names = None if views is None else ("conv",)
            states = (
                {} if conv_views is not None else ctx.load_states(self.layer_index, decodes, names)
            )
            out, states = self._decode(xbc[index], dt[index], states, views, conv_views)
            y.index_copy_(0, index, out)
            if states:
                ctx.save_states(self.layer_index, decodes, states)
            for name, in_place in (("ssm", views), ("conv", conv_views)):
                if in_place is not None:
                    ctx.copy_state_views(self.layer_index, decodes, name)
        for chunk in others:
            state = ctx.load_state(self.layer_index, chunk)
            rows = chunk.rows
            y[rows], _, saved = self._mix(xbc[rows], dt[rows], state, chunk.snapshots)
            for count, snapshot in zip(chunk.snapshots, saved, strict=True):
                ctx.save_state(self.layer_index, chunk, count, snapshot)
        return self._finish(y, z)
