"""GPU step-time model: the time of one engine step as a sum of named roofline terms.

Each term is max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x efficiency)) for one kind
of work, so every prediction can be explained term by term (Vidur's lesson). docs/cost_model.md
lists each term, each constant and its source, and compares predictions with measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple, Protocol

from hybridserve.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepPlan
from hybridserve.kvcache.spec import FullAttentionSpec, SlidingWindowSpec
from hybridserve.sim.gpus import Gpu, dtype_bytes
from hybridserve.sim.memory import GIB, vllm_memory_account
from hybridserve.sim.memory import bytes_per_block as bytes_per_block  # re-exported
from hybridserve.sim.model_profiles import ModelProfile, embedding_dtype

_ACT_BYTES = 2.0  # activations, attention math and recurrent state stay in bf16
_FULL = FullAttentionSpec(block_size=16)  # block size is irrelevant for per-token bytes
_MLA = FullAttentionSpec(block_size=16, mla=True)


class RequestShape(NamedTuple):
    """One request's work in a step."""

    num_new_tokens: int  # tokens computed this step (prefill chunk, 1 decode, or k+1 verify)
    num_context_tokens: int  # tokens already in the cache before them
    num_draft_tokens: int = 0  # of the new tokens, unverified drafts (verify = k + 1 tokens)
    sample: bool = True  # the step produces logits for this request

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens <= 1 + self.num_draft_tokens

    @property
    def num_logit_tokens(self) -> int:
        return 1 + self.num_draft_tokens if self.sample else 0


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the cost model needs to know about a step: per-request token counts."""

    requests: tuple[RequestShape, ...]
    scheduler_cpu_s: float = 0.0  # measured schedule() + update() CPU time, added as a term
    # Context tokens of the step's decodes whose full-attention KV blocks another decode of
    # the step reads too (a shared system prompt), counted once per extra reader: what a
    # decode-attention kernel can read once (`Efficiency.shared_kv`).
    shared_kv_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    @classmethod
    def decode(
        cls, *, batch: int, context_tokens: int, verify_tokens: int = 1, shared_tokens: int = 0
    ) -> StepShape:
        """`batch` decodes at `context_tokens`; `verify_tokens` = k + 1 with k drafts; the
        first `shared_tokens` of every context in the same blocks (a shared prefix)."""
        request = RequestShape(verify_tokens, context_tokens, verify_tokens - 1)
        return cls((request,) * batch, shared_kv_tokens=shared_tokens * (batch - 1))

    @property
    def shared_prefix_tokens(self) -> int:
        """The shared prefix of a `decode(shared_tokens=...)` shape: every request's first
        tokens (0 for a step of one request)."""
        others = len(self.requests) - 1
        return self.shared_kv_tokens // others if others > 0 else 0

    @classmethod
    def prefill(cls, num_tokens: int, *, context_tokens: int = 0) -> StepShape:
        """One prefill chunk of `num_tokens` after `context_tokens` cached tokens."""
        return cls((RequestShape(num_tokens, context_tokens),))


def shape_from_plan(
    plan: StepPlan, *, scheduler_cpu_s: float = 0.0, shared_kv_tokens: int = 0
) -> StepShape:
    """The StepShape of a scheduler's StepPlan (chunk.start = tokens already computed);
    `shared_kv_tokens` from a `hybridserve.engine.shared_kv.DecodeSharing` following the plans."""
    requests = tuple(
        RequestShape(len(c.token_ids), c.start, c.num_draft_tokens, c.sample) for c in plan.chunks
    )
    return StepShape(requests, scheduler_cpu_s, shared_kv_tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCost:
    """Seconds per term of one step; `total_s` is their sum."""

    linear_s: float = 0.0  # dense projections, MLPs, shared experts, router, LM head
    moe_s: float = 0.0  # routed experts: the expected distinct experts the step's tokens touch
    attention_prefill_s: float = 0.0  # full attention of prefill chunks (causal FLOPs)
    attention_decode_s: float = 0.0  # full attention of decodes/verifies (KV bytes read)
    sliding_window_s: float = 0.0  # sliding-window layers, context bounded by the window
    mla_s: float = 0.0  # multi-head latent attention (latent KV bytes)
    state_s: float = 0.0  # Mamba2 / GDN: state read+write per sequence, chunked-scan FLOPs
    tp_allreduce_s: float = 0.0  # 2 ring all-reduces per layer over the interconnect
    dcp_allgather_s: float = 0.0  # decode context parallel: query and output+LSE all-gathers
    draft_s: float = 0.0  # MTP/EAGLE draft passes: one over the step's tokens, k - 1 over 1 each
    launch_s: float = 0.0  # fixed per-step overhead (launches, sampling, host sync)
    scheduler_s: float = 0.0  # measured scheduler CPU time passed in by the caller

    @property
    def total_s(self) -> float:
        return sum(self.terms().values())

    def terms(self) -> dict[str, float]:
        """Every term by name, in seconds."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """Fractions of datasheet peaks that kernels reach, and fixed latencies. The defaults are
    fitted on published serving measurements by benchmarks/fit_cost_model.py (docs/cost_model.md,
    "Fitting"), each fraction bounded by the top of the range kernel benchmarks report."""

    gemm: float = 0.491  # GEMMs (projections, MLPs, experts): fraction of dense peak of the dtype
    attention: float = 0.703  # flash attention / chunked scans: fraction of bf16 peak
    hbm: float = 0.894  # streaming reads: fraction of HBM bandwidth
    link: float = 0.589  # NCCL ring bus bandwidth: fraction of per-direction link bandwidth
    collective_latency_s: float = 10e-6  # fixed cost of one collective (not fitted)
    step_overhead_s: float = 2.93e-3  # per step: launches, sampling, host-device sync
    # Fitted on the hybrid rows H1 and H3 (docs/cost_model.md, "Hybrid rows"), not by
    # fit_cost_model.py: the fused routed-expert kernels' fraction of HBM bandwidth (a decode
    # step's experts see one or two tokens each), and the fixed time each gated-delta-net or
    # Mamba layer adds to a step (its conv, gating, recurrence and gated-norm kernels).
    moe_hbm: float = 0.38
    recurrent_layer_s: float = 11.4e-6
    # Reads of the KV cache (full, sliding-window and latent attention): a fraction of HBM
    # bandwidth of their own, or None for `hbm`'s. A GPU's paged-attention kernels read KV
    # blocks at about the rate a GEMM reads weights (the published rows fit one fraction); an
    # executor that gathers the keys into a contiguous copy before attending (the torch
    # executor on a CPU) reads every KV byte twice and writes it once, so its KV bytes cost
    # more than its weight bytes, and `calibrate` fits the two apart (docs/fidelity.md).
    kv_hbm: float | None = None
    # The share of a decode's KV reads that costs nothing when another decode of the step reads
    # the same blocks (`StepShape.shared_kv_tokens`): 0, every decode streams all its KV from
    # memory; 1, a shared block is read once a step. A CPU's paged decode kernel finds a shared
    # system prompt in its caches; a GPU's only where its attention runs the shared prefix as
    # one call (vLLM's cascade attention) or its L2 keeps it. 0 by default (every GPU figure is
    # priced without it); `calibrate` fits it on decode batches that share a prefix.
    shared_kv: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gemm", "attention", "hbm", "link", "moe_hbm", "kv_hbm"):
            value = getattr(self, name)
            if name == "kv_hbm" and value is None:
                continue
            if not 0 < value <= 1:
                raise ConfigError(f"efficiency.{name}", value, "use a fraction in (0, 1]")
        if not 0 <= self.shared_kv <= 1:
            raise ConfigError("efficiency.shared_kv", self.shared_kv, "use a fraction in [0, 1]")
        for name in ("collective_latency_s", "step_overhead_s", "recurrent_layer_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"efficiency.{name}", getattr(self, name), "use >= 0 seconds")

    @property
    def kv_bandwidth(self) -> float:
        """The fraction of HBM bandwidth at which the KV cache is read."""
        return self.hbm if self.kv_hbm is None else self.kv_hbm


class CostModel(Protocol):
    def step_cost(self, batch: StepShape) -> StepCost:
        """The modelled time of one step, by term. Does not mutate."""
        ...


def causal_pairs(context: int, new: int, window: int | None = None) -> int:
    """(query, key) pairs attended by `new` tokens after `context` (keys within `window`)."""
    if window is None:
        return new * context + new * (new + 1) // 2
    end = context + new
    ramp_end = min(max(window - 1, context), end)  # positions whose reach is below the window
    ramp = (ramp_end * (ramp_end + 1) - context * (context + 1)) // 2
    return ramp + (end - ramp_end) * window


class RooflineCostModel:
    """CostModel for one model replica on `tp` GPUs, `dcp` of them sharding full-attention KV."""

    def __init__(
        self,
        gpu: Gpu,
        model: ModelProfile,
        *,
        tp: int = 1,
        dcp: int = 1,
        dtype: str = "bf16",
        kv_dtype: str = "bf16",
        efficiency: Efficiency = Efficiency(),  # frozen, so sharing the default is safe
        num_draft_passes: int = 0,
    ) -> None:
        if tp < 1:
            raise ConfigError("tp", tp, "use a tensor-parallel width of 1 or more")
        if dcp < 1 or tp % dcp:
            raise ConfigError("dcp", dcp, f"use a DCP width that divides tp={tp}")
        if num_draft_passes < 0:
            raise ConfigError("num_draft_passes", num_draft_passes, "use 0 or more")
        self.gpu, self.model, self.tp, self.dcp = gpu, model, tp, dcp
        # k draft passes per step, each one forward of a decoder layer of the model's shape (its
        # MTP layer; vLLM runs the drafter num_speculative_tokens times after the target).
        self.num_draft_passes = num_draft_passes
        self.weight_bytes = dtype_bytes(dtype)
        # The LM head (and embedding) stay in bf16 under fp8/fp4 weights (models.weight_bytes).
        head_dtype = embedding_dtype(dtype)
        self._head_bytes = dtype_bytes(head_dtype)
        self._head_flops = gpu.peak_flops(head_dtype) * efficiency.gemm
        # KV and recurrent state stay in the activation dtype unless asked otherwise, as vLLM's
        # kv_cache_dtype=auto does for an fp8 checkpoint (the block sizes assume bf16 pages).
        self.kv_dtype = kv_dtype
        self.eff = efficiency
        self._gemm_flops = gpu.peak_flops(dtype) * efficiency.gemm
        # Attention math runs in bf16, or in fp32 when the whole model does (a CPU).
        attn_dtype = "fp32" if dtype == "fp32" else "bf16"
        self._attn_flops = gpu.peak_flops(attn_dtype) * efficiency.attention
        self._hbm = gpu.hbm_bytes_per_s * efficiency.hbm
        self._hbm_moe = gpu.hbm_bytes_per_s * efficiency.moe_hbm
        self._kv_read = gpu.hbm_bytes_per_s * efficiency.kv_bandwidth

    def step_cost(self, batch: StepShape) -> StepCost:
        """The modelled time of `batch`, by term. Does not mutate."""
        if not batch.requests:
            return StepCost(scheduler_s=batch.scheduler_cpu_s)
        prefill, decode = self._full_attention(batch)
        return StepCost(
            linear_s=self._linear(batch),
            moe_s=self._moe(batch.num_tokens),
            attention_prefill_s=prefill,
            attention_decode_s=decode,
            sliding_window_s=self._sliding_window(batch),
            mla_s=self._mla(batch),
            state_s=self._state(batch),
            tp_allreduce_s=self._tp_allreduce(batch.num_tokens),
            dcp_allgather_s=self._dcp_allgather(batch.num_tokens),
            draft_s=self._draft(batch),
            launch_s=self.eff.step_overhead_s,
            scheduler_s=batch.scheduler_cpu_s,
        )

    def _roofline(self, flops: float, num_bytes: float, *, gemm: bool, kv: bool = False) -> float:
        """Compute- or read-bound seconds: GEMM or attention FLOPs, and bytes read at the
        streaming rate (`kv`: KV-cache bytes, at `Efficiency.kv_bandwidth`)."""
        peak = self._gemm_flops if gemm else self._attn_flops
        return max(flops / peak, num_bytes / (self._kv_read if kv else self._hbm))

    def _linear(self, batch: StepShape) -> float:
        m, tp = self.model, self.tp
        params = m.dense_linear_params() / tp
        body = self._roofline(2 * batch.num_tokens * params, params * self.weight_bytes, gemm=True)
        logits = sum(r.num_logit_tokens for r in batch.requests)
        return body + self._lm_head(logits)

    def _lm_head(self, rows: int) -> float:
        if rows == 0:
            return 0.0
        head = self.model.vocab_size * self.model.hidden_size / self.tp
        flops_s = 2 * rows * head / self._head_flops
        return max(flops_s, head * self._head_bytes / self._hbm)

    def _moe(self, num_tokens: int, *, layers: int | None = None) -> float:
        moe = self.model.moe
        if moe is None or num_tokens == 0:
            return 0.0
        expert = moe.expert_params(self.model.hidden_size) / self.tp
        touched = expected_experts(moe.num_experts, moe.num_experts_per_tok, num_tokens)
        flops = 2 * num_tokens * moe.num_experts_per_tok * expert
        weights = touched * expert * self.weight_bytes
        per_layer = max(flops / self._gemm_flops, weights / self._hbm_moe)
        return (self.model.num_moe_layers if layers is None else layers) * per_layer

    def _full_attention(self, batch: StepShape) -> tuple[float, float]:
        """(prefill, decode) seconds of the full-attention layers.

        Under DCP (vLLM's: it reuses the TP ranks) each rank holds the KV heads of its TP/DCP
        slice, `num_kv_heads / (tp / dcp)`, for 1/dcp of the tokens, and attends the query heads
        of those KV heads (gathered across the DCP group) over its shard: the KV it reads falls
        by up to dcp, its FLOPs stay those of heads/tp over every pair."""
        m = self.model
        if m.attention is None or m.num_full_layers == 0:
            return 0.0, 0.0
        heads = m.attention.num_heads / self.tp
        flops_per_pair = 4 * heads * m.attention.head_dim * m.num_full_layers
        kv_token = m.kv_bytes_per_token(_FULL, dtype=self.kv_dtype, tp=self.tp // self.dcp)
        prefill = decode = decode_flops_s = 0.0
        for r in batch.requests:
            flops = flops_per_pair * causal_pairs(r.num_context_tokens, r.num_new_tokens)
            read = (r.num_context_tokens + r.num_new_tokens) / self.dcp
            seconds = self._roofline(
                flops, kv_token * (read + r.num_new_tokens), gemm=False, kv=True
            )
            if r.is_decode:
                decode += seconds
                decode_flops_s += flops / self._attn_flops
            else:
                prefill += seconds
        if batch.shared_kv_tokens and self.eff.shared_kv:
            # Repeated reads of shared blocks, down to the decodes' arithmetic at most.
            shared = kv_token * batch.shared_kv_tokens / self.dcp * self.eff.shared_kv
            decode = max(decode - shared / self._kv_read, decode_flops_s)
        return prefill, decode

    def _sliding_window(self, batch: StepShape) -> float:
        m, window = self.model, self.model.sliding_window
        if m.attention is None or window is None or m.num_swa_layers == 0:
            return 0.0
        swa = SlidingWindowSpec(block_size=16, window=window)
        kv_token = m.kv_bytes_per_token(swa, dtype=self.kv_dtype, tp=self.tp)
        flops_per_pair = 4 * m.attention.num_heads / self.tp * m.attention.head_dim
        total = 0.0
        for r in batch.requests:
            pairs = causal_pairs(r.num_context_tokens, r.num_new_tokens, window)
            read = min(r.num_context_tokens, window - 1) + 2 * r.num_new_tokens
            flops = flops_per_pair * m.num_swa_layers * pairs
            total += self._roofline(flops, kv_token * read, gemm=False, kv=True)
        return total

    def _mla(self, batch: StepShape) -> float:
        m, mla = self.model, self.model.mla
        if mla is None or m.num_mla_layers == 0:
            return 0.0
        heads = mla.num_heads / self.tp
        latent = m.kv_bytes_per_token(_MLA, dtype=self.kv_dtype)  # replicated across TP
        total = 0.0
        for r in batch.requests:
            # Decode runs absorbed (scores and values over the latent); prefill expands heads.
            if r.is_decode:
                dims = 2 * mla.kv_lora_rank + mla.qk_rope_head_dim
            else:
                dims = mla.qk_dim + mla.v_head_dim
            pairs = causal_pairs(r.num_context_tokens, r.num_new_tokens)
            flops = 2 * heads * dims * pairs * m.num_mla_layers  # DCP: as full attention
            read = (r.num_context_tokens + r.num_new_tokens) / self.dcp + r.num_new_tokens
            total += self._roofline(flops, latent * read, gemm=False, kv=True)
        return total

    def _state(self, batch: StepShape) -> float:
        """Recurrent layers: each sequence's state is read and written once per step."""
        m, rec = self.model, self.model.recurrent
        if rec is None or m.num_recurrent_layers == 0:
            return 0.0
        state = m.state_bytes_per_sequence(tp=self.tp)
        flops_per_token = rec.scan_flops_per_token() * m.num_recurrent_layers / self.tp
        total = m.num_recurrent_layers * self.eff.recurrent_layer_s
        for r in batch.requests:
            total += self._roofline(flops_per_token * r.num_new_tokens, 2 * state, gemm=False)
        return total

    def _draft(self, batch: StepShape) -> float:
        """MTP draft passes (vLLM `propose`): the first runs the MTP layer over every token the
        step computed (it reads the target's hidden states), the next k - 1 over one token per
        sampled request; each is one decoder layer of the model's kind (attention over that
        layer's own KV, the MLP or experts), the [embedding; hidden] projection and the LM head
        of one row per sampled request."""
        k = self.num_draft_passes
        rows = sum(1 for r in batch.requests if r.sample)
        if k == 0 or rows == 0:
            return 0.0
        m, tp = self.model, self.tp
        params = m.mtp_layer_params()  # everything every token touches, routed experts aside
        if m.moe is not None:
            params -= m.moe.num_experts * m.moe.expert_params(m.hidden_size)
        dense = params / tp
        kv_token = 0.0
        heads, head_dim = 0.0, 0
        if m.attention is not None:
            kv_token = 2 * max(1.0, m.attention.num_kv_heads / tp) * m.attention.head_dim
            kv_token *= dtype_bytes(self.kv_dtype)
            heads, head_dim = m.attention.num_heads / tp, m.attention.head_dim
        # Pass 1 over every computed token (its causal pairs over the context), passes 2..k
        # over one token per sampled request; the draft layer's attention of a pass is one
        # batched kernel, so its FLOPs and bytes are summed over the batch before the roofline.
        first_pairs = first_kv = 0.0
        next_pairs = next_kv = 0.0
        for r in batch.requests:
            first_pairs += causal_pairs(r.num_context_tokens, r.num_new_tokens)
            first_kv += r.num_context_tokens + 2 * r.num_new_tokens
            if r.sample:
                end = r.num_context_tokens + r.num_new_tokens
                next_pairs += end + 1
                next_kv += end + 2
        attn = 4 * heads * head_dim
        total = 0.0
        for tokens, pairs, kv in [(batch.num_tokens, first_pairs, first_kv)] + [
            (rows, next_pairs, next_kv)
        ] * (k - 1):
            total += self._roofline(2 * tokens * dense, dense * self.weight_bytes, gemm=True)
            total += self._moe(tokens, layers=1) if m.moe is not None else 0.0
            total += self._roofline(attn * pairs, kv_token * kv, gemm=False, kv=True)
            total += self._lm_head(rows)
        return total

    def _ring_bus_s(self, num_bytes: float) -> float:
        return num_bytes / (self.gpu.link_bytes_per_s * self.eff.link) + (
            self.eff.collective_latency_s
        )

    def _tp_allreduce(self, num_tokens: int) -> float:
        """One all-reduce after every mixer and every MLP/MoE block (2 per decoder layer)."""
        if self.tp == 1:
            return 0.0
        m = self.model
        mixers = m.num_full_layers + m.num_swa_layers + m.num_mla_layers + m.num_recurrent_layers
        count = mixers + m.num_dense_mlp_layers + m.num_moe_layers
        ring = 2 * (self.tp - 1) / self.tp * num_tokens * m.hidden_size * _ACT_BYTES
        return count * self._ring_bus_s(ring)

    def _dcp_allgather(self, num_tokens: int) -> float:
        """Per sharded layer, three ring collectives over the DCP group (vLLM's
        `cp_lse_ag_out_rs`): all-gather the queries (each rank brings its heads/tp), all-gather
        the partial LSEs (fp32, one per (token, gathered head)), reduce-scatter the rescaled
        partial outputs back to each rank's own heads. A ring moves (dcp - 1) x the per-rank
        share over each link, plus one collective latency."""
        m = self.model
        if self.dcp == 1:
            return 0.0
        if m.mla is not None:
            heads, q_dim, v_dim = m.mla.num_heads, m.mla.latent_dim, m.mla.kv_lora_rank
        elif m.attention is not None:
            heads, q_dim = m.attention.num_heads, m.attention.head_dim
            v_dim = q_dim
        else:
            return 0.0
        n = self.dcp
        rows = num_tokens * heads / self.tp  # (token, head) rows each rank contributes
        gather_q = self._ring_bus_s((n - 1) * rows * q_dim * _ACT_BYTES)
        gather_lse = self._ring_bus_s((n - 1) * rows * n * 4)
        scatter_out = self._ring_bus_s((n - 1) * rows * v_dim * _ACT_BYTES)
        return (m.num_full_layers + m.num_mla_layers) * (gather_q + gather_lse + scatter_out)


def expected_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Distinct experts `num_tokens` tokens touch when each picks `top_k` of `num_experts`
    uniformly: E x (1 - (1 - k/E)^T). Below min(E, T x k), which assumes no two tokens share
    an expert (at E1's ~20-token decode batch on Qwen3-Next, 512 experts top-10: 166 experts,
    not 200)."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def kv_pool_blocks(
    gpu: Gpu,
    model: ModelProfile,
    *,
    tp: int = 1,
    dcp: int = 1,
    dtype: str = "bf16",
    kv_dtype: str = "bf16",
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    gpu_memory_utilization: float = 0.9,
) -> int:
    """Block ids that fit on one GPU, as vLLM sizes its pool (hybridserve.sim.memory).

    Raises ConfigError when the weights and the profile run leave no room for a single block.
    """
    account = vllm_memory_account(
        gpu,
        model,
        tp=tp,
        dcp=dcp,
        dtype=dtype,
        kv_dtype=kv_dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=gpu_memory_utilization,
    )
    if account.num_blocks < 1:
        raise ConfigError(
            "tp",
            tp,
            f"{model.name} needs {account.weight_bytes / GIB:.1f} GiB of weights per GPU and "
            f"{account.activation_bytes / GIB:.1f} GiB for the profile run, more than the "
            f"{account.requested_bytes / GIB:.1f} GiB the engine may use on {gpu.name}; raise tp "
            "or use a smaller dtype",
        )
    return account.num_blocks
