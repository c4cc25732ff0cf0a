"""Exact parameter counts of a ModelConfig, split the way the parallel strategies split them.

Counts follow tetrad's own Transformer (tetrad/models/transformer.py) element for element: fused
QKV and gate+up matmuls, biases where the config has them, one or two norms per block, a position
table for learned positions, an untied or tied LM head. MLA attention (tetrad/models/mla.py) follows the
DeepSeek-V3 layout: q down/up projections with a norm between, a joint KV down-projection that also
carries the shared rope key, a KV norm, a KV up-projection and the output projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tetrad.spec.model import ModelConfig


@dataclass(frozen=True)
class LayerParams:
    """One transformer block's parameters by how tensor and expert parallelism split them."""

    tp_sharded: int  # column- and row-parallel matmul weights (and column-parallel biases)
    replicated: int  # norms, row-parallel biases, the router, MLA's down-projections
    experts: int  # routed experts: split over expert-parallel ranks, then over TP

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.experts


def norm_params(config: ModelConfig, dim: int | None = None) -> int:
    dim = dim or config.hidden_size
    return 2 * dim if config.norm == "layernorm" and config.bias else dim


def mlp_params(config: ModelConfig, ffn_hidden_size: int) -> tuple[int, int]:
    """(tp-sharded, replicated) of one MLP: fused up (gate+up for SwiGLU) and down."""
    h = config.hidden_size
    width = 2 * ffn_hidden_size if config.mlp == "swiglu" else ffn_hidden_size
    sharded = h * width + ffn_hidden_size * h + (width if config.bias else 0)
    return sharded, (h if config.bias else 0)


