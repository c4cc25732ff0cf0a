"""One training layout, evaluated: memory per GPU, step time and its breakdown, throughput, and the
bytes each collective moves. Everything the search ranks and the run report compares against.

Communication per step (bytes each rank hands to a collective, S = tokens * hidden * act bytes):
  TP   4 collectives of S per block per microbatch (2 forward, 2 backward; 6 with full
       recomputation): all-reduces, or all-gather + reduce-scatter pairs with sequence parallelism;
       2 more around the LM head and embedding.
  CP   a ring of K/V chunks per block: (cp - 1) chunks forward, twice that backward.
  EP   dispatch and combine all-to-alls per MoE block: 2 forward, 2 backward.
  PP   one activation forward and one gradient backward per microbatch per stage boundary.
  DP   the gradients once per step (all-reduce, or reduce-scatter + parameter all-gather with
       ZeRO-1), per microbatch with ZeRO-2 (reduce-scatter) and ZeRO-3 (two parameter all-gathers
       and a reduce-scatter): ZeRO-3's 1.5x volume of ZeRO paper section 7.
The `tetrad` runtime profile replaces these bytes with its own runtime's, collective by
collective (tetrad.planner.eager_comm), and the step time with its own runtime's
(tetrad.planner.eager_time: per-operator costs and each collective call timed).
"""

from __future__ import annotations

from functools import lru_cache

from tetrad.spec.layout import FORWARD_AGAIN
from tetrad.spec.model import ModelConfig
from tetrad.hardware.catalog import Cluster
from tetrad.planner import comm, eager
from tetrad.planner.comm import CommLedger
from tetrad.planner.compute import KernelTimes, optimizer_time, stage_times
from tetrad.planner.eager_time import eager_step_time
from tetrad.planner.estimate import TrainingEstimate
from tetrad.planner.flops import attention_head_dims, training_flops_per_sequence
from tetrad.planner.layout import TrainLayout, stage_layer_counts, with_runtime_cut
from tetrad.planner.offload_time import offload_time
from tetrad.planner.memory import stage_params, stages_to_check, training_memory
from tetrad.planner.runtime_memory import usable_tensor_memory
from tetrad.planner.workload import TrainWorkload
from tetrad.planner.weight_copies import UNSHARDED_GRAD_BYTES, keeps_stage_whole
from tetrad.planner.timeline import (StepTime, overlapped, paired_share, pipeline_bubble_ratio,
                                     pipeline_bubble_ratio_floor)
from tetrad.schedules.generate import V_SHAPED


def _tp_collective_time(cluster: Cluster, layout: TrainLayout, size: float) -> float:
    group = comm.place_group(cluster, layout.tp, 1)
    if layout.sequence_parallel:
        return comm.all_gather_time(cluster, group, size)  # one all-gather or reduce-scatter
    return comm.all_reduce_time(cluster, group, size)


