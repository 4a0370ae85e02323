"""Model profiles for the cost model: layer counts per kind, dimensions, weights, KV and state."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridserve.core.errors import ConfigError
from hybridserve.kvcache.spec import FullAttentionSpec, GroupSpec, MambaCacheMode, MambaSpec
from hybridserve.layouts import get_layout
from hybridserve.sim.gpus import dtype_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionDims:
    """Softmax attention (full or sliding window)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    output_gate: bool = False  # Qwen3-Next gated attention: q_proj also emits a sigmoid gate

    def params(self, hidden: int) -> int:
        q = hidden * self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        kv = 2 * hidden * self.num_kv_heads * self.head_dim
        return q + kv + self.num_heads * self.head_dim * hidden


@dataclass(frozen=True, kw_only=True, slots=True)
class MlaDims:
    """Multi-head latent attention (DeepSeek): the cache holds one latent vector per token."""

    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, hidden: int) -> int:
        q_out = self.num_heads * self.qk_dim
        q = (
            hidden * self.q_lora_rank + self.q_lora_rank * q_out
            if self.q_lora_rank
            else hidden * q_out
        )
        kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + hidden * self.latent_dim + kv_b + self.num_heads * self.v_head_dim * hidden


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeDims:
    """Routed experts (gated MLPs) plus an optional shared expert and the router."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_intermediate_size: int = 0

    def expert_params(self, hidden: int) -> int:
        return 3 * hidden * self.moe_intermediate_size

    def always_on_params(self, hidden: int) -> int:
        shared = 3 * hidden * self.shared_intermediate_size
        return shared + hidden * self.num_experts  # + router


@dataclass(frozen=True, kw_only=True, slots=True)
class Mamba2Dims:
    """Mamba2 mixer (SSD). State = SSM state + convolution window."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int = 128

    def state_elems(self) -> int:
        d_inner = self.num_heads * self.head_dim
        conv_dim = d_inner + 2 * self.n_groups * self.state_size
        return d_inner * self.state_size + conv_dim * (self.conv_kernel - 1)

    def params(self, hidden: int) -> int:
        d_inner = self.num_heads * self.head_dim
        in_proj = hidden * (2 * d_inner + 2 * self.n_groups * self.state_size + self.num_heads)
        return in_proj + d_inner * hidden

    def scan_flops_per_token(self) -> float:
        # SSD chunked scan: state in/out (2 matmuls of head_dim x state) plus the intra-chunk
        # quadratic part (chunk x (state + head_dim) per head); Dao & Gu 2024, section 6.
        per_head = 4 * self.head_dim * self.state_size
        per_head += 2 * self.chunk_size * (self.state_size + self.head_dim)
        return float(self.num_heads * per_head)


