"""What FP8 training under Transformer Engine changes in the activations a block keeps.

Each of its FP8 linears saves its input cast to FP8 for the weight gradient, not the 16-bit one
(its maintainers, NVIDIA/TransformerEngine#1764: "we cache the FP8 data (on Blackwell) or the
FP8 transpose data (on Hopper)"). So the QKV and first MLP inputs (the norms' outputs) and the
down projections' inputs take a byte each, while the output projection's FP8 input is kept
beside the attention output the attention backward keeps anyway
(NVIDIA/TransformerEngine#1865: "the output tensor of fused attn is saved by itself and used by
the following proj_linear"). torchao's float8 linears save the 16-bit input instead.
"""

from __future__ import annotations

from tetrad.spec.model import ModelConfig


def fp8_saved_input_bytes(config: ModelConfig, layer: int, tp: int, act_bytes: float,
                          recompute_ops: tuple[str, ...]) -> tuple[float, float]:
    """(replicated, sharded) bytes per token of one GPU that FP8 linears add to (or, negative,
    take from) memory.activation_bytes_per_layer's count of `layer`; ops in `recompute_ops`
    store nothing to cast."""
    saved = act_bytes - 1.0
    replicated = 0.0 if "norm" in recompute_ops else -2 * config.hidden_size * saved
    heads = -(-config.num_heads // tp)
    sharded = heads * (config.v_head_dim if config.attention == "mla" else config.head_dim)
    down_inputs = 0 if "activation" in recompute_ops else 1
    if config.is_moe_layer(layer):
        ffn = -(-config.moe_ffn_hidden_size // tp)
        routed = config.num_experts_per_token * (config.hidden_size / tp + down_inputs * ffn)
        sharded -= (routed + down_inputs * ffn * config.num_shared_experts) * saved
    else:
        sharded -= down_inputs * -(-config.ffn_hidden_size // tp) * saved
    return replicated, sharded