def _microbatch_comm(config: ModelConfig, cluster: Cluster, layout: TrainLayout,
                     workload: TrainWorkload, kernels: KernelTimes, stage: int,
                     ledger: CommLedger | None, expert_tp: int) -> float:
    """Exposed TP, CP and EP communication of one microbatch on `stage`; records bytes.
    `expert_tp` is layout.expert_tp (passed, as `layout` may be a shape without dp)."""
    act = workload.precision.activation_bytes
    tokens = layout.micro_batch * workload.seq_len / layout.cp
    counts = stage_layer_counts(config.num_layers, layout.pp)
    first = sum(counts[:stage])
    num_layers = counts[stage]
    num_moe = sum(1 for layer in range(first, first + num_layers) if config.is_moe_layer(layer))
    passes = 3 if layout.recompute in FORWARD_AGAIN else 2  # forward, backward, forward again
    exposed = 0.0
    interference = cluster.gpu.efficiency.comm_interference
    if layout.tp > 1:
        size = tokens * config.hidden_size * act
        # Two all-reduces per block and pass, or with sequence parallelism an all-gather and a
        # reduce-scatter in their place (the same bytes); two more around the head.
        per_all_reduce = 2 if layout.sequence_parallel else 1
        # A parallel block sums attention's and the MLP's partial outputs before one reduction.
        per_block = 1 if config.parallel_block else 2
        num_collectives = per_all_reduce * (per_block * passes * num_layers
                                            + (2 if stage == layout.pp - 1 else 0))
        tp_time = num_collectives * _tp_collective_time(cluster, layout, size)
        if workload.overlap_tp_comm:
            # Chunked GEMMs hide the collective except its first chunk.
            tp_time = max(tp_time / layout.tp, tp_time - 3 * kernels.matmul_forward,
                          interference * tp_time)
        exposed += tp_time
        if ledger is not None:
            kinds = (("all_gather", 0.5), ("reduce_scatter", 0.5)) \
                if layout.sequence_parallel else (("all_reduce", 1.0),)
            for kind, share in kinds:
                ledger.add(kind, layout.tp, size, share * num_collectives)
    if layout.cp > 1:
        d_qk, d_v = attention_head_dims(config)
        heads = (-(-config.num_heads // layout.tp) if config.attention == "mla"
                 else -(-config.num_kv_heads // layout.tp))
        chunk = tokens * heads * (d_qk + d_v) * act
        group = comm.place_group(cluster, layout.cp, layout.tp)
        step = comm.p2p_time(cluster, not group.intra_node, chunk)
        ring = 3 * (layout.cp - 1) * step * num_layers  # forward K/V, backward K/V and dK/dV
        exposed += overlapped(ring, kernels.attention_forward * 3.5, True, interference)
        if ledger is not None:
            ledger.add("p2p", layout.cp, chunk, 3 * (layout.cp - 1) * num_layers)
    if layout.ep > 1 and num_moe:
        size, num_a2a, one = _expert_all_to_all(config, cluster, layout, workload, stage,
                                                expert_tp)
        exposed += num_a2a * one
        if ledger is not None:
            ledger.add("all_to_all", layout.ep, size, num_a2a)
    return exposed


def _expert_all_to_all(config: ModelConfig, cluster: Cluster, layout: TrainLayout,
                       workload: TrainWorkload, stage: int,
                       expert_tp: int) -> tuple[float, int, float]:
    """(bytes of one dispatch or combine, how many one microbatch runs on `stage`, the time of
    one): two per MoE block and pass (forward, backward, and the recomputed forward)."""
    tokens = layout.micro_batch * workload.seq_len / layout.cp
    counts = stage_layer_counts(config.num_layers, layout.pp)
    first = sum(counts[:stage])
    num_moe = sum(1 for layer in range(first, first + counts[stage])
                  if config.is_moe_layer(layer))
    passes = 3 if layout.recompute in FORWARD_AGAIN else 2
    token = workload.precision.activation_bytes * config.hidden_size
    size = tokens / layout.tp * config.num_experts_per_token * token
    # Over tensor ranks too (expert_tp 1), the group's members are adjacent ranks.
    group = comm.place_group(cluster, layout.ep, expert_tp)
    off_node = None
    if workload.node_limited_dispatch and group.num_nodes > 1:
        nodes = min(config.num_experts_per_token, group.num_nodes)
        if config.num_expert_groups == group.num_nodes:
            nodes = min(nodes, config.topk_expert_groups)
        off_node = tokens / layout.tp * token * nodes * (group.num_nodes - 1) / group.num_nodes
    return size, 2 * passes * num_moe, comm.all_to_all_time(cluster, group, size, off_node)


def _hidden_by_pairing(config: ModelConfig, cluster: Cluster, layout: TrainLayout,
                       workload: TrainWorkload, stage: int, kernels: KernelTimes) -> float:
    """Expert all-to-all time per microbatch that DualPipe takes off the exposed communication:
    in each of its overlapped pairs the forward chunk's dispatches and combines run while the
    paired backward chunk computes, and the backward's while the forward computes, so a pair
    exposes only what outlasts the pair's compute (and the compute the communication kernels
    slow down). Chunk passes outside the pairs (the V's warm-up and cool-down) stay exposed."""
    if layout.schedule != "dualpipe" or layout.ep == 1:
        return 0.0
    _, num_a2a, one = _expert_all_to_all(config, cluster, layout, workload, stage,
                                          layout.expert_tp)
    a2a = num_a2a * one
    window = kernels.forward + kernels.backward + kernels.recompute
    interference = cluster.gpu.efficiency.comm_interference
    share = paired_share(layout.schedule, layout.pp, layout.num_microbatches, layout.vpp)
    return share * (a2a - overlapped(a2a, window, True, interference))


def _data_parallel(config: ModelConfig, cluster: Cluster, layout: TrainLayout,
                   workload: TrainWorkload, stage: int, forward: float, backward: float,
                   ledger: CommLedger) -> float:
    """Exposed time of the gradient reduction and ZeRO parameter gathers of one step."""
    precision = workload.precision
    dense, expert = stage_params(config, layout.pp, stage, layout.tp, layout.ep,
                                 layout.expert_tp)
    m = layout.num_microbatches
    exposed = 0.0
    interference = cluster.gpu.efficiency.comm_interference
    for elements, size, stride in ((dense, layout.zero_group, layout.tp),
                                   (expert, layout.expert_zero_group,
                                    layout.expert_tp * layout.ep)):
        if size == 1 or elements == 0:
            continue
        flat = layout.zero == 3 and workload.zero3_per_parameter
        # One NIC per rank: placed as if each rank were alone on its node.
        group = comm.place_group(cluster, size, cluster.node_size if flat else stride)
        grads = elements * precision.grad_bytes
        params = elements * precision.param_bytes
        zero = layout.zero
        if keeps_stage_whole(layout, workload.zero3_whole_stage_under_pp):
            # One gather and one fp32 reduce-scatter a step (weight_copies): ZeRO-1's pattern.
            zero, grads = 1, elements * UNSHARDED_GRAD_BYTES
        reduce_time = comm.reduce_scatter_time(cluster, group, grads)
        gather_time = comm.all_gather_time(cluster, group, params)
        if zero == 0:
            exposed += overlapped(comm.all_reduce_time(cluster, group, grads), backward,
                                  workload.overlap_grad_reduce, interference)
            ledger.add("all_reduce", size, grads)
        elif zero == 1:
            exposed += overlapped(reduce_time, backward, workload.overlap_grad_reduce,
                                  interference)
            exposed += overlapped(gather_time, forward, workload.overlap_param_gather,
                                  interference)
            ledger.add("reduce_scatter", size, grads)
            ledger.add("all_gather", size, params)
        elif zero == 2:
            exposed += m * overlapped(reduce_time, backward, workload.overlap_grad_reduce,
                                      interference)
            exposed += overlapped(gather_time, forward, workload.overlap_param_gather,
                                  interference)
            ledger.add("reduce_scatter", size, grads, m)
            ledger.add("all_gather", size, params)
        else:
            backward_gathers = 2 if flat and layout.recompute in FORWARD_AGAIN else 1
            exposed += m * overlapped(gather_time, forward, workload.overlap_param_gather,
                                      interference)
            exposed += m * overlapped(backward_gathers * gather_time + reduce_time, backward,
                                      workload.overlap_grad_reduce, interference)
            ledger.add("all_gather", size, params, (1 + backward_gathers) * m)
            ledger.add("reduce_scatter", size, grads, m)
    return exposed


def _pipeline_p2p(config: ModelConfig, cluster: Cluster, layout: TrainLayout,
                  workload: TrainWorkload, stage: int, ledger: CommLedger) -> float:
    """Exposed time of the activations and gradients sent between stages; records the bytes
    `stage` sends: one message forward from each of its v chunks (not from the model's last) and
    one backward (not from the model's first)."""
    if layout.pp == 1:
        return 0.0
    split = layout.tp if layout.sequence_parallel else 1
    size = (layout.micro_batch * workload.seq_len / layout.cp * config.hidden_size
            * workload.precision.activation_bytes / split)
    crosses = layout.tp * layout.cp * layout.dp >= cluster.node_size
    one = comm.p2p_time(cluster, crosses, size)
    m, v = layout.num_microbatches, layout.vpp
    if layout.schedule in V_SHAPED:  # the V's ends: rank 0 the model's, the last its turn
        sends = m * (2 * v - 2 * (stage in (0, layout.pp - 1)))
    else:
        sends = m * (2 * v - (stage == layout.pp - 1) - (stage == 0))
    ledger.add("p2p", 2, size, sends)
    on_critical_path = layout.pp - 1 if workload.overlap_p2p else m * v + layout.pp - 1
    return 2 * on_critical_path * one


@lru_cache(maxsize=16384)
def _bottleneck(config: ModelConfig, cluster: Cluster, workload: TrainWorkload, tp: int, pp: int,
                cp: int, ep: int, sequence_parallel: bool, recompute: str,
                micro_batch: int, expert_tp: int,
                zero3: bool) -> tuple[int, KernelTimes, float]:
    """(slowest stage, its kernel times, its exposed TP/CP/EP time) for one microbatch. Keyed by
    the fields that decide them, so layouts differing in dp, schedule or ZeRO stage share an
    entry (ZeRO-3 alone changes what a kernel reads: `zero3`)."""
    # dp does not change these times; dp = ep keeps the shape a valid layout (ep divides dp*cp).
    shape = TrainLayout(tp=tp, pp=pp, dp=ep, cp=cp, ep=ep, sequence_parallel=sequence_parallel,
                        recompute=recompute, micro_batch=micro_batch)
    precision = workload.precision
    weight = 1.0 if precision.compute_dtype == "fp8" else precision.param_bytes
    best: tuple[int, KernelTimes, float] | None = None
    for stage in stages_to_check(config, pp):
        kernels = stage_times(config, cluster.gpu, pp, stage, micro_batch, workload.seq_len, tp,
                              cp, ep, sequence_parallel, recompute, workload.flash_attention,
                              workload.dropout, precision.compute_dtype,
                              precision.activation_bytes, weight, expert_tp,
                              workload.portable_attention,
                              "inputs+weights" if zero3 else "inputs",
                              () if workload.compiled else workload.recompute_ops,
                              workload.eager_elementwise, workload.selective_op)
        exposed = _microbatch_comm(config, cluster, shape, workload, kernels, stage, None,
                                   expert_tp)
        total = kernels.forward + kernels.backward + kernels.recompute + exposed
        if best is None or total > (best[1].forward + best[1].backward + best[1].recompute
                                    + best[2]):
            best = (stage, kernels, exposed)
    assert best is not None
    return best


def _slowest_stage(config: ModelConfig, cluster: Cluster, layout: TrainLayout,
                   workload: TrainWorkload) -> tuple[int, KernelTimes, float]:
    """_bottleneck of `layout`, its exposed TP/CP/EP time less what DualPipe's pairs hide."""
    stage, kernels, comm = _bottleneck(
        config, cluster, workload, layout.tp, layout.pp, layout.cp, layout.ep,
        layout.sequence_parallel, layout.recompute, layout.micro_batch, layout.expert_tp,
        layout.zero == 3)
    return stage, kernels, comm - _hidden_by_pairing(config, cluster, layout, workload, stage,
                                                     kernels)


def microbatch_durations(config: ModelConfig, cluster: Cluster, layout: TrainLayout,
                         workload: TrainWorkload) -> tuple[float, float, float]:
    """Seconds of one microbatch on the slowest stage, as evaluate_training's bubble takes them:
    forward, backward (recomputation included) and the part of it a split schedule defers as W,
    each stretched by the exposed TP/CP/EP communication in proportion."""
    _, kernels, comm = _slowest_stage(config, cluster, layout, workload)
    backward = kernels.backward + kernels.recompute
    stretch = 1 + comm / (kernels.forward + backward)
    return (kernels.forward * stretch, backward * stretch, kernels.matmul_forward * stretch)


def step_time_lower_bound(config: ModelConfig, cluster: Cluster, layout: TrainLayout,
                          workload: TrainWorkload) -> float:
    """At most evaluate_training's step.total but for the `tetrad` runtime: the same floats less
    the optimizer and host transfers, with pipeline_bubble_ratio_floor's bubble."""
    stage, kernels, microbatch_comm = _slowest_stage(config, cluster, layout, workload)
    m, backward = layout.num_microbatches, kernels.backward + kernels.recompute
    per_microbatch_kernels = kernels.forward + kernels.backward + kernels.recompute
    bound = m * per_microbatch_kernels + (m * microbatch_comm + _data_parallel(
        config, cluster, layout, workload, stage, kernels.forward, backward, CommLedger())
        + _pipeline_p2p(config, cluster, layout, workload, stage, CommLedger()))
    ratio = pipeline_bubble_ratio_floor(layout.schedule, layout.pp, m, layout.vpp,
                                        kernels.forward, backward, kernels.matmul_forward)
    return bound + ratio * m * (per_microbatch_kernels + microbatch_comm)


def evaluate_training(config: ModelConfig, cluster: Cluster, layout: TrainLayout,
                      workload: TrainWorkload, count_bytes: bool = True) -> TrainingEstimate:
    """Memory, time and traffic of one step of `layout` (assumed valid: see layout.py).
    `count_bytes=False` skips the per-collective byte ledger (the search's fast path). tetrad's
    runtime is planned with the pipeline cut it will run, which the estimate's layout carries."""
    if workload.runtime == "tetrad":
        layout = with_runtime_cut(config, layout, workload.seq_len)
    precision = workload.precision
    memory, fullest = training_memory(config, layout, precision, workload.seq_len,
                                      workload.activation_options)
    gpu = cluster.gpu
    stage, kernels, microbatch_comm = _slowest_stage(config, cluster, layout, workload)
    ledger = CommLedger()
    if count_bytes:
        _microbatch_comm(config, cluster, layout, workload, kernels, stage, ledger,
                         layout.expert_tp)
        for kind in ledger.sent:  # per microbatch so far: scale to the step
            ledger.sent[kind] *= layout.num_microbatches
            ledger.payload[kind] *= layout.num_microbatches
        for call in ledger.calls:
            ledger.calls[call] *= layout.num_microbatches
    m = layout.num_microbatches
    per_microbatch_kernels = kernels.forward + kernels.backward + kernels.recompute
    dense, expert = stage_params(config, layout.pp, fullest, layout.tp, layout.ep,
                                 layout.expert_tp)
    shard = ((dense / layout.zero_group + expert / layout.expert_zero_group)
             if layout.zero >= 1 else dense + expert)
    optimizer = optimizer_time(gpu, shard, precision.grad_bytes, precision.param_bytes,
                               precision.optimizer_state_bytes, layout.offload,
                               gpu.host_memory_bandwidth, layout.offload_params)
    compute = m * per_microbatch_kernels + optimizer
    dp_exposed = _data_parallel(config, cluster, layout, workload, stage, kernels.forward,
                                kernels.backward + kernels.recompute, ledger)
    pp_exposed = _pipeline_p2p(config, cluster, layout, workload, stage, ledger)
    # Parameter offload: the shards cross the host link at each gather and reduction, exposed
    # as tetrad's runtime makes them (tetrad.planner.offload_time).
    host_link = offload_time(config, layout, precision, gpu, fullest)
    if count_bytes and workload.runtime == "tetrad":
        # tetrad's runtime counted collective by collective, for the fullest rank.
        ledger = eager.pipeline_ranks(config, layout, workload.seq_len, precision)[fullest].comm
    communication = m * microbatch_comm + dp_exposed + pp_exposed + host_link
    # The slowest stage's times for every stage (the simulator takes one duration per kind):
    # recomputation precedes the input gradient, and zero bubble defers the weight-gradient
    # matmuls (as long as the forward's). Exposed communication stretches them in proportion.
    ratio = pipeline_bubble_ratio(layout.schedule, layout.pp, m, layout.vpp, kernels.forward,
                                  kernels.backward + kernels.recompute, kernels.matmul_forward)
    bubble = ratio * m * (per_microbatch_kernels + microbatch_comm)
    step = StepTime(compute, communication, bubble)
    if workload.runtime == "tetrad":
        step = eager_step_time(config, cluster, layout, workload.seq_len, precision,
                               workload.flash_attention)
    model_flops, hardware_flops = training_flops_per_sequence(config, workload.seq_len,
                                                              layout.recompute)
    sequences = layout.global_batch
    return TrainingEstimate(
        layout=layout, memory=memory, fullest_stage=fullest,
        usable_memory=usable_tensor_memory(gpu.memory_bytes, layout),
        step=step,
        tokens_per_step=sequences * workload.seq_len,
        model_flops_per_step=model_flops * sequences,
        hardware_flops_per_step=hardware_flops * sequences, num_gpus=layout.world_size,
        peak_flops=gpu.peak(precision.compute_dtype), comm=ledger)