def attention_params(config: ModelConfig) -> tuple[int, int]:
    """(tp-sharded, replicated) of one attention block."""
    h = config.hidden_size
    if config.attention == "mla":
        qk_head = config.qk_nope_head_dim + config.qk_rope_head_dim
        heads = config.num_heads
        if config.q_lora_rank:
            q_down = h * config.q_lora_rank + config.q_lora_rank  # projection + its norm
            q_up = config.q_lora_rank * heads * qk_head
        else:
            q_down, q_up = 0, h * heads * qk_head
        kv_down = h * (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank
        kv_up = config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
        out = heads * config.v_head_dim * h
        return q_up + kv_up + out, q_down + kv_down
    qkv_width = config.q_size + 2 * config.kv_size
    qkv_bias = qkv_width if (config.qkv_bias or config.bias) else 0
    sharded = h * qkv_width + qkv_bias + config.q_size * h
    return sharded, (h if config.bias else 0)


def kv_replica_params(config: ModelConfig, tp: int) -> float:
    """Parameters one rank holds beyond its even 1/tp share of a block's attention, because tp
    exceeds the kv heads (multi-query attention under tp 8): each rank keeps whole K and V heads,
    ceil(num_kv_heads / tp) of them (replicated, as Megatron and tetrad's runtime do)."""
    if config.attention != "mha" or config.num_kv_heads % tp == 0:
        return 0.0
    bias = 1 if (config.qkv_bias or config.bias) else 0
    per_head = 2 * config.head_dim * (config.hidden_size + bias)  # its K and V rows
    return per_head * (-(-config.num_kv_heads // tp) - config.num_kv_heads / tp)


def router_params(config: ModelConfig) -> int:
    """The gate, plus the aux-loss-free balancing bias of sigmoid routing (DeepSeek-V3)."""
    bias = config.num_experts if config.router_score == "sigmoid" else 0
    return config.hidden_size * config.num_experts + bias


@lru_cache(maxsize=256)
def layer_params(config: ModelConfig, layer: int) -> LayerParams:
    attn_sharded, attn_replicated = attention_params(config)
    # Qwen3's QK-norm: one RMSNorm weight of head_dim for the queries, one for the keys.
    norms = 2 * norm_params(config) + (2 * config.head_dim if config.qk_norm else 0)
    if not config.is_moe_layer(layer):
        mlp_sharded, mlp_replicated = mlp_params(config, config.ffn_hidden_size)
        return LayerParams(attn_sharded + mlp_sharded, attn_replicated + mlp_replicated + norms, 0)
    expert_sharded, expert_replicated = mlp_params(config, config.moe_ffn_hidden_size)
    shared_sharded, shared_replicated = (
        mlp_params(config, config.moe_ffn_hidden_size * config.num_shared_experts)
        if config.num_shared_experts else (0, 0))
    router = router_params(config)
    return LayerParams(attn_sharded + shared_sharded,
                       attn_replicated + shared_replicated + router + norms,
                       config.num_experts * (expert_sharded + expert_replicated))


def bias_params(config: ModelConfig, layer: int) -> int:
    h = config.hidden_size
    qkv = config.q_size + 2 * config.kv_size if (config.qkv_bias or config.bias) else 0
    if not config.bias:
        return qkv if config.attention == "mha" else 0
    gated = 2 if config.mlp == "swiglu" else 1
    if not config.is_moe_layer(layer):
        return qkv + h + gated * config.ffn_hidden_size + h
    per_expert = gated * config.moe_ffn_hidden_size + h
    shared = (gated * config.moe_ffn_hidden_size * config.num_shared_experts + h
              if config.num_shared_experts else 0)
    return qkv + h + config.num_experts * per_expert + shared


def unquantized_layer_params(config: ModelConfig, layer: int) -> int:
    """Parameters of a block that quantized checkpoints keep in 16 bits: norms, biases, router."""
    norms = 2 * norm_params(config) + (config.q_lora_rank + config.kv_lora_rank
                                       if config.attention == "mla" else 0)
    router = router_params(config) if config.is_moe_layer(layer) else 0
    return norms + bias_params(config, layer) + router


def embedding_params(config: ModelConfig) -> int:
    """Token embedding (vocab-parallel under TP)."""
    return config.vocab_size * config.hidden_size


def position_params(config: ModelConfig) -> int:
    return config.max_seq_len * config.hidden_size if config.position == "learned" else 0


def head_params(config: ModelConfig) -> int:
    """The LM head's own weight; 0 when it reuses the embedding."""
    return 0 if config.tie_embeddings else config.vocab_size * config.hidden_size


@lru_cache(maxsize=64)
def count_parameters(config: ModelConfig) -> int:
    """Exactly sum(p.numel() for p in Transformer(config).parameters())."""
    layers = sum(layer_params(config, layer).total for layer in range(config.num_layers))
    return (layers + embedding_params(config) + position_params(config) + norm_params(config)
            + head_params(config))


@lru_cache(maxsize=64)
def active_parameters(config: ModelConfig) -> int:
    """Parameters one token touches: all of a dense model; the top-k routed experts (plus the
    shared ones and the router) of an MoE. Embedding tables are counted as looked up, i.e. in
    full, matching how the '6N' rule is quoted for MoE models (DeepSeek-V3: 37B of 671B)."""
    total = count_parameters(config)
    if not config.is_moe:
        return total
    expert = sum(mlp_params(config, config.moe_ffn_hidden_size))
    unused = config.num_experts - config.num_experts_per_token
    num_moe_layers = config.num_layers - config.num_dense_layers
    return total - num_moe_layers * unused * expert


def parameter_breakdown(config: ModelConfig) -> dict[str, int]:
    """Parameters by component, for reports: they sum to count_parameters."""
    attention = sum(attention_params(config)) * config.num_layers
    norms = 2 * norm_params(config) * config.num_layers + norm_params(config)
    experts = sum(layer_params(config, layer).experts for layer in range(config.num_layers))
    mlp = (sum(layer_params(config, layer).total for layer in range(config.num_layers))
           - attention - (norms - norm_params(config)) - experts)
    return {"embedding": embedding_params(config) + position_params(config),
            "attention": attention, "mlp": mlp, "experts": experts, "norms": norms,
            "lm_head": head_params(config)}
