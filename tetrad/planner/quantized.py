"""Weights served as int8 or int4 (`--quantization`, the engine's tetrad.models.quant), counted
matrix by matrix as one rank holds them, so that the prediction is the engine's count exactly.

int8 keeps one 16-bit scale per output row of the matrix a rank holds: a row-parallel shard keeps
every row, so its scales are not divided by tp. int4 keeps, per row and group of 128 input
columns, a 16-bit scale and a 16-bit zero offset, so every matrix's input width, a row-parallel
shard's included, must be a multiple of 128. Quantized: the projections of attention, MLPs and
experts (every nn.Linear of a block but the router's gate). In 16 bits: embeddings, positions,
norms, biases, the router and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.errors import ConfigError
from tetrad.planner.model_stats import norm_params, router_params
from tetrad.spec.model import ModelConfig
from tetrad.spec.serving import ServeLayout

QUANTIZED_DTYPES = ("int8", "int4")
INT4_GROUP = 128
SCALE_BYTES = 2  # the scales and zero offsets are in the activations' 16 bits
KEPT_BYTES = 2  # everything not quantized is in 16 bits too


@dataclass(frozen=True)
class Matrix:
    """A projection's weight as one rank holds it: rows (outputs) x columns (inputs), `count`
    copies (a rank's experts), and whether its rows carry a bias (this rank's share of it)."""

    name: str
    rows: int
    columns: int
    count: int = 1
    bias: bool = False


def _local_kv_heads(config: ModelConfig, tp: int) -> int:
    """A rank's kv heads: its share, or one replicated head when there are fewer than ranks
    (tetrad.parallel.tensor_parallel.kv_heads_of)."""
    return config.num_kv_heads // tp if config.num_kv_heads >= tp else 1


def _mlp(config: ModelConfig, name: str, ffn: int, tp: int, count: int = 1) -> list[Matrix]:
    """An MLP split over `tp` ranks: up column-parallel, down row-parallel (its bias whole)."""
    width = 2 * ffn if config.mlp == "swiglu" else ffn
    return [Matrix(f"{name}.up", width // tp, config.hidden_size, count, config.bias),
            Matrix(f"{name}.down", config.hidden_size, ffn // tp, count, config.bias)]


def _attention(config: ModelConfig, tp: int) -> list[Matrix]:
    h = config.hidden_size
    if config.attention == "mla":
        heads = config.num_heads // tp
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        query = ([Matrix("attn.q_down", config.q_lora_rank, h),
                  Matrix("attn.q_up", heads * qk, config.q_lora_rank)]
                 if config.q_lora_rank else [Matrix("attn.q", heads * qk, h)])
        return [*query,
                Matrix("attn.kv_down", config.kv_lora_rank + config.qk_rope_head_dim, h),
                Matrix("attn.kv_up", heads * (config.qk_nope_head_dim + config.v_head_dim),
                       config.kv_lora_rank),
                Matrix("attn.out", h, heads * config.v_head_dim)]
    qkv_rows = (config.num_heads // tp + 2 * _local_kv_heads(config, tp)) * config.head_dim
    return [Matrix("attn.qkv", qkv_rows, h, bias=config.qkv_bias or config.bias),
            Matrix("attn.out", h, config.q_size // tp, bias=config.bias)]


def rank_matrices(config: ModelConfig, layer: int, layout: ServeLayout) -> list[Matrix]:
    """The quantized projections of block `layer` one rank holds under `layout`: attention and
    dense MLPs split over tp; routed experts whole (num_experts / ep of them with ep > 1),
    or each cut over tp / ep ranks when 1 < ep < tp; shared experts split like an MLP."""
    tp = layout.tp
    matrices = _attention(config, tp)
    if not config.is_moe_layer(layer):
        return matrices + _mlp(config, "mlp", config.ffn_hidden_size, tp)
    held = config.num_experts // layout.ep
    expert_tp = layout.tp // layout.ep if 1 < layout.ep < layout.tp else 1
    matrices += _mlp(config, "mlp.experts", config.moe_ffn_hidden_size, expert_tp, held)
    if config.num_shared_experts:
        matrices += _mlp(config, "mlp.shared",
                         config.moe_ffn_hidden_size * config.num_shared_experts, tp)
    return matrices


def matrix_bytes(matrix: Matrix, dtype: str) -> float:
    """One rank's bytes of a quantized projection: values, scales (and zero offsets), bias."""
    rows, columns = matrix.rows, matrix.columns
    if dtype == "int8":
        held = rows * columns + rows * SCALE_BYTES
    else:
        held = rows * columns / 2 + rows * (columns // INT4_GROUP) * 2 * SCALE_BYTES
    return matrix.count * (held + (rows * KEPT_BYTES if matrix.bias else 0))


def quantization_refusal(config: ModelConfig, layout: ServeLayout, dtype: str) -> str | None:
    """Why the engine cannot hold `config` in `dtype` under `layout` (None: it can): int4's
    groups of 128 must tile every projection's input on every rank (its kernels and its scale
    layout take whole groups only)."""
    if dtype != "int4":
        return None
    for layer in range(config.num_layers):
        for matrix in rank_matrices(config, layer, layout):
            if matrix.columns % INT4_GROUP:
                split = f" on each of tp {layout.tp} ranks" if layout.tp > 1 else ""
                return (f"int4 quantizes in groups of {INT4_GROUP} input columns, but layer "
                        f"{layer}'s {matrix.name} has {matrix.columns} inputs{split}: use "
                        f"int8, or a model (and tp) whose widths are multiples of {INT4_GROUP}")
    return None


def check_quantizable(config: ModelConfig, layout: ServeLayout, dtype: str) -> None:
    reason = quantization_refusal(config, layout, dtype)
    if reason:
        raise ConfigError(reason)


def quantized_layer_bytes(config: ModelConfig, layer: int, layout: ServeLayout,
                          dtype: str) -> float:
    """One rank's bytes of block `layer` with its projections in `dtype`: the quantized
    matrices and their biases, and the block's norms and router in 16 bits."""
    kept = 2 * norm_params(config)
    if config.attention == "mla":
        kept += config.kv_lora_rank + (config.q_lora_rank or 0)  # the latent norms
    if config.is_moe_layer(layer):
        kept += router_params(config)
    return (sum(matrix_bytes(matrix, dtype) for matrix in rank_matrices(config, layer, layout))
            + kept * KEPT_BYTES)
