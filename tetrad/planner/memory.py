"""Bytes per GPU: parameters, gradients, optimizer state, activations and KV cache.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation", section 4), written
per stored tensor so that the same accounting covers GQA, SwiGLU, MoE, MLA, flash attention and no
dropout: their GPT layer stores 34*s*b*h + 5*a*s^2*b bytes, which this reproduces exactly for GPT
shapes. Under tensor parallelism the norms' inputs, the inputs of the first matmuls and the dropout
masks stay replicated unless sequence parallelism splits them too; context parallelism splits the
sequence. The pipeline's first stage holds the most microbatches in flight (zero bubble: every
stage holds as many until their weight gradients).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from tetrad.spec.layout import FORWARD_AGAIN, sqrt_segments
from tetrad.spec.model import ModelConfig
from tetrad.errors import ConfigError
from tetrad.planner import eager, op_checkpoint
from tetrad.planner.fp8_inputs import fp8_saved_input_bytes
from tetrad.planner.layout import TrainLayout, stage_first_layer, stage_layer_counts
from tetrad.planner.model_stats import (embedding_params, head_params, kv_replica_params,
                                        layer_params, norm_params, position_params)
from tetrad.planner.precision import TrainingPrecision
from tetrad.planner.timeline import pipeline_in_flight
from tetrad.planner.unfused import loss_bytes_per_logit
from tetrad.planner.weight_copies import (UNSHARDED_GRAD_BYTES, fp8_weight_copy_bytes,
                                          gathered_params_bytes, keeps_stage_whole)


# Which training code's tensors are counted: "megatron", Korthikanti et al.'s accounting of
# Megatron-LM's fused kernels (the published figures' stack, and the default); "tetrad", tetrad's
# own eager PyTorch runtime, tensor by tensor (tetrad.planner.eager), for the run report.
RUNTIMES = ("megatron", "tetrad")
# Element-wise ops whose outputs op-level selective recomputation (Megatron-Core's
# --recompute-modules layernorm / moe_act, torch.compile's rematerialized pointwise ops) runs
# again in the backward instead of storing them.
RECOMPUTE_OPS = ("norm", "activation")


@dataclass(frozen=True, slots=True)
class ActivationOptions:
    """Properties of the training code, not of the layout, that change what is stored."""

    flash_attention: bool = True  # the s x s score matrix is never stored
    dropout: bool = False  # GPT-3-era models store a 1-byte mask per dropout
    runtime: str = "megatron"  # see RUNTIMES; "tetrad" fixes the two above (SDPA, no dropout)
    zero3_live_params: float = 0.0  # see gathered_params_bytes
    recompute_ops: tuple[str, ...] = ()  # RECOMPUTE_OPS run again in backward, not stored
    selective_op: bool = False  # selective as torchtitan's op-level policy (planner.op_checkpoint)
    eager_loss: bool = False  # cross-entropy over an fp32 copy of the logits (planner.unfused)
    zero3_whole_stage_under_pp: bool = False  # FSDP2's, weight_copies.keeps_stage_whole
    fp8_saved_inputs: bool = False  # Transformer Engine's FP8 linears (planner.fp8_inputs)

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ConfigError(f"unknown runtime {self.runtime!r} (known: {', '.join(RUNTIMES)})")


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    params: float
    grads: float
    optimizer: float
    activations: float
    kv_cache: float = 0.0
    params_gathered: float = 0.0  # of `params`: ZeRO-3's whole units at their peak
    host_optimizer: float = 0.0  # offloaded to CPU memory: not in the total
    host_grads: float = 0.0
    host_params: float = 0.0  # --offload params: ZeRO-3's parameter shard
    disk_params: float = 0.0  # --offload nvme: in files
    disk_optimizer: float = 0.0
    zero_buffers: float = 0.0  # --zero-bucket-size: ZeRO-3's gather and reduce-scatter buffers
    activation_buffer: float = 0.0  # --contiguous-buffers: the checkpoints' kept inputs
    host_activations: float = 0.0  # --offload-activations: kept inputs in CPU memory, not in total

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.kv_cache
                + self.zero_buffers + self.activation_buffer)

    def offloaded(self, mode: str) -> dict[str, float]:
        """The host and disk bytes of offload `mode` (ParallelConfig.offload_mode), by the run
        report's names."""
        if mode == "none":
            return {}
        held = {"host_grads": self.host_grads}
        if mode == "nvme":
            return held | {"disk_params": self.disk_params, "disk_optimizer": self.disk_optimizer}
        if mode == "params":
            held["host_params"] = self.host_params
        return held | {"host_optimizer": self.host_optimizer}

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "kv_cache": self.kv_cache, "total": self.total}


