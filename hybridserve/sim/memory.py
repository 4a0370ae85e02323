"""The KV pool as vLLM sizes it, and the two start-up log lines it prints about it.

vLLM (v1 `gpu_worker.Worker.determine_available_memory`) loads the weights, runs one profile
forward pass (`gpu_model_runner.profile_run`: a dummy batch of `max_num_batched_tokens` tokens
spread over `min(max_num_seqs, tokens)` requests, then a dummy sampler run over `max_num_seqs`
rows of logits), and gives the KV cache what is left of the requested memory:

    available = total x gpu_memory_utilization - weights - peak activations - non-torch memory

`total` is CUDA's total (`torch.cuda.mem_get_info()[1]`, the "total_gpu_memory" of its log), not
the datasheet's GB. The pool is then `available // (page_bytes x layers_per_kv_group)` block ids
(`kv_cache_utils.get_num_blocks`): every KV cache group holds `layers_per_kv_group` layers whose
pages are padded to one size (a hybrid model's attention block grows until its page holds a
recurrent state), and every group takes its own block ids from the pool.

The peak-activation term is not derived from vLLM's kernels but fitted on vLLM's own memory
logs: the llm-d-benchmark repository (`config_explorer/empirical-vllm-memory-results.md`) lists
"Peak activation memory" for six models on an H100 with vLLM's defaults (max_num_seqs 1,024,
max_num_batched_tokens 8,192): Qwen3-0.6B 5.56 GiB, Qwen3-32B 5.64, Llama-3.1-8B 4.76,
Llama-3.3-70B-FP8 TP2 4.84, gpt-oss-20b and gpt-oss-120b 7.38. They follow the vocabulary
(the sampler's fp32 logits and its working copies) and, weakly, the hidden size:
38.2 bytes per (sequence x vocabulary entry) plus 2.69 bytes per (batched token x hidden unit)
reproduces all six within 0.005 GiB. Routed experts add the fused-MoE kernel's intermediate
caches (tokens x top-k x the larger of 2 x intermediate/tp and hidden, plus tokens x top-k x
intermediate/tp, in bf16). Non-torch memory (CUDA context, cuBLAS workspaces, NCCL buffers) is
that page's 0.13 GiB on one GPU and 0.55 GiB under TP.

docs/cost_model.md ("KV pool") checks the rule on a vLLM 0.10.2 log of Qwen3-Next-80B-A3B in
bf16 at TP2 on H200: 44.59 GiB available, 7,162 blocks, "GPU KV cache size: 973,760 tokens",
"Maximum concurrency for 262,144 tokens per request: 14.77x".
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from hybridserve.core.errors import ConfigError
from hybridserve.kvcache.spec import FullAttentionSpec, GroupSpec, MambaSpec, SlidingWindowSpec
from hybridserve.sim.gpus import Gpu
from hybridserve.sim.model_profiles import ModelProfile

GIB = float(1 << 30)
SAMPLER_BYTES_PER_SEQ_VOCAB = 38.2  # fitted: dummy sampler run over max_num_seqs logits rows
RESIDUAL_BYTES_PER_TOKEN_HIDDEN = 2.69  # fitted: the profile batch's hidden-state buffers
NON_TORCH_BYTES_TP1 = 0.13 * GIB
NON_TORCH_BYTES_TP = 0.55 * GIB
_BF16 = 2.0


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryAccount:
    """One GPU's memory account, as vLLM's memory-profiling log line itemises it."""

    total_bytes: float
    gpu_memory_utilization: float
    weight_bytes: float
    activation_bytes: float
    non_torch_bytes: float
    bytes_per_block: float

    @property
    def requested_bytes(self) -> float:
        return self.total_bytes * self.gpu_memory_utilization

    @property
    def available_bytes(self) -> float:
        """ "Available KV cache memory": what the weights and the profile run leave."""
        return (
            self.requested_bytes
            - self.weight_bytes
            - self.activation_bytes
            - (self.non_torch_bytes)
        )

    @property
    def num_blocks(self) -> int:
        return max(0, int(self.available_bytes // self.bytes_per_block))

    def as_dict(self) -> dict[str, float]:
        return {
            "total_gib": self.total_bytes / GIB,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "weights_gib": self.weight_bytes / GIB,
            "activation_peak_gib": self.activation_bytes / GIB,
            "non_torch_gib": self.non_torch_bytes / GIB,
            "available_kv_gib": self.available_bytes / GIB,
            "bytes_per_block": self.bytes_per_block,
            "num_blocks": float(self.num_blocks),
        }


def bytes_per_block(
    model: ModelProfile, *, tp: int = 1, kv_dtype: str = "bf16", dcp: int = 1
) -> float:
    """Bytes one block id costs on one GPU: `layers_per_kv_group` pages of the largest page of
    any kind (vLLM pads a recurrent state page to the attention page and vice versa). Under DCP
    a full-attention block holds `block_size` tokens on each rank, of the KV heads that rank's
    TP/DCP slice keeps (`num_kv_heads / (tp / dcp)`); a state page is split by TP alone."""
    pages = []
    for g in model.cache_groups():
        width = tp // dcp if g.dcp_sharded else tp
        pages.append(model.page_bytes_per_layer(g, dtype=kv_dtype, tp=width))
    return model.layers_per_kv_group * max(pages)


def serving_weight_bytes(model: ModelProfile, *, dtype: str, tp: int) -> float:
    """Weight bytes on one GPU: the model (its MTP layers when they are loaded) over TP. An fp8
    or fp4 checkpoint keeps its embedding and LM head in bf16 (ModelOpt, compressed-tensors and
    the Qwen FP8 releases leave `lm_head` and `embed_tokens` unquantised)."""
    return model.weight_bytes(dtype) / tp


def activation_bytes(
    model: ModelProfile, *, tp: int, max_num_seqs: int, max_num_batched_tokens: int
) -> float:
    """Peak activation memory of vLLM's profile run on one GPU (the fitted rule above)."""
    seqs = min(max_num_seqs, max_num_batched_tokens)
    total = SAMPLER_BYTES_PER_SEQ_VOCAB * seqs * model.vocab_size
    total += RESIDUAL_BYTES_PER_TOKEN_HIDDEN * max_num_batched_tokens * model.hidden_size
    moe = model.moe
    if moe is not None and model.num_moe_layers:
        rows = max_num_batched_tokens * moe.num_experts_per_tok
        inter = moe.moe_intermediate_size / tp
        total += _BF16 * rows * (max(2 * inter, model.hidden_size) + inter)
    return total


