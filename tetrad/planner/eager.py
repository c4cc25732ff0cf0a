"""The `tetrad` runtime profile: what tetrad's own trainer holds, counted tensor by tensor.

The planner's default accounting (`runtime="megatron"`, memory.py) is Korthikanti et al.'s for
Megatron-LM's fused kernels, the stack behind the published figures it is calibrated on. `tetrad
train` runs tetrad's Transformer (tetrad/models) under eager PyTorch autograd instead, and that
keeps different tensors for backward. This module lists them, op by op, as PyTorch 2.13's kernels
save them (the run report's ActivationMeter counts exactly these storages), with t the tokens of
one microbatch, h hidden, q/kv the query and key-value widths, f the FFN width, V the vocabulary,
a the bytes of the compute (autocast) dtype and p those of the parameters (fp32 under autocast,
the compute dtype under ZeRO), which is also the dtype of the residual stream:

  RMSNorm (fp32 math)  its fp32 input (a copy when the stream is 16-bit), the fp32 reciprocal RMS
                       per token, the normalized values in the stream's dtype: t(4h + 4 + ph)
  LayerNorm            input, mean, rstd, in the stream's dtype: t p (h + 2)
  every matmul         its input in the compute dtype; under autocast also a copy of its weight
                       in the compute dtype (autocast casts the fp32 parameter once per forward)
  rotary               new q and k (t(q + kv)a), and the cos/sin tables (2 s d_head fp32, once)
  SDPA (flash kernel)  q, k, v (v is a view of the fused QKV output, which it keeps whole: t(q +
                       2kv)a), the output t q a (also the output projection's input) and the
                       fp32 log-sum-exp t heads 4
  SwiGLU               the fused gate+up output (2tfa, viewed by silu and the product), silu's
                       output tfa, the product tfa (the down projection's input); GELU 2tfa
  residual adds        nothing
  loss                 the fp32 log-probabilities of cross-entropy (4tV, not the logits), the
                       flattened targets (an int64 copy, 8t: the [:, 1:] view is not contiguous),
                       its 4-byte weight total; the rank's token ids [batch, s + 1] int64 of the
                       step (inputs and targets of every microbatch are views of them)
  MoE router           softmax probabilities 4tE, top-k indices 8tk and weights 4tk, their sum 4t,
                       the routed fraction 4E (aux loss)
  MoE, per routed copy (tk of them; dropless, so the total does not depend on the routing):
                       the token and slot indices 16, its gate weight and the contribution in the
                       stream's dtype p(1 + h), the expert's input, MLP and output in the compute
                       dtype; a second cast of the router's input for the shared expert under
                       autocast

State: torch.optim.AdamW (ZeRO-0) keeps a 4-byte fp32 step count per parameter tensor; tetrad's
ZeRO keeps the fp32 gradient of its shard beside a 16-bit gradient and (ZeRO-3) gathers whole
units — the embedding, each block, final norm and head (with tied embeddings one root unit:
embedding and final norm, gathered all step) — one while prefetching the next, each padded to a
multiple of the group. Offload keeps fp32 master, moments and gradient shard on the host.
Communication adds the scalar all-reduces of the logged loss (and MoE load-balance loss), and
ZeRO's global gradient norm: one fp64 each per step.

Measured on CPU (gloo), where every one of these counts equals the run report's measurement.
Left out: ZeRO-1/2 pad each 25 MiB gradient bucket to a multiple of the group (fewer than dp
elements each); an expert that receives no token skips its weight casts under autocast; CUDA's
attention and norm kernels may save slightly different statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tetrad.config import ModelConfig
from tetrad.planner.layout import TrainLayout
from tetrad.planner.model_stats import (bias_params, count_parameters, embedding_params,
                                        head_params, layer_params, norm_params,
                                        position_params)
from tetrad.planner.precision import TrainingPrecision

FP32 = 4  # softmax/log-softmax outputs, norms' statistics, SDPA's log-sum-exp, step counters
INDEX = 8  # int64 token ids and routing indices
SCALAR = 8  # the fp64 scalars all-reduced for the logs and the gradient norm


def covers(layout: TrainLayout) -> bool:
    """Whether this profile counts `layout`: the whole model on every rank (data parallelism,
    ZeRO, gradient accumulation). Tensor, pipeline, context and expert parallel layouts and
    recomputation take the Megatron accounting until they are measured against tetrad's runtime."""
    return ((layout.tp, layout.pp, layout.cp, layout.ep) == (1, 1, 1, 1)
            and layout.recompute == "none")