@lru_cache(maxsize=4096)  # thousands of layouts share a few (layers, stages) cuts
def representative_stages(num_layers: int, num_stages: int,
                          num_dense_layers: int = 0) -> tuple[int, ...]:
    """Stages that can be the fullest or slowest: the last (LM head) and the first stage of each
    kind, a kind being its layer count and how many of those are an MoE model's leading dense
    layers (when layers do not divide evenly the middle stages carry one more than the ends; a
    stage of MoE layers outweighs the dense first one); the earliest of a kind holds the most
    microbatches in flight."""
    counts = stage_layer_counts(num_layers, num_stages)
    first_of_kind: dict[tuple[int, int], int] = {}
    for stage, count in enumerate(counts):
        dense = min(count, max(0, num_dense_layers - stage_first_layer(counts, stage)))
        first_of_kind.setdefault((count, dense), stage)
    return tuple(sorted({*first_of_kind.values(), num_stages - 1}))


def stages_to_check(config: ModelConfig, num_stages: int) -> tuple[int, ...]:
    """representative_stages of `config`'s cut."""
    return representative_stages(config.num_layers, num_stages,
                                 config.num_dense_layers if config.is_moe else 0)


@lru_cache(maxsize=4096)
def stage_params(config: ModelConfig, num_stages: int, stage: int, tp: int,
                 ep: int, expert_tp: int | None = None) -> tuple[float, float]:
    """(dense, expert) parameter elements one GPU of `stage` holds; each expert is split over
    `expert_tp` ranks (default tp: TrainLayout.expert_tp)."""
    counts = stage_layer_counts(config.num_layers, num_stages)
    first = stage_first_layer(counts, stage)
    dense = expert = 0.0
    for layer in range(first, first + counts[stage]):
        params = layer_params(config, layer)
        dense += params.tp_sharded / tp + params.replicated + kv_replica_params(config, tp)
        expert += params.experts / (ep * (tp if expert_tp is None else expert_tp))
    if stage == 0:
        dense += embedding_params(config) / tp + position_params(config)
    if stage == num_stages - 1:
        dense += norm_params(config)
        # A tied head on a separate stage keeps its own copy of the embedding (Megatron).
        head = head_params(config) or (embedding_params(config) if num_stages > 1 else 0)
        dense += head / tp
    return dense, expert


def zero_state_bytes(num_params: float, group: int, zero: int, offload: bool,
                     precision: TrainingPrecision, offload_params: bool = False
                     ) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per GPU of `num_params` parameters shared by `group`
    data-parallel ranks: ZeRO stage 1 shards the optimizer state, 2 also the gradients, 3 also
    the parameters; offload keeps the optimizer state in CPU memory (or files), parameter offload
    ZeRO-3's parameter and gradient shards too."""
    if offload_params:
        return 0.0, 0.0, 0.0
    params = num_params * precision.param_bytes / (group if zero >= 3 else 1)
    grads = num_params * precision.grad_bytes / (group if zero >= 2 else 1)
    optimizer = (0.0 if offload else
                 num_params * precision.optimizer_state_bytes / (group if zero >= 1 else 1))
    return params, grads, optimizer


