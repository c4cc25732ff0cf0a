"""What tetrad's runtime saves for backward on one rank (the `tetrad` runtime profile:
tetrad.planner.eager has the op-by-op table), per microbatch of each pipeline stage, and the
peak over the microbatches a schedule keeps in flight.

Per rank and microbatch, T = micro_batch * seq_len / cp tokens enter every matmul; the residual
stream between them (norms, residual adds, what travels between stages) holds T / tp of them
under sequence parallelism. Column-parallel outputs (QKV, the MLP's up projection), attention
and the vocabulary are 1/tp wide; MoE layers run whole on every tp rank.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Callable

from tetrad.spec.layout import FORWARD_AGAIN, sqrt_segments
from tetrad.spec.model import ModelConfig
from tetrad.planner.eager_params import block_params, kv_heads_per_rank, stage_blocks
from tetrad.planner.layout import TrainLayout
from tetrad.planner.precision import FP8_BLOCK, TrainingPrecision
from tetrad.schedules import build_schedule
from tetrad.schedules.generate import SPLIT_BACKWARD
from tetrad.spec.runtime_rules import padded

FP32 = 4  # softmax/log-softmax outputs, norms' statistics, log-sum-exp, expert parameters
INDEX = 8  # int64 token ids, positions and routing indices


def tokens(layout: TrainLayout, seq_len: int) -> tuple[int, float]:
    """(tokens of one microbatch on one rank, of them in the residual stream)."""
    total = layout.micro_batch * seq_len // layout.cp
    return total, total / layout.tp if layout.sequence_parallel else total


def norm_bytes(config: ModelConfig, tokens: float, stream: float) -> float:
    """RMSNorm: its fp32 input (a copy when the stream is 16-bit), the fp32 1/rms per token, the
    normalized values in the stream's dtype. LayerNorm: input, mean and rstd."""
    h = config.hidden_size
    if config.norm == "rmsnorm":
        return tokens * (FP32 * h + FP32 + stream * h)
    return tokens * stream * (h + 2)