@dataclass(frozen=True, kw_only=True, slots=True)
class GdnDims:
    """Gated DeltaNet mixer (Qwen3-Next linear attention). State = k x v matrix per value head."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    chunk_size: int = 64

    def state_elems(self) -> int:
        ssm = self.num_value_heads * self.key_head_dim * self.value_head_dim
        conv_dim = 2 * self.num_key_heads * self.key_head_dim
        conv_dim += self.num_value_heads * self.value_head_dim
        return ssm + conv_dim * (self.conv_kernel - 1)

    @property
    def num_heads(self) -> int:
        return self.num_value_heads

    def params(self, hidden: int) -> int:
        qk = 2 * self.num_key_heads * self.key_head_dim
        vz = 2 * self.num_value_heads * self.value_head_dim
        ba = 2 * self.num_value_heads
        return hidden * (qk + vz + ba) + self.num_value_heads * self.value_head_dim * hidden

    def scan_flops_per_token(self) -> float:
        # Chunked delta rule: state read/update (~3 matmuls of k x v) + intra-chunk attention.
        per_head = 6 * self.key_head_dim * self.value_head_dim
        per_head += 2 * self.chunk_size * (self.key_head_dim + self.value_head_dim)
        return float(self.num_value_heads * per_head)


RecurrentDims = Mamba2Dims | GdnDims


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """One model's shape, from its public config.json. Layer counts are per mixer/MLP kind."""

    name: str
    source: str
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    groups: tuple[GroupSpec, ...]  # cache groups (block sizes as vLLM picks them at TP1, bf16)
    num_full_layers: int = 0
    num_swa_layers: int = 0
    num_mla_layers: int = 0
    num_recurrent_layers: int = 0  # Mamba2 or gated-delta-net mixers
    num_dense_mlp_layers: int = 0
    num_moe_layers: int = 0
    # Multi-token-prediction layers the checkpoint ships; loaded (weights and KV) only when the
    # engine speculates with MTP: `loaded(mtp=False)` drops them.
    num_mtp_layers: int = 0
    attention: AttentionDims | None = None
    sliding_window: int | None = None
    mla: MlaDims | None = None
    recurrent: RecurrentDims | None = None
    intermediate_size: int = 0
    mlp_gated: bool = True  # SwiGLU/GeGLU: 3 matrices; relu2 (Nemotron-H): 2
    moe: MoeDims | None = None

    def __post_init__(self) -> None:
        needs = (
            ("attention", self.num_full_layers + self.num_swa_layers, self.attention),
            ("mla", self.num_mla_layers, self.mla),
            ("recurrent", self.num_recurrent_layers, self.recurrent),
            ("moe", self.num_moe_layers, self.moe),
        )
        for field, layers, dims in needs:
            if layers and dims is None:
                raise ConfigError(f"{self.name}.{field}", None, f"give dims for {layers} layers")
        if self.num_swa_layers and not self.sliding_window:
            raise ConfigError(f"{self.name}.sliding_window", None, "give the window in tokens")

    def cache_groups(self) -> tuple[GroupSpec, ...]:
        """One group per layer kind: the logical layout that `cache-replay --model` uses."""
        return self.groups

    @property
    def layers_per_kv_group(self) -> int:
        """Layers per KV cache group as vLLM splits a hybrid model: the smallest kind's layer
        count, or the largest when all kinds are within 25% of each other (vLLM
        `kv_cache_utils._get_kv_cache_groups_uniform_page_size`)."""
        counts = [self.cached_layers(g) for g in self.groups]
        smallest, largest = min(counts), max(counts)
        return largest if largest < smallest * 1.25 else smallest

    def kv_cache_groups(self) -> tuple[GroupSpec, ...]:
        """The cache groups the engine allocates from one pool, as vLLM builds them: each kind
        split into groups of `layers_per_kv_group` layers (the last one padded). Qwen3-Next:
        1 attention group (12 layers + the MTP layer) and 3 gated-delta-net groups of 13;
        Gemma 3 27B: 1 global group of 10 and 6 sliding-window groups. Every group allocates
        its own block ids, and one block id costs `layers_per_kv_group` pages."""
        size = self.layers_per_kv_group
        return tuple(
            spec for spec in self.groups for _ in range(-(-self.cached_layers(spec) // size))
        )

    @property
    def num_layers(self) -> int:
        return (
            self.num_full_layers
            + self.num_swa_layers
            + self.num_mla_layers
            + (self.num_recurrent_layers)
        )

    def mlp_params(self) -> int:
        return (3 if self.mlp_gated else 2) * self.hidden_size * self.intermediate_size

    def mixer_params(self) -> int:
        """Attention, MLA and recurrent projection weights over all layers."""
        h = self.hidden_size
        total = 0
        if self.attention is not None:
            total += (self.num_full_layers + self.num_swa_layers) * self.attention.params(h)
        if self.mla is not None:
            total += self.num_mla_layers * self.mla.params(h)
        if self.recurrent is not None:
            total += self.num_recurrent_layers * self.recurrent.params(h)
        return total

    def dense_linear_params(self) -> int:
        """Weights every token touches, except embeddings, the LM head and routed experts."""
        total = self.mixer_params() + self.num_dense_mlp_layers * self.mlp_params()
        if self.moe is not None:
            total += self.num_moe_layers * self.moe.always_on_params(self.hidden_size)
        return total

    def routed_expert_params(self) -> int:
        if self.moe is None:
            return 0
        per_layer = self.moe.num_experts * self.moe.expert_params(self.hidden_size)
        return self.num_moe_layers * per_layer

    def embedding_params(self) -> int:
        """The token embedding and the LM head (one matrix when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def num_params(self) -> int:
        """The target model's parameters (MTP layers excluded, as published sizes count)."""
        return self.embedding_params() + self.dense_linear_params() + self.routed_expert_params()

    def mtp_layer_params(self) -> int:
        """One MTP layer: a decoder layer of the model's attention kind and its MLP or MoE, plus
        the projection of [embedding; hidden] (2h x h). It shares the embedding and LM head."""
        h = self.hidden_size
        if self.mla is not None:
            mixer = self.mla.params(h)
        elif self.attention is not None:
            mixer = self.attention.params(h)
        else:
            mixer = 0
        if self.moe is not None:
            mlp = self.moe.num_experts * self.moe.expert_params(h) + self.moe.always_on_params(h)
        else:
            mlp = self.mlp_params()
        return mixer + mlp + 2 * h * h

    def weight_bytes(self, dtype: str = "bf16") -> float:
        """Bytes of the loaded weights: the target and its MTP layers in `dtype`, except that an
        fp8 or fp4 checkpoint keeps the embedding and LM head in bf16 (ModelOpt,
        compressed-tensors and the Qwen FP8 releases leave them unquantised)."""
        body = self.num_params() - self.embedding_params()
        body += self.num_mtp_layers * self.mtp_layer_params()
        return body * dtype_bytes(dtype) + self.embedding_params() * dtype_bytes(
            embedding_dtype(dtype)
        )

    def loaded(self, *, mtp: bool) -> ModelProfile:
        """The model as an engine loads it: with its MTP layers only when it speculates with MTP
        (vLLM skips the `mtp.*` weights otherwise, and they hold no KV)."""
        if mtp or self.num_mtp_layers == 0:
            return self
        return replace(self, num_mtp_layers=0)

    def group_layers(self, group: GroupSpec) -> int:
        """How many of the model's (target) layers store their cache in `group`."""
        if isinstance(group, MambaSpec):
            return self.num_recurrent_layers
        if isinstance(group, FullAttentionSpec):
            return self.num_mla_layers if group.mla else self.num_full_layers
        return self.num_swa_layers

    def cached_layers(self, group: GroupSpec) -> int:
        """Layers holding cache in `group`, multi-token-prediction layers included: they are
        full-attention (or MLA) layers with their own KV, allocated with that kind."""
        extra = self.num_mtp_layers if isinstance(group, FullAttentionSpec) else 0
        return self.group_layers(group) + extra

    def page_bytes_per_layer(self, group: GroupSpec, *, dtype: str = "bf16", tp: int = 1) -> float:
        """Bytes of one layer's page in `group` on one GPU: block_size tokens of KV, or one
        recurrent state."""
        if isinstance(group, MambaSpec):
            return self.state_bytes_per_sequence(dtype=dtype, tp=tp) / self.num_recurrent_layers
        per_token = self.kv_bytes_per_token(group, dtype=dtype, tp=tp) / self.group_layers(group)
        return group.block_size * per_token

    def kv_bytes_per_token(self, group: GroupSpec, *, dtype: str = "bf16", tp: int = 1) -> float:
        """KV bytes one GPU stores per token, summed over the group's layers.

        KV heads split over TP (replicated below one head per GPU); an MLA latent is replicated.
        Raises ConfigError for a state group (use state_bytes_per_sequence).
        """
        if isinstance(group, MambaSpec):
            raise ConfigError("group", group, "a state group has no per-token KV")
        layers = self.group_layers(group)
        if isinstance(group, FullAttentionSpec) and group.mla and self.mla is not None:
            return layers * self.mla.latent_dim * dtype_bytes(dtype)
        if self.attention is None:
            return 0.0
        kv_heads = max(1.0, self.attention.num_kv_heads / tp)
        return layers * 2 * kv_heads * self.attention.head_dim * dtype_bytes(dtype)

    def state_bytes_per_sequence(self, *, dtype: str = "bf16", tp: int = 1) -> float:
        """Recurrent state bytes one GPU holds per sequence, summed over recurrent layers."""
        if self.recurrent is None:
            return 0.0
        per_layer = self.recurrent.state_elems() * dtype_bytes(dtype) / tp
        return self.num_recurrent_layers * per_layer


def embedding_dtype(dtype: str) -> str:
    """The dtype the embedding and LM head stay in: bf16 under fp8/fp4 weights."""
    return "bf16" if dtype in ("fp8", "fp4") else dtype


def hybrid_block_size(state_bytes_per_layer: float, kv_bytes_per_token_per_layer: float) -> int:
    """vLLM's hybrid block size: the attention page grows until it holds one state page,
    rounded up to a multiple of 16 tokens (as hybridserve.layouts derives Qwen3-Next's 544)."""
    tokens = -(-int(state_bytes_per_layer) // int(kv_bytes_per_token_per_layer))
    return -(-tokens // 16) * 16


# nvidia/Nemotron-H-8B-Base-8K config.json: hidden_size 4096, num_hidden_layers 52 with
# hybrid_override_pattern "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-" (24 Mamba2,
# 4 attention, 24 relu2 MLP), num_attention_heads 32, num_key_value_heads 8, attention_head_dim
# 128, intermediate_size 21504, mamba_num_heads 128, mamba_head_dim 64, ssm_state_size 128,
# n_groups 8, conv_kernel 4, chunk_size 128, vocab_size 131072, tie_word_embeddings false.
_NEMOTRON_MAMBA = Mamba2Dims(
    num_heads=128, head_dim=64, state_size=128, n_groups=8, conv_kernel=4, chunk_size=128
)
_NEMOTRON_BLOCK = hybrid_block_size(_NEMOTRON_MAMBA.state_elems() * 2, 2 * 8 * 128 * 2)  # 528


MODELS: dict[str, ModelProfile] = {
    m.name: m
    for m in (
        ModelProfile(
            name="llama-3.1-8b",
            source="meta-llama/Llama-3.1-8B config.json: hidden 4096, 32 layers, 32 heads, "
            "8 KV heads, head_dim 128, intermediate 14336, vocab 128256, untied",
            hidden_size=4096,
            vocab_size=128256,
            groups=get_layout("llama-3.1-8b").groups,
            num_full_layers=32,
            num_dense_mlp_layers=32,
            attention=AttentionDims(num_heads=32, num_kv_heads=8, head_dim=128),
            intermediate_size=14336,
        ),
        ModelProfile(
            name="gemma-3-27b",
            source="google/gemma-3-27b-it text_config: hidden 5376, 62 layers, sliding_window "
            "1024, sliding_window_pattern 6 (52 local, 10 global), 32 heads, 16 KV heads, "
            "head_dim 128, intermediate 21504, vocab 262208, tied embeddings",
            hidden_size=5376,
            vocab_size=262208,
            tie_word_embeddings=True,
            groups=get_layout("gemma-3-27b").groups,
            num_full_layers=10,
            num_swa_layers=52,
            num_dense_mlp_layers=62,
            attention=AttentionDims(num_heads=32, num_kv_heads=16, head_dim=128),
            sliding_window=1024,
            intermediate_size=21504,
        ),
        ModelProfile(
            name="qwen3-next-80b-a3b",
            source="Qwen3NextConfig defaults = Qwen/Qwen3-Next-80B-A3B-Instruct config.json: "
            "hidden 2048, 48 layers, full_attention_interval 4 (12 gated attention + 36 GDN), "
            "16 heads, 2 KV heads, head_dim 256, linear heads 16 key / 32 value of dim 128, "
            "conv 4, 512 experts top-10, moe_intermediate 512, shared expert 512, vocab 151936, "
            "untied, 1 MTP layer",
            hidden_size=2048,
            vocab_size=151936,
            groups=get_layout("qwen3-next-80b-a3b").groups,
            num_full_layers=12,
            num_recurrent_layers=36,
            num_moe_layers=48,
            num_mtp_layers=1,
            attention=AttentionDims(num_heads=16, num_kv_heads=2, head_dim=256, output_gate=True),
            recurrent=GdnDims(
                num_key_heads=16,
                num_value_heads=32,
                key_head_dim=128,
                value_head_dim=128,
                conv_kernel=4,
            ),
            moe=MoeDims(
                num_experts=512,
                num_experts_per_tok=10,
                moe_intermediate_size=512,
                shared_intermediate_size=512,
            ),
        ),
        ModelProfile(
            name="nemotron-h-8b",
            source="nvidia/Nemotron-H-8B-Base-8K config.json (values in the comment above)",
            hidden_size=4096,
            vocab_size=131072,
            groups=(
                FullAttentionSpec(block_size=_NEMOTRON_BLOCK),
                MambaSpec(block_size=_NEMOTRON_BLOCK, mode=MambaCacheMode.ALIGN),
            ),
            num_full_layers=4,
            num_recurrent_layers=24,
            num_dense_mlp_layers=24,
            attention=AttentionDims(num_heads=32, num_kv_heads=8, head_dim=128),
            recurrent=_NEMOTRON_MAMBA,
            intermediate_size=21504,
            mlp_gated=False,
        ),
        ModelProfile(
            name="deepseek-v3",
            source="deepseek-ai/DeepSeek-V3 config.json: hidden 7168, 61 layers (first 3 dense, "
            "intermediate 18432), 128 heads, q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, "
            "v_head 128, 256 experts top-8 of 2048, 1 shared expert, vocab 129280, 1 MTP layer",
            hidden_size=7168,
            vocab_size=129280,
            groups=(FullAttentionSpec(block_size=64, mla=True),),
            num_mla_layers=61,
            num_dense_mlp_layers=3,
            num_moe_layers=58,
            num_mtp_layers=1,
            mla=MlaDims(
                num_heads=128,
                q_lora_rank=1536,
                kv_lora_rank=512,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
            ),
            intermediate_size=18432,
            moe=MoeDims(
                num_experts=256,
                num_experts_per_tok=8,
                moe_intermediate_size=2048,
                shared_intermediate_size=2048,
            ),
        ),
    )
}


def get_model(name: str) -> ModelProfile:
    """The profile called `name`. Raises ConfigError naming the known profiles."""
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError("model", name, f"use one of {sorted(MODELS)}") from None