def model_state_bytes(config: ModelConfig, layout: TrainLayout, precision: TrainingPrecision,
                      stage: int, live_params: float = 0.0,
                      whole_stage_under_pp: bool = False) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes on one GPU of `stage` (ZeRO, Rajbhandari et al. 2020):
    dense parameters shard over dp*cp, expert parameters over their own group, dp*cp/ep. FSDP2
    under pipeline parallelism (weight_copies.keeps_stage_whole) adds the whole stage gathered
    and its unsharded fp32 gradients in place of the shards'."""
    dense, expert = stage_params(config, layout.pp, stage, layout.tp, layout.ep,
                                 layout.expert_tp)
    params, grads, optimizer = zero_state_bytes(dense, layout.zero_group, layout.zero,
                                                layout.offload, precision, layout.offload_params)
    expert_params, expert_grads, expert_optimizer = zero_state_bytes(
        expert, layout.expert_zero_group, layout.zero, layout.offload, precision)
    whole = keeps_stage_whole(layout, whole_stage_under_pp)
    if whole:
        grads, expert_grads = (dense + expert) * UNSHARDED_GRAD_BYTES, 0.0
    return (params + expert_params
            + gathered_params_bytes(config, layout, precision, live_params,
                                    (dense + expert) if whole else 0.0)
            + fp8_weight_copy_bytes(config, layout, precision, stage, live_params, whole),
            grads + expert_grads, optimizer + expert_optimizer)


