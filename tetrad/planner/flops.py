"""Floating-point work of a forward and backward pass, as matmul shapes and FLOP counts.

A matmul of an [m, k] by [k, n] operand costs 2*m*n*k FLOPs. The backward pass costs twice the
forward (one GEMM for the input gradient, one for the weight gradient). Causal attention is counted
honestly: query i attends to i + 1 keys, so a sequence of s tokens has s(s+1)/2 query-key pairs, not
s^2 (Megatron's and NeMo's MFU formulas count s^2; the calibration converts their figures to time).

Model FLOPs count the work the model needs (forward + backward, no recomputation): what MFU divides
by. Hardware FLOPs add what activation recomputation repeats: what HFU divides by.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tetrad.spec.layout import FORWARD_AGAIN
from tetrad.spec.model import ModelConfig
from tetrad.planner.model_stats import active_parameters



@dataclass(frozen=True, slots=True)
class Gemm:
    """`count` identical matmuls of [m, k] x [k, n] on one GPU."""

    m: float  # rows; fractional for the average tokens an expert receives
    n: int
    k: int
    count: float = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@lru_cache(maxsize=4096)
def layer_gemms(config: ModelConfig, layer: int, tokens: int, tp: int = 1, ep: int = 1,
                group_tokens: int | None = None,
                expert_tp: int | None = None) -> tuple[Gemm, ...]:
    """Forward matmuls of one block on one GPU that holds `tokens` tokens of a microbatch,
    with attention heads and FFN columns split over `tp`, routed experts over `ep` and each
    expert's columns over `expert_tp` (default tp, as Megatron does). `group_tokens` is how many
    distinct tokens the expert-parallel group routes (default tokens * ep: in training every EP
    rank brings its own tokens)."""
    h = config.hidden_size
    gemms: list[Gemm] = []
    heads = _ceil_div(config.num_heads, tp)
    if config.attention == "mla":
        qk_head = config.qk_nope_head_dim + config.qk_rope_head_dim
        if config.q_lora_rank:
            gemms += [Gemm(tokens, config.q_lora_rank, h),
                      Gemm(tokens, heads * qk_head, config.q_lora_rank)]
        else:
            gemms.append(Gemm(tokens, heads * qk_head, h))
        gemms += [Gemm(tokens, config.kv_lora_rank + config.qk_rope_head_dim, h),
                  Gemm(tokens, heads * (config.qk_nope_head_dim + config.v_head_dim),
                       config.kv_lora_rank),
                  Gemm(tokens, h, heads * config.v_head_dim)]
    else:
        kv_heads = _ceil_div(config.num_kv_heads, tp)
        gemms += [Gemm(tokens, (heads + 2 * kv_heads) * config.head_dim, h),
                  Gemm(tokens, h, heads * config.head_dim)]
    gated = 2 if config.mlp == "swiglu" else 1
    if not config.is_moe_layer(layer):
        ffn = _ceil_div(config.ffn_hidden_size, tp)
        return tuple(gemms + [Gemm(tokens, gated * ffn, h), Gemm(tokens, h, ffn)])
    gemms.append(Gemm(tokens, config.num_experts, h))  # router
    if config.num_shared_experts:
        shared = _ceil_div(config.moe_ffn_hidden_size * config.num_shared_experts, tp)
        gemms += [Gemm(tokens, gated * shared, h), Gemm(tokens, h, shared)]
    # Each token picks top_k of num_experts; with routing balanced in expectation, an expert is
    # hit by at least one of the group's tokens with probability 1 - (1 - k/E)^tokens, so small
    # decode batches touch (and read the weights of) only some experts.
    group = tokens * ep if group_tokens is None else group_tokens
    local_experts = _ceil_div(config.num_experts, ep)
    share = config.num_experts_per_token / config.num_experts
    active = max(1.0, local_experts * (1.0 - (1.0 - share) ** group))
    expert_tokens = group * share * local_experts / active  # a float: FLOPs stay exact
    ffn = _ceil_div(config.moe_ffn_hidden_size, tp if expert_tp is None else expert_tp)
    gemms += [Gemm(expert_tokens, gated * ffn, h, active),
              Gemm(expert_tokens, h, ffn, active)]
    return tuple(gemms)


def head_gemm(config: ModelConfig, tokens: int, tp: int = 1) -> Gemm:
    """The LM head's matmul (vocab-parallel under TP)."""
    return Gemm(tokens, _ceil_div(config.vocab_size, tp), config.hidden_size)


def attention_head_dims(config: ModelConfig) -> tuple[int, int]:
    """(query-key dim, value dim) of one attention head."""
    if config.attention == "mla":
        return config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    return config.head_dim, config.head_dim


def causal_pairs(seq_len: int) -> float:
    return seq_len * (seq_len + 1) / 2


def attention_core_flops(config: ModelConfig, seq_len: int, num_heads: int | None = None) -> float:
    """Forward FLOPs of QK^T and AV for one causal sequence in one layer."""
    d_qk, d_v = attention_head_dims(config)
    heads = config.num_heads if num_heads is None else num_heads
    return 2.0 * heads * (d_qk + d_v) * causal_pairs(seq_len)


@lru_cache(maxsize=256)
def forward_flops_per_sequence(config: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward FLOPs of one sequence of `seq_len` tokens, by part."""
    matmuls = sum(g.flops for layer in range(config.num_layers)
                  for g in layer_gemms(config, layer, seq_len))
    return {"matmuls": matmuls,
            "attention": attention_core_flops(config, seq_len) * config.num_layers,
            "lm_head": head_gemm(config, seq_len).flops}


@lru_cache(maxsize=1024)
def training_flops_per_sequence(config: ModelConfig, seq_len: int,
                                recompute: str = "none") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of a forward + backward pass over one sequence.

    Full recomputation repeats the blocks' forward (not the LM head); selective recomputation
    repeats only the attention core (Korthikanti et al. 2022)."""
    parts = forward_flops_per_sequence(config, seq_len)
    model = 3.0 * sum(parts.values())
    if recompute in FORWARD_AGAIN:
        extra = parts["matmuls"] + parts["attention"]
    elif recompute == "selective":
        extra = parts["attention"]
    else:
        extra = 0.0
    return model, model + extra


def training_flops(config: ModelConfig, num_tokens: float, seq_len: int,
                   recompute: str = "none") -> tuple[float, float]:
    """(model, hardware) FLOPs to train on `num_tokens` tokens in sequences of `seq_len`."""
    model, hardware = training_flops_per_sequence(config, seq_len, recompute)
    return model * num_tokens / seq_len, hardware * num_tokens / seq_len


def six_n_d(config: ModelConfig, num_tokens: float) -> float:
    """The rule of thumb 6 * N * D, with N the parameters a token activates (Kaplan et al. 2020)."""
    return 6.0 * active_parameters(config) * num_tokens