def _norm_bytes(config: ModelConfig, tokens: float, stream: float) -> float:
    h = config.hidden_size
    if config.norm == "rmsnorm":
        return tokens * (FP32 * h + FP32 + stream * h)
    return tokens * stream * (h + 2)


def _mlp_bytes(config: ModelConfig, tokens: float, ffn: int, act: float) -> float:
    """A dense MLP's saved tensors past its input: up output(s) and down input."""
    return tokens * ffn * act * (4 if config.mlp == "swiglu" else 2)


def matmul_weights(config: ModelConfig, layer: int) -> int:
    """Elements of a block's matmul weights (what autocast copies): all but norms and biases."""
    return layer_params(config, layer).total - 2 * norm_params(config) - bias_params(config, layer)


def block_bytes(config: ModelConfig, layer: int, tokens: float,
                precision: TrainingPrecision) -> float:
    """Bytes one block saves for backward, for one microbatch of `tokens` tokens."""
    act, stream = precision.activation_bytes, precision.param_bytes
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    total = 2 * _norm_bytes(config, tokens, stream)
    total += 2 * tokens * h * act  # inputs of the QKV and of the first MLP (or router) matmul
    total += tokens * (q + 2 * kv) * act  # the fused QKV output, kept whole through v
    if config.position == "rope":
        total += tokens * (q + kv) * act  # rotated q and k
    total += tokens * (q * act + config.num_heads * FP32)  # SDPA output and log-sum-exp
    if config.is_moe_layer(layer):
        e, k = config.num_experts, config.num_experts_per_token
        routed = tokens * k
        total += tokens * (e * FP32 + k * (INDEX + FP32) + FP32) + e * FP32
        total += routed * (2 * INDEX + stream * (1 + h) + 2 * h * act)
        total += _mlp_bytes(config, routed, config.moe_ffn_hidden_size, act)
        if config.num_shared_experts:
            total += _mlp_bytes(config, tokens,
                                config.moe_ffn_hidden_size * config.num_shared_experts, act)
            if act != stream:
                total += tokens * h * act  # the shared expert's own cast of the router input
    else:
        total += _mlp_bytes(config, tokens, config.ffn_hidden_size, act)
    if act != stream:
        total += matmul_weights(config, layer) * act
    return total


def stage_activation_bytes(config: ModelConfig, layout: TrainLayout, seq_len: int,
                           precision: TrainingPrecision) -> float:
    """Peak bytes autograd keeps for one microbatch of the whole model (one stage)."""
    act, stream = precision.activation_bytes, precision.param_bytes
    tokens = layout.micro_batch * seq_len
    total = sum(block_bytes(config, layer, tokens, precision)
                for layer in range(config.num_layers))
    # Token ids: the rank's batch of the step, [micro_batch * microbatches, s + 1].
    total += layout.micro_batch * layout.num_microbatches * (seq_len + 1) * INDEX
    if config.position == "learned":
        total += seq_len * INDEX  # the positions looked up
    else:
        total += 2 * seq_len * config.head_dim * FP32  # cos and sin, shared by every block
    total += _norm_bytes(config, tokens, stream) + tokens * config.hidden_size * act  # head
    if act != stream:
        total += config.vocab_size * config.hidden_size * act  # the head's weight, cast
    total += tokens * (config.vocab_size * FP32 + INDEX) + FP32  # cross-entropy
    return total