def vllm_memory_account(
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
) -> MemoryAccount:
    """The memory account of one GPU of a `tp`-wide replica. Raises ConfigError for a
    utilization outside (0, 1]."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(
            "gpu_memory_utilization", gpu_memory_utilization, "use a fraction in (0, 1]"
        )
    return MemoryAccount(
        total_bytes=gpu.memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes=serving_weight_bytes(model, dtype=dtype, tp=tp),
        activation_bytes=activation_bytes(
            model, tp=tp, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        non_torch_bytes=NON_TORCH_BYTES_TP1 if tp == 1 else NON_TORCH_BYTES_TP,
        bytes_per_block=bytes_per_block(model, tp=tp, kv_dtype=kv_dtype, dcp=dcp),
    )


def kv_cache_tokens(num_blocks: int, groups: tuple[GroupSpec, ...], *, dcp: int = 1) -> int:
    """vLLM's "GPU KV cache size: N tokens": `num_blocks // len(groups) * min block size`, times
    the DCP width (a sharded block holds `block_size` tokens on each of N ranks)."""
    smallest = min(g.block_size for g in groups)
    return num_blocks // len(groups) * smallest * dcp


def blocks_per_request(
    groups: tuple[GroupSpec, ...],
    max_model_len: int,
    *,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    dcp: int = 1,
) -> int:
    """Block ids one request of `max_model_len` tokens can hold, summed over the groups, as
    vLLM's `max_memory_usage_bytes` counts them: a full-attention group ceil(L / (block x dcp)),
    a sliding-window group ceil(min(window - 1 + batched tokens, L) / block) + 1, a state group
    one block."""
    total = 0
    for g in groups:
        if isinstance(g, MambaSpec):
            total += 1
        elif isinstance(g, SlidingWindowSpec):
            tokens = min(g.window - 1 + max_num_batched_tokens, max_model_len)
            total += -(-tokens // g.block_size) + 1
        elif isinstance(g, FullAttentionSpec):
            total += -(-max_model_len // (g.block_size * dcp))
        else:  # chunked local and any other windowed kind: bounded like a window
            total += -(-min(max_model_len, max_num_batched_tokens) // g.block_size) + 1
    return total


def max_concurrency(
    num_blocks: int, groups: tuple[GroupSpec, ...], max_model_len: int, **options: int
) -> float:
    """vLLM's "Maximum concurrency for L tokens per request: Xx"."""
    return num_blocks / blocks_per_request(groups, max_model_len, **options)


def vllm_log_lines(
    *,
    account: MemoryAccount | None,
    num_blocks: int,
    groups: tuple[GroupSpec, ...],
    max_model_len: int,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    dcp: int = 1,
) -> list[str]:
    """The lines vLLM logs about the pool, with this pool's figures, so they can be held against a
    real start-up log."""
    lines = []
    if account is not None:
        lines.append(f"Available KV cache memory: {account.available_bytes / GIB:.2f} GiB")
    tokens = kv_cache_tokens(num_blocks, groups, dcp=dcp)
    concurrency = max_concurrency(
        num_blocks, groups, max_model_len, max_num_batched_tokens=max_num_batched_tokens, dcp=dcp
    )
    lines.append(f"GPU KV cache size: {tokens:,} tokens")
    lines.append(
        f"Maximum concurrency for {max_model_len:,} tokens per request: {concurrency:.2f}x"
    )
    return lines
