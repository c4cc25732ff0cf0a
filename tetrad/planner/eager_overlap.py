"""What tetrad's eager runtime hides of a rank's communication behind its compute (the `tetrad`
runtime profile's exposed communication: tetrad.planner.eager_time subtracts it from the time of
the rank's collective calls). The measured side is the run report's comm_exposed_s: the seconds
a rank waits on communication (tetrad.parallel.comm).

One model for every overlapped collective: T_c seconds of communication cut into C chunks and
pipelined with T_m seconds of compute that does not depend on it wait for one chunk (the first
gathered, or the last reduced) and for whatever of the rest the compute cannot cover:

    exposed(T_c, T_m, C) = T_c / C + (1 - 1/C) * max(0, T_c - T_m)

C = 1 hides nothing; a collective issued whole beside independent compute is C -> infinity,
max(0, T_c - T_m). What the runtime overlaps, on each stage a rank runs:

  TP/SP   with ParallelConfig.overlap, a block's f and g (SP: gathers and scatters), forward and
          backward, cut into TP_OVERLAP_CHUNKS chunks behind the block's matmuls (forward and
          backward: 3x the forward's), every microbatch (tetrad.parallel.tp_overlap)
  EP      with overlap and shared experts, each MoE block's dispatch all-to-all behind the shared
          experts' matmuls, forward (and its reverse in backward, behind twice those), every
          microbatch and every recomputed forward
  DDP     without a pipeline the gradient buckets' all-reduces, issued as backward completes
          each bucket (the first small, as torch's), behind the last microbatch's backward
          (C = the buckets)
  ZeRO-3  each unit's gathers prefetched and reduce-scatters retired one behind the next, behind
          the stage's forward and backward (C = the stage's units), every microbatch
Everything else is exposed whole: losses and norms, the pipeline's sends, context parallelism's
ring, ZeRO-1/2's reductions, the tp sum of partial gradients, the experts' gradients, an MoE
layer's whole gathers under SP, the combine all-to-all. On a calibrated CPU whose cores the ranks
fill, tetrad.planner.eager_time subtracts none of this: gloo moves the bytes with those cores.
"""

from __future__ import annotations

import math

from tetrad.spec.model import ModelConfig
from tetrad.hardware.catalog import Cluster
from tetrad.planner.comm import CommLedger, call_time, ledger_time
from tetrad.planner.compute import gemm_time, layer_times
from tetrad.planner.eager_activations import tokens
from tetrad.planner.eager_comm import tensor_parallel_block
from tetrad.planner.eager_params import data_parallel_parameters, rank_stages, stage_blocks
from tetrad.planner.eager_state import ddp_bucket_params, zero3_units
from tetrad.planner.flops import Gemm
from tetrad.planner.layout import TrainLayout
from tetrad.planner.precision import TrainingPrecision
from tetrad.schedules.generate import SPLIT_BACKWARD
# tetrad.parallel.tp_overlap cuts each TP collective in this many.
from tetrad.spec.runtime_rules import TP_OVERLAP_CHUNKS


def exposed(collective_s: float, compute_s: float, chunks: float) -> float:
    """Seconds of a collective of `collective_s` that `compute_s` of independent compute leaves
    exposed when the two are pipelined in `chunks` (math.inf: issued whole beside it)."""
    first = 0.0 if math.isinf(chunks) else collective_s / chunks
    rest = 1.0 if math.isinf(chunks) else 1.0 - 1.0 / chunks
    return first + rest * max(0.0, collective_s - compute_s)


def shared_experts_forward(config: ModelConfig, cluster: Cluster, micro_tokens: int,
                           precision: TrainingPrecision) -> float:
    """The shared experts' matmuls of one MoE block, one microbatch (they are never split)."""
    width = config.moe_ffn_hidden_size * config.num_shared_experts
    gated = 2 if config.mlp == "swiglu" else 1
    act = precision.activation_bytes
    return sum(gemm_time(cluster.gpu, gemm, precision.compute_dtype, act, precision.param_bytes)
               for gemm in (Gemm(micro_tokens, gated * width, config.hidden_size),
                            Gemm(micro_tokens, config.hidden_size, width)))


def hidden_communication(config: ModelConfig, cluster: Cluster, layout: TrainLayout,
                         seq_len: int, precision: TrainingPrecision, pp_rank: int,
                         kernel_args: tuple, scale: float = 1.0) -> float:
    """Seconds per step of pipeline rank `pp_rank`'s collectives that its compute hides (module
    doc). `kernel_args` are layer_times' arguments after the layer (eager_time's), `scale` the
    profile's step_scale applied to compute."""
    gpu, m = cluster.gpu, layout.num_microbatches
    stream, act, h = precision.param_bytes, precision.activation_bytes, config.hidden_size
    t, _ = tokens(layout, seq_len)
    hidden = backward_s = 0.0
    stage_compute: dict[int, float] = {}
    for stage in rank_stages(layout, pp_rank):
        backwards = 2 if layout.schedule in SPLIT_BACKWARD and stage > 0 else 1
        reruns = backwards if layout.recompute == "full" else 0
        for layer in stage_blocks(config, layout, stage):
            kernels = layer_times(config, gpu, layer, *kernel_args, portable_attention=True)
            backward_s += kernels.backward * scale
            stage_compute[stage] = (stage_compute.get(stage, 0.0)
                                    + (kernels.forward + kernels.backward) * scale)
            if not layout.overlap:
                continue
            if layout.tp > 1:
                block = CommLedger()
                tensor_parallel_block(block, config, layout, layer, t * h * stream, t * h * act,
                                      1, backwards, reruns)
                collective = ledger_time(cluster, block)
                matmuls = 3 * kernels.matmul_forward * scale
                hidden += m * (collective - exposed(collective, matmuls, TP_OVERLAP_CHUNKS))
            if layout.ep > 1 and config.is_moe_layer(layer) and config.num_shared_experts:
                dispatch = call_time(cluster, "all_to_all", layout.ep,
                                     t * config.num_experts_per_token * h * stream)
                shared = shared_experts_forward(config, cluster, t, precision) * scale
                hidden += m * ((1 + reruns) * (dispatch - exposed(dispatch, shared, math.inf))
                               + backwards * (dispatch - exposed(dispatch, 2 * shared,
                                                                 math.inf)))
    params = data_parallel_parameters(config, layout, pp_rank)
    group = layout.zero_group
    # The gradients' and ZeRO-3's calls as eager_comm's ledger prices them, call by call.
    if layout.zero == 0 and layout.pp == 1:
        buckets = ddp_bucket_params(params)
        reduce = sum(call_time(cluster, "all_reduce", group,
                               sum(p.elements for p in bucket) * precision.grad_bytes)
                     for bucket in buckets if group > 1)
        hidden += reduce - exposed(reduce, backward_s, len(buckets))
    elif layout.zero == 3:
        for stage, units in zero3_units(params, group).items():
            gathers = 3 if layout.schedule in SPLIT_BACKWARD and stage > 0 else 2
            traffic = sum(gathers * call_time(cluster, "all_gather", group, unit * stream)
                          + call_time(cluster, "reduce_scatter", group,
                                      unit * precision.grad_bytes)
                          for unit in units.all)
            hidden += m * (traffic - exposed(traffic, stage_compute.get(stage, 0.0),
                                             len(units.all)))
    return hidden
