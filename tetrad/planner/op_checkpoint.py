"""Selective recomputation as torchtitan runs it: op-level selective activation checkpointing.

Megatron's selective recomputation (Korthikanti et al. 2022) recomputes the attention core and
stores everything else; with flash attention, which never stores the s x s scores, that frees
nothing but the log-sum-exp. torchtitan's `--activation_checkpoint.mode selective` with its
default `selective_ac_option = "op"` (torchtitan/models/llama/parallelize_llama.py,
`_apply_ac_to_transformer_block`; later torchtitan/distributed/activation_checkpoint.py) wraps
each block in a checkpoint whose policy keeps only the outputs of the ops in its save list (aten
mm and the flash / efficient / cuDNN SDPA kernels), "except every second mm", and recomputes
every other op in the backward. The mm counter restarts for each block's checkpoint, and the
block calls its linears in the order of torchtitan's Llama code: wq, wk, wv, the attention, wo,
then w1, w3, w2 (`w2(silu(w1(x)) * w3(x))`); a GELU MLP calls fc1, fc2. So the 1st, 3rd, 5th, ...
matmuls' outputs are kept (wq, wv, w1, w2) and the 2nd, 4th, 6th (wk, wo, w3) run again, with
every norm, rotary embedding, activation and residual add; the attention kernel is not rerun.

A block keeps its input (the checkpoint's), the kept matmuls' outputs and the attention's output
and fp32 log-sum-exp. MoE blocks are not counted this way (their experts are not aten mm): the
planner prices them as Megatron's selective recomputation.
"""

from __future__ import annotations

from tetrad.spec.model import ModelConfig
from tetrad.planner.flops import Gemm

FP32 = 4


def applies(config: ModelConfig, layer: int) -> bool:
    return config.attention != "mla" and not config.is_moe_layer(layer)


def block_matmuls(config: ModelConfig, tokens: float, tp: int) -> tuple[Gemm, ...]:
    """The block's matmuls in the order the model calls them (m tokens, n outputs, k inputs)."""
    h = config.hidden_size
    q = -(-config.num_heads // tp) * config.head_dim
    kv = -(-config.num_kv_heads // tp) * config.head_dim
    ffn = -(-config.ffn_hidden_size // tp)
    attention = (Gemm(tokens, q, h), Gemm(tokens, kv, h), Gemm(tokens, kv, h), Gemm(tokens, h, q))
    if config.mlp == "swiglu":
        return attention + (Gemm(tokens, ffn, h), Gemm(tokens, ffn, h), Gemm(tokens, h, ffn))
    return attention + (Gemm(tokens, ffn, h), Gemm(tokens, h, ffn))


def recomputed_matmuls(config: ModelConfig, tokens: float, tp: int) -> tuple[Gemm, ...]:
    """The every-second matmuls the backward runs again."""
    return block_matmuls(config, tokens, tp)[1::2]


def kept_bytes_per_token(config: ModelConfig, tp: int, sequence_parallel: bool,
                         act_bytes: float) -> float:
    """Bytes per token one block keeps for its backward under the op-level policy."""
    heads = -(-config.num_heads // tp)
    block_input = config.hidden_size * act_bytes / (tp if sequence_parallel else 1)
    kept_matmuls = sum(gemm.n for gemm in block_matmuls(config, 1, tp)[0::2]) * act_bytes
    attention = heads * config.head_dim * act_bytes + heads * FP32
    return block_input + kept_matmuls + attention