@lru_cache(maxsize=8192)
def activation_bytes_per_layer(config: ModelConfig, layer: int, micro_batch: int, seq_len: int,
                               tp: int, cp: int, sequence_parallel: bool, recompute: str,
                               options: ActivationOptions, act_bytes: float) -> float:
    """Bytes one block keeps from its forward for its backward, for one microbatch on one GPU."""
    tokens = micro_batch * seq_len / cp
    h = config.hidden_size
    replicated_split = tp if sequence_parallel else 1
    if recompute in FORWARD_AGAIN:
        # Only the block's input (sqrt: only a segment's first block's; the stage counts them).
        return tokens * h * act_bytes / replicated_split
    if recompute == "selective" and options.selective_op and op_checkpoint.applies(config, layer):
        return tokens * op_checkpoint.kept_bytes_per_token(config, tp, sequence_parallel, act_bytes)
    mask = 1.0 if options.dropout else 0.0
    # Inputs of the two norms and of the first matmul of each sub-block, two dropout masks.
    replicated = 4 * h * act_bytes + 2 * h * mask
    heads = -(-config.num_heads // tp)
    if config.attention == "mla":
        qk_head = config.qk_nope_head_dim + config.qk_rope_head_dim
        replicated += (2 * config.q_lora_rank + 2 * config.kv_lora_rank
                       + config.qk_rope_head_dim) * act_bytes
        sharded = heads * (2 * qk_head + 2 * config.v_head_dim) * act_bytes  # q, k, v, out input
    else:
        kv_heads = -(-config.num_kv_heads // tp)
        # q, k, v for the attention backward, and the output projection's input.
        sharded = (2 * heads + 2 * kv_heads) * config.head_dim * act_bytes
    if options.flash_attention:
        core = heads * 4.0  # the fp32 log-sum-exp per query and head
    else:
        # Softmax output, its dropout mask and the dropped-out probabilities, over all s keys.
        core = heads * seq_len * (act_bytes + mask * (1 + act_bytes))
    if recompute != "selective":
        sharded += core
    if "norm" in options.recompute_ops:  # the norms' outputs, each sub-block's matmul input
        replicated -= 2 * h * act_bytes
    gated = 3 if config.mlp == "swiglu" else 2  # stored up-projection output(s) + down input
    if "activation" in options.recompute_ops:  # the down projection's input, act(up)
        gated -= 1
    if config.is_moe_layer(layer):
        ffn = -(-config.moe_ffn_hidden_size // tp)
        k = config.num_experts_per_token
        # Per routed copy: expert input, up output(s), down input, expert output for combine.
        sharded += k * (2 * h * act_bytes / tp + gated * ffn * act_bytes)
        sharded += config.num_experts * 4 * 2 / tp  # router logits and probabilities, fp32
        if config.num_shared_experts:
            sharded += gated * ffn * config.num_shared_experts * act_bytes
    else:
        sharded += gated * (-(-config.ffn_hidden_size // tp)) * act_bytes
    if options.fp8_saved_inputs:
        replicated_change, sharded_change = fp8_saved_input_bytes(
            config, layer, tp, act_bytes, options.recompute_ops)
        replicated += replicated_change
        sharded += sharded_change
    return tokens * (replicated / replicated_split + sharded)


def in_flight_microbatches(layout: TrainLayout, stage: int) -> float:
    """Microbatches (in units of the stage's whole layer set) whose activations `stage` holds at
    its peak, from the schedule's action lists (tetrad.planner.timeline.pipeline_in_flight)."""
    return pipeline_in_flight(layout.schedule, layout.pp, layout.num_microbatches,
                              layout.vpp)[stage]


@lru_cache(maxsize=16384)
def _stage_microbatch_activations(config: ModelConfig, num_stages: int, stage: int,
                                  micro_batch: int, seq_len: int, tp: int, cp: int,
                                  sequence_parallel: bool, recompute: str,
                                  options: ActivationOptions,
                                  act_bytes: float) -> tuple[float, float]:
    """(bytes one microbatch leaves in the stage's blocks, transient peak of recomputation)."""
    counts = stage_layer_counts(config.num_layers, num_stages)
    first = stage_first_layer(counts, stage)
    args = (micro_batch, seq_len, tp, cp, sequence_parallel)
    layers = range(first, first + counts[stage])
    kinds = {config.is_moe_layer(layer): layer for layer in layers}  # one dense, one MoE block
    if recompute == "sqrt" and layers:
        # Each segment keeps its input; the segment being recomputed holds its blocks' full
        # activations during its backward.
        segments = sqrt_segments(counts[stage])
        stored = len(segments) * activation_bytes_per_layer(config, first, *args, recompute,
                                                            options, act_bytes)
        transient = max((sum(activation_bytes_per_layer(config, layer, *args, "none", options,
                                                        act_bytes)
                             for layer in layers[start:start + size])
                         for start, size in zip(range(0, len(layers), segments[0]), segments)),
                        default=0.0)
        return stored, transient
    stored = sum(activation_bytes_per_layer(config, layer, *args, recompute, options, act_bytes)
                 * sum(1 for other in layers if config.is_moe_layer(other) == is_moe)
                 for is_moe, layer in kinds.items())
    transient = 0.0
    if (recompute == "full" or recompute == "selective" and options.selective_op) and kinds:
        # The block being recomputed holds its full activations during its backward.
        transient = max(activation_bytes_per_layer(config, layer, *args, "none", options,
                                                   act_bytes) for layer in kinds.values())
    return stored, transient


def stage_activation_bytes(config: ModelConfig, layout: TrainLayout, seq_len: int,
                           options: ActivationOptions, act_bytes: float, stage: int) -> float:
    """Peak activation bytes on one GPU of `stage`."""
    stored, transient = _stage_microbatch_activations(
        config, layout.pp, stage, layout.micro_batch, seq_len, layout.tp, layout.cp,
        layout.sequence_parallel, layout.recompute, options, act_bytes)
    if layout.recompute in FORWARD_AGAIN:  # all kept are block inputs: ZeRO-R's Pa and Pa+cpu
        stored *= 0 if layout.offload_activations else 1 / (
            layout.tp if layout.partition_activations else 1)
    total = stored * in_flight_microbatches(layout, stage) + transient
    if stage == layout.pp - 1:
        tokens = layout.micro_batch * seq_len / layout.cp
        # The head's input and the cross-entropy's logits at its peak; the last stage runs each
        # microbatch's backward right after its forward, so only one.
        split = layout.tp if layout.sequence_parallel else 1
        total += tokens * (config.hidden_size * act_bytes / split + config.vocab_size / layout.tp
                           * loss_bytes_per_logit(act_bytes, options.eager_loss))
    return total


def eager_breakdown(rank: eager.RankBytes) -> MemoryBreakdown:
    """One rank's bytes under the `tetrad` runtime profile, as a breakdown."""
    return MemoryBreakdown(**vars(rank.state), activations=rank.activations,
                           zero_buffers=rank.zero_buffers, activation_buffer=rank.activation_buffer,
                           host_activations=rank.host_activations)


def training_memory(config: ModelConfig, layout: TrainLayout, precision: TrainingPrecision,
                    seq_len: int, options: ActivationOptions) -> tuple[MemoryBreakdown, int]:
    """The fullest GPU's memory and its pipeline stage. The first stage holds the most in-flight
    activations, the last the LM head and logits; a middle stage can win when the first and last
    were given fewer layers. tetrad's own runtime: every pipeline rank counted, the fullest
    returned."""
    if options.runtime == "tetrad":
        ranks = eager.pipeline_ranks(config, layout, seq_len, precision)
        fullest = max(range(layout.pp), key=lambda rank: ranks[rank].total)
        return eager_breakdown(ranks[fullest]), fullest
    best: tuple[MemoryBreakdown, int] | None = None
    for stage in stages_to_check(config, layout.pp):
        breakdown = stage_memory(config, layout, precision, seq_len, options, stage)
        if best is None or breakdown.total > best[0].total:
            best = (breakdown, stage)
    assert best is not None
    return best


def stage_memory(config: ModelConfig, layout: TrainLayout, precision: TrainingPrecision,
                 seq_len: int, options: ActivationOptions, stage: int) -> MemoryBreakdown:
    """One GPU of pipeline `stage` under Megatron's fused kernels (training_memory's fullest is
    the largest of these; `tetrad plan --web` draws every stage's)."""
    params, grads, optimizer = model_state_bytes(config, layout, precision, stage,
                                                 options.zero3_live_params,
                                                 options.zero3_whole_stage_under_pp)
    activations = stage_activation_bytes(config, layout, seq_len, options,
                                         precision.activation_bytes, stage)
    return MemoryBreakdown(params, grads, optimizer, activations,
                           params_gathered=_gathered_at_peak(config, layout, precision,
                                                             options, stage))


def _gathered_at_peak(config: ModelConfig, layout: TrainLayout, precision: TrainingPrecision,
                      options: ActivationOptions, stage: int) -> float:
    whole = 0.0
    if keeps_stage_whole(layout, options.zero3_whole_stage_under_pp):
        whole = sum(stage_params(config, layout.pp, stage, layout.tp, layout.ep,
                                 layout.expert_tp))
    return gathered_params_bytes(config, layout, precision, options.zero3_live_params, whole)


def peak_bytes_by_zero_stage(config: ModelConfig, layout: TrainLayout,
                             precision: TrainingPrecision, seq_len: int,
                             options: ActivationOptions, zeros: tuple[int, ...]) -> list[float]:
    """training_memory's total for each ZeRO stage in `zeros` of an otherwise equal layout: the
    activations are computed once (the search's fast path)."""
    if options.runtime == "tetrad":
        return [training_memory(config, dataclasses.replace(layout, zero=zero), precision,
                                seq_len, options)[0].total for zero in zeros]
    stages = stages_to_check(config, layout.pp)
    activations = [stage_activation_bytes(config, layout, seq_len, options,
                                          precision.activation_bytes, stage) for stage in stages]
    totals = []
    for zero in zeros:
        with_zero = dataclasses.replace(layout, zero=zero)
        totals.append(max(sum(model_state_bytes(config, with_zero, precision, stage,
                                                options.zero3_live_params,
                                                options.zero3_whole_stage_under_pp)) + act
                          for stage, act in zip(stages, activations)))
    return totals


def kv_token_layout(config: ModelConfig, tp: int = 1) -> tuple[int, int, int]:
    """(tensors, heads, width) of what one token stores per layer in the KV cache of one GPU: the
    serving engine's pool has exactly this shape. GQA stores a key and a value for each of its
    num_kv_heads, split over TP (replicated when TP exceeds them); MLA stores one entry, the
    compressed latent and the shared rope key side by side, which every TP rank keeps whole."""
    if config.attention == "mla":
        return 1, 1, config.kv_lora_rank + config.qk_rope_head_dim
    return 2, -(-config.num_kv_heads // tp), config.head_dim


def kv_bytes_per_token(config: ModelConfig, kv_bytes: float, tp: int = 1,
                       num_layers: int | None = None) -> float:
    """KV-cache bytes one token occupies on one GPU (kv_token_layout over the layers)."""
    layers = config.num_layers if num_layers is None else num_layers
    tensors, heads, width = kv_token_layout(config, tp)
    return layers * tensors * heads * width * kv_bytes