def parameter_tensors(config: ModelConfig) -> int:
    """How many tensors Transformer(config).parameters() yields (AdamW keeps a step for each)."""
    norm = 2 if config.norm == "layernorm" and config.bias else 1
    linear = 2 if config.bias else 1  # weight (+ bias)
    qkv = 2 if config.bias or config.qkv_bias else 1
    mlp = 2 * linear
    total = norm + 1 + (config.position == "learned") + (not config.tie_embeddings)
    for layer in range(config.num_layers):
        total += 2 * norm + qkv + linear
        if config.is_moe_layer(layer):
            total += 1 + config.num_experts * mlp + (mlp if config.num_shared_experts else 0)
        else:
            total += mlp
    return total


def fsdp_units(config: ModelConfig) -> tuple[int, tuple[int, ...]]:
    """(elements of the unit held gathered all step, elements of the units gathered in turn), in
    forward order, as tetrad.parallel.fsdp.transformer_units builds them."""
    embed = embedding_params(config) + position_params(config)
    blocks = tuple(layer_params(config, layer).total for layer in range(config.num_layers))
    if config.tie_embeddings:
        return embed + norm_params(config), blocks
    return 0, (embed, *blocks, norm_params(config) + head_params(config))


def _padded(elements: int, group: int) -> int:
    return -(-elements // group) * group


@dataclass(frozen=True)
class ModelState:
    """Bytes of one rank's model state. `params` includes `params_gathered` (ZeRO-3's whole
    units at their peak); host bytes (offload) are not GPU memory."""

    params: float
    grads: float
    optimizer: float
    params_gathered: float = 0.0
    host_optimizer: float = 0.0
    host_grads: float = 0.0


@lru_cache(maxsize=256)
def model_state(config: ModelConfig, layout: TrainLayout,
                precision: TrainingPrecision) -> ModelState:
    """Parameters, gradients and optimizer state tetrad's strategies hold on one rank."""
    pb, gb = precision.param_bytes, precision.grad_bytes
    elements = count_parameters(config)
    if layout.zero == 0:
        # torch.optim.AdamW: its state per parameter, and a step count per tensor.
        return ModelState(elements * pb, elements * gb,
                          elements * precision.optimizer_state_bytes
                          + parameter_tensors(config) * FP32)
    n = layout.zero_group
    gathered = 0.0
    if layout.zero == 3:
        held, rotating = fsdp_units(config)
        padded = [_padded(unit, n) for unit in rotating]
        shard = (_padded(held, n) + sum(padded)) // n
        in_turn = max(map(sum, zip(padded, padded[1:]))) if len(padded) > 1 else padded[0]
        gathered = (_padded(held, n) + in_turn) * pb
        params, grads = shard * pb + gathered, shard * gb
    else:
        shard = elements / n  # flat buckets pad to a multiple of n: a few elements, left out
        params, grads = elements * pb, (elements if layout.zero == 1 else shard) * gb
    # The step reads an fp32 gradient of the shard: the 16-bit one converted (on the host with
    # offload, where the fp32 master copy and the moments live too). With fp32 parameters the
    # device shard is its own master copy.
    fp32_grad = shard * FP32
    if layout.offload:
        return ModelState(params, grads, 0.0, gathered,
                          shard * (FP32 + precision.optimizer_bytes), fp32_grad)
    return ModelState(params, grads + (fp32_grad if gb != FP32 else 0.0),
                      shard * precision.optimizer_state_bytes, gathered)


def scalar_all_reduces(config: ModelConfig, layout: TrainLayout) -> list[tuple[int, int]]:
    """(group size, count) of the fp64 scalars all-reduced per step: the logged loss (and the
    MoE load-balance loss) over the data-parallel ranks, ZeRO's gradient norm over its group."""
    scalars = [(layout.dp, 2 if config.is_moe else 1)]
    if layout.zero >= 1:
        scalars.append((layout.zero_group, 1))
    return scalars