def fp8_input(tokens: float, width: int, precision: TrainingPrecision, groups: int = 1
              ) -> float:
    """An FP8 linear's input as its backward keeps it: E4M3 bytes and, for each of `groups`
    equal sets of tokens (experts, each its own linear call), one fp32 scale per 128 tokens of
    each column (tetrad.models.fp8) or one scale (the "tensor" recipe, fp8_tensorwise)."""
    if precision.fp8_recipe == "tensor":
        return tokens * width + groups * FP32
    return tokens * width + groups * -(-tokens / groups // FP8_BLOCK) * width * FP32


def linear_input(tokens: float, width: int, precision: TrainingPrecision) -> float:
    """What a block linear keeps of its input: its autocast copy, or under fp8 its FP8 copy."""
    if precision.compute_dtype == "fp8":
        return fp8_input(tokens, width, precision)
    return tokens * width * precision.activation_bytes


def mlp_bytes(config: ModelConfig, tokens: float, ffn: int, precision: TrainingPrecision,
              groups: int = 1) -> float:
    """A dense MLP's saved tensors past its input: up output(s) and down input (under fp8 the
    down projection's FP8 copy; `groups`: experts sharing the tokens equally)."""
    act = precision.activation_bytes
    up_side = tokens * ffn * act * (3 if config.mlp == "swiglu" else 1)
    if precision.compute_dtype == "fp8":
        return up_side + fp8_input(tokens, ffn, precision, groups)
    return up_side + tokens * ffn * act


def weight_casts(config: ModelConfig, layout: TrainLayout, layer: int,
                 precision: TrainingPrecision) -> float:
    """Under autocast, every matmul weight not already in the compute dtype is cast in each
    forward and the copy saved: all of them over fp32 parameters, only the fp32 experts that
    ZeRO leaves alone over 16-bit ones. Under fp8 a block linear keeps its E4M3 copy and one
    fp32 scale per 128x128 block (or one in all, the "tensor" recipe) instead (the router's gate
    is cast as under bf16)."""
    act, fp8 = precision.activation_bytes, precision.compute_dtype == "fp8"
    total = 0.0
    for p in block_params(config, layout, layer):
        if fp8 and p.fp8_blocks:
            total += p.elements + (FP32 if precision.fp8_recipe == "tensor"
                                   else p.fp8_blocks * FP32)
        elif p.matmul and (FP32 if p.expert else precision.param_bytes) != act:
            total += p.elements * act
    return total


def _moe_bytes(config: ModelConfig, layout: TrainLayout, tokens: int,
               precision: TrainingPrecision) -> float:
    """A whole MoE layer's saved tensors past its router input, for `tokens` tokens. Routing is
    dropless: tokens * k routed copies in all. Under expert parallelism each rank runs the copies
    its experts receive: tokens * k here in the balanced routing this assumes (their sum over
    the ep group is exact, each rank's share is the router's)."""
    act, stream, h = precision.activation_bytes, precision.param_bytes, config.hidden_size
    e, k = config.num_experts, config.num_experts_per_token
    routed = tokens * k
    # Router: softmax probabilities, top-k indices and weights, their sum, the routed fraction.
    total = tokens * (e * FP32 + k * (INDEX + FP32) + FP32) + e * FP32
    # Per routed copy: its gate weight and weighted contribution in the stream's dtype, the
    # expert's input and output in the compute dtype (under fp8 its FP8 input, scaled per 128
    # tokens of each of the rank's experts), and the expert's MLP.
    experts = e // layout.ep
    total += routed * (stream * (1 + h) + h * act)
    total += (fp8_input(routed, h, precision, experts) if precision.compute_dtype == "fp8"
              else routed * h * act)
    total += mlp_bytes(config, routed, config.moe_ffn_hidden_size, precision, experts)
    # Indices: token and slot per copy on one device; with ep, three per copy sent (which
    # token, which weight, where to add it back) and two per copy received (sorting by expert
    # and back).
    total += routed * (5 if layout.ep > 1 else 2) * INDEX
    if config.num_shared_experts:
        total += mlp_bytes(config, tokens, config.moe_ffn_hidden_size * config.num_shared_experts,
                           precision)
        if precision.compute_dtype == "fp8":
            total += fp8_input(tokens, h, precision)  # the shared expert's copy of the router input
        elif act != stream:
            total += tokens * h * act  # the shared expert's own cast of the router input
    return total


def kept_input_bytes(config: ModelConfig, layout: TrainLayout, seq_len: int,
                     precision: TrainingPrecision) -> float:
    """What a full or sqrt checkpoint keeps of its block's input for one microbatch: the
    residual stream, or under --partition-activations this rank's 1/tp share of it, the flat
    input padded to a multiple of tp (tetrad.parallel.kept_inputs)."""
    _, stream_tokens = tokens(layout, seq_len)
    elements = stream_tokens * config.hidden_size
    if layout.partition_activations:
        elements = padded(int(elements), layout.tp) // layout.tp
    return elements * precision.param_bytes


def checkpoints(config: ModelConfig, layout: TrainLayout, stage: int) -> int:
    """The checkpoints full or sqrt recomputation opens in one microbatch of `stage`: one per
    block, or one per sqrt segment."""
    blocks = len(stage_blocks(config, layout, stage))
    return len(sqrt_segments(blocks)) if layout.recompute == "sqrt" else blocks


def block_bytes(config: ModelConfig, layout: TrainLayout, layer: int, seq_len: int,
                precision: TrainingPrecision) -> float:
    """Bytes one block saves for backward, for one microbatch on one rank."""
    act, stream, h = precision.activation_bytes, precision.param_bytes, config.hidden_size
    t, stream_tokens = tokens(layout, seq_len)
    if layout.recompute in FORWARD_AGAIN:
        # The checkpoint keeps the block's input only (sqrt: a segment's first block's), on the
        # device unless --offload-activations holds it in host memory or --contiguous-buffers
        # in a buffer of its own (eager_buffers).
        if layout.offload_activations or layout.contiguous_buffers:
            return 0.0
        return kept_input_bytes(config, layout, seq_len, precision)
    heads = config.num_heads // layout.tp
    q, kv = heads * config.head_dim, kv_heads_per_rank(config, layout.tp) * config.head_dim
    fp8 = precision.compute_dtype == "fp8"
    total = 2 * norm_bytes(config, stream_tokens, stream)
    total += linear_input(t, h, precision)  # the QKV's input
    # The first MLP matmul's input; an MoE router's gate is not FP8.
    total += t * h * act if config.is_moe_layer(layer) else linear_input(t, h, precision)
    total += t * (q + 2 * kv) * act  # the fused QKV output, kept whole through v
    if config.position == "rope":
        total += t * (q + kv) * act  # rotated q and k
    total += t * q * act  # the attention output (also the output projection's input)
    if fp8 and layout.cp == 1:
        total += fp8_input(t, q, precision)  # the output projection keeps its own FP8 copy
    if layout.cp > 1:
        # Ring attention keeps its log-sum-exp (selective recomputation leaves it alone) and
        # hands the output projection a copy in token order (which keeps it, or its FP8 copy).
        total += t * heads * FP32 + linear_input(t, q, precision)
    elif layout.recompute != "selective":
        total += t * heads * FP32  # SDPA's log-sum-exp (recomputed under selective)
    if config.is_moe_layer(layer):
        total += _moe_bytes(config, layout, t, precision)
    else:
        total += mlp_bytes(config, t, config.ffn_hidden_size // layout.tp, precision)
    return total + weight_casts(config, layout, layer, precision)


def _token_ids(layout: TrainLayout, seq_len: int) -> float:
    """What the embedding keeps of the token ids. A vocabulary-parallel embedding keeps the ids
    shifted to its rows and the mask of the others' (int64, bool); a pipeline's or context
    parallelism's microbatch is a copy; otherwise the ids are views of the rank's batch of the
    step [micro_batch * microbatches, s + 1] (on CPU, of the whole global batch)."""
    t, _ = tokens(layout, seq_len)
    if layout.tp > 1:
        return t * (INDEX + 1)
    if layout.pp > 1 or layout.cp > 1:
        return t * INDEX
    return layout.micro_batch * layout.num_microbatches * (seq_len + 1) * INDEX


def _targets_are_ids_storage(layout: TrainLayout) -> bool:
    """Whether the loss's int64 targets share the storage of the ids the embedding keeps: a
    one-sequence window's targets window[:, 1:] are contiguous, so flattening them is a view of
    the batch (more sequences: a copy). Pipelines and context parallelism copy the targets, and
    the vocabulary-parallel loss keeps its own shifted copy."""
    return layout.micro_batch == 1 and layout.tp == layout.pp == layout.cp == 1


def _head_and_loss(config: ModelConfig, layout: TrainLayout, seq_len: int,
                   precision: TrainingPrecision) -> float:
    """The final norm, the head's input and weight cast, and the cross-entropy: fp32
    log-probabilities (vocab-parallel: this rank's fp32 softmax), the int64 targets (unless
    they are a view of the ids already counted), and the 4-byte weight total (vocab-parallel:
    the mask of the targets this rank holds)."""
    act, stream, h = precision.activation_bytes, precision.param_bytes, config.hidden_size
    t, stream_tokens = tokens(layout, seq_len)
    vocab = config.vocab_size // layout.tp
    total = norm_bytes(config, stream_tokens, stream) + t * h * act
    if act != stream:
        total += vocab * h * act
    targets = 0 if _targets_are_ids_storage(layout) else t * INDEX
    return total + t * vocab * FP32 + targets + (t if layout.tp > 1 else FP32)


@lru_cache(maxsize=4096)
def stage_bytes(config: ModelConfig, layout: TrainLayout, stage: int, seq_len: int,
                precision: TrainingPrecision) -> float:
    """Bytes one microbatch of pipeline stage `stage` (the whole model without a pipeline)
    keeps until its backward."""
    blocks = stage_blocks(config, layout, stage)
    if layout.recompute == "sqrt" and blocks:
        kept = blocks[::sqrt_segments(len(blocks))[0]]  # the segments' first blocks
    else:
        kept = blocks
    total = sum(block_bytes(config, layout, layer, seq_len, precision) for layer in kept)
    if layout.recompute not in FORWARD_AGAIN and config.position == "rope":
        total += 2 * seq_len // layout.cp * config.head_dim * FP32  # cos and sin
    if stage == 0:
        total += _token_ids(layout, seq_len)
        if config.position == "learned":
            total += seq_len // layout.cp * INDEX  # the positions looked up
    if stage == layout.pp * layout.vpp - 1:
        total += _head_and_loss(config, layout, seq_len, precision)
    return total


@lru_cache(maxsize=1024)
def recompute_bytes(config: ModelConfig, layout: TrainLayout, stage: int, seq_len: int,
                    precision: TrainingPrecision) -> float:
    """--recompute sqrt: the most bytes one segment of stage `stage` saves when backward runs its
    forward again (its blocks' tensors as without recomputation, the rotary tables, and its
    input, which the rerun saves again), on top of what the forward kept; 0 otherwise."""
    blocks = stage_blocks(config, layout, stage)
    if layout.recompute != "sqrt" or not blocks:
        return 0.0
    plain = dataclasses.replace(layout, recompute="none", partition_activations=False,
                                offload_activations=False, contiguous_buffers=False)
    rope = 2 * seq_len // layout.cp * config.head_dim * FP32 if config.position == "rope" else 0
    starts = range(0, len(blocks), sqrt_segments(len(blocks))[0])
    return max(sum(block_bytes(config, plain, layer, seq_len, precision)
                   for layer in blocks[start:start + size]) + rope
               for start, size in zip(starts, sqrt_segments(len(blocks))))


@lru_cache(maxsize=64)
def _actions(schedule: str, pp: int, microbatches: int, vpp: int) -> tuple[tuple, ...]:
    return build_schedule(schedule, pp, microbatches, vpp, communication=False).actions


def host_stage_bytes(config: ModelConfig, layout: TrainLayout, stage: int, seq_len: int,
                     precision: TrainingPrecision) -> float:
    """Bytes one microbatch of `stage` keeps in host memory until its backward: the kept block
    inputs under --offload-activations (0 otherwise)."""
    if not layout.offload_activations:
        return 0.0
    return checkpoints(config, layout, stage) * kept_input_bytes(config, layout, seq_len,
                                                                 precision)


@lru_cache(maxsize=1024)
def activations_peak(config: ModelConfig, layout: TrainLayout, seq_len: int,
                     precision: TrainingPrecision, pp_rank: int, host: bool = False) -> float:
    """The most bytes one rank of pipeline rank `pp_rank` keeps for backward at once (`host`:
    of them in host memory, host_stage_bytes; else on the device, stage_bytes): in_flight_peak
    of one microbatch's bytes per stage."""
    stage_bytes_of = host_stage_bytes if host else stage_bytes
    return in_flight_peak(layout.schedule, layout.pp, layout.schedule_microbatches, layout.vpp,
                          pp_rank, lambda stage: stage_bytes_of(config, layout, stage, seq_len,
                                                                precision))


def in_flight_peak(schedule: str, pp: int, microbatches: int, vpp: int, pp_rank: int,
                   held: Callable[[int], float]) -> float:
    """The most pipeline rank `pp_rank` holds at once when each microbatch of virtual stage s
    holds held(s) from its forward to its backward (to its weight-gradient pass W under zero
    bubble), walked through the rank's action list as the executor's meter holds and releases
    them; without a pipeline, held(0). The planner's activations and the runtime's count of
    --contiguous-buffers' checkpoint slots (tetrad.parallel.kept_inputs) both walk it."""
    if pp == 1:
        return held(0)
    walked, scale = walked_microbatches(schedule, pp, microbatches)
    release = "W" if schedule in SPLIT_BACKWARD else "B"
    current = peak = 0.0
    for action in _actions(schedule, pp, walked, vpp)[pp_rank]:
        if action.kind == "F":
            current += held(action.stage)
            peak = max(peak, current)
        elif action.kind == release:
            current -= held(action.stage)
    return peak * scale


def walked_microbatches(schedule: str, pp: int, microbatches: int) -> tuple[int, int]:
    """(the microbatches whose walk gives the peak of `microbatches`, the factor on that
    walk's peak): a batch of millions of sequences must not cost a walk of millions of actions
    per layout. GPipe holds every forward before the first backward, so its peak is one
    microbatch's times the count; every other schedule repeats one pattern of forwards and
    backwards past its warm-up, so its peak is reached within 2 * pp microbatches
    (interleaved; 1F1B and ZB-H1 within pp, tests/test_hostile_planner.py checks this over
    every small shape), and 4 * pp of the same remainder modulo pp keep a margin."""
    if schedule == "gpipe":
        return 1, microbatches
    return min(microbatches, 4 * pp + microbatches % pp), 1
