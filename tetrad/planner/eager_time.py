"""Step time of tetrad's own eager runtime (the `tetrad` runtime profile), on any hardware profile:
the work of each kernel as the shared time model prices it (tetrad.planner.compute: matmuls on the
profile's efficiency curve, attention, streaming element-wise bytes, the optimizer), plus what
eager PyTorch pays per operator, plus every collective call of the rank's ledger
(tetrad.planner.eager_comm) at the profile's measured cost for its kind and group size, plus the
pipeline bubble of the schedule the executor runs. A catalog GPU has no per-operator cost and no
measured collectives: then the work and the topology formulas alone remain.

Operators per block are those PyTorch 2.13 dispatches for tetrad's model code, counted with a
dispatch mode (tests/test_eager_time.py counts them again): a dense block with RMSNorm, rotary
and SwiGLU dispatches 60 in forward and autograd runs 107 in backward; LayerNorm, learned positions,
GELU and biases change that by the amounts below. Tensor, sequence, context and expert
parallelism add their collectives' own operators, and full recomputation runs the forward again
inside the backward.

On a CPU the operators' costs add to their work; on a GPU the host issues kernels while earlier
ones run, so a stage takes the longer of the two.

Zero bubble's split backward walks a later stage's graph twice under ZeRO-3 or recomputation
(TrainLayout.backward_walks: B for the input gradient, W again from the output for the
weights): its backward pays every kernel and operator once more but the weight-gradient matmuls
and their operators, which B leaves to W (split_backward_operators, counted against PyTorch's
dispatch). Otherwise W starts where the weights join the input's path and computes only their
products: one walk, the whole backward's kernels, and beside its operators one accumulation per
weight group that the count leaves out.

A calibrated profile's `step_scale` (a whole training step of a calibration model measured
against this sum of parts) scales every rank's compute: what the parts leave out (module calls
and hooks, the autograd engine, slow element-wise kernels, clipping). Its `concurrent_slowdown`
(that step run by several ranks at once) scales a rank's compute by how many share the cores,
and the step cannot end before the cores have done every rank's work at the slowdown of all
ranks at once. Its `sync_wait` adds to every collective call that starts after compute what a
call costs beyond compute when that many ranks alternate compute and calls (a blocked peer waits
for a core; eager_comm.waiting_calls says which calls); with more ranks than cores, where a
rank blocked in a call leaves its core to the others and the step's demand bound holds their
compute, what such calls cost back to back (`sync_wait_back_to_back`). A call right behind
another, only a norm and a residual add apart (sequence parallelism's all-gathers), finds its
peers running and pays the back-to-back wait too (eager_comm.queued_calls); ZeRO-3's gathers and
reduce-scatters issued a unit ahead wait for nothing (eager_comm.overlapped_calls). Each call
between computations also costs the rank `call_compute_s` outside any wait (tetrad's call
layer, the compute after it running slower), added to the slowest rank's compute as measured.
Where the ranks fill the cores, nothing of the communication is hidden behind compute: gloo
moves the bytes with the cores that compute.

With more ranks than cores and `call_cpu` measured, a call costs no wait of its own: the cores
stay busy (1.84-1.88 of 2 in the 4- and 8-rank layouts on the 2-core machine) and the step is
the ranks' total CPU time over the cores (`cpu_bound_step`): each rank's compute at the
slowdown of all ranks at once, each collective's time as its fit measured it, of which a rank
beyond the cores holds cores / n (the fit's n ranks shared the cores), and per call issued
`call_cpu` (the backend's threads, sleeping and waking) and `call_compute_s` (tetrad's call
layer, the compute after it slower). The step is the longer of that and the critical path
without waits. Without these measurements, on a machine whose ranks share fewer cores than
there are ranks (`concurrent_ranks`), the step is the longer of the critical path and the total
compute over the cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tetrad.spec.layout import FORWARD_AGAIN
from tetrad.spec.model import ModelConfig
from tetrad.hardware.efficiency import EfficiencyProfile
from tetrad.hardware.catalog import Cluster
from tetrad.planner import comm
from tetrad.planner.compute import head_times, layer_times, optimizer_time
from tetrad.planner.eager import pipeline_ranks
from tetrad.planner.eager_comm import overlapped_calls, queued_calls, waiting_calls
from tetrad.planner.eager_overlap import hidden_communication
from tetrad.planner.eager_params import (block_params, rank_parameters, rank_stages,
                                         stage_blocks)
from tetrad.planner.model_stats import norm_params
from tetrad.planner.offload_time import offload_time
from tetrad.planner.layout import TrainLayout, with_runtime_cut
from tetrad.planner.precision import TrainingPrecision
from tetrad.planner.timeline import StepTime, pipeline_bubble_ratio


@dataclass(frozen=True)
class Operators:
    forward: float
    backward: float


def block_operators(config: ModelConfig, layout: TrainLayout, layer: int) -> Operators:
    """ATen operators of one block's forward and backward on one rank (module doc)."""
    rms, rope = config.norm == "rmsnorm", config.position == "rope"
    gated = config.mlp == "swiglu"
    forward = 32 + 12 * rms + 14 * rope + 2 * gated
    backward = 54 + 32 * rms + 18 * rope + 3 * gated + 14 * config.bias
    if config.is_moe_layer(layer):
        experts = config.num_experts // layout.ep
        forward += 21 + 15 * experts + 8 * bool(config.num_shared_experts)
        backward += 17 + 30 * experts + 19 * bool(config.num_shared_experts)
        if layout.ep > 1:
            forward += 24
            backward += 24
    if layout.tp > 1:  # f and g around both projections' pairs, each a few operators
        forward += 12 + 8 * layout.sequence_parallel
        backward += 12 + 8 * layout.sequence_parallel
    if layout.cp > 1:  # ring attention: a block of scores per ring step, merged into the output
        # (the last cp rank's backward, whose blocks' rows and columns are cut most, sets the
        # pace: 5 operators more per index than the first's)
        forward += 44 * layout.cp - 14
        backward += 77 * layout.cp + 9
    if layout.recompute in FORWARD_AGAIN:
        backward += forward
    return Operators(forward, backward)


def outer_operators(config: ModelConfig, first: bool, last: bool) -> Operators:
    """The embedding (first stage), the rotary tables (every stage) and the final norm, head
    and loss (last stage)."""
    rms = config.norm == "rmsnorm"
    learned = config.position == "learned"
    forward = (1 + learned) * first + 5 * (config.position == "rope") + (21 - 6 * (not rms)) * last
    backward = (8 + 4 * learned) * first + (26 - 16 * (not rms) + config.bias) * last
    return Operators(forward, backward)


def norm_weight_operators(config: ModelConfig) -> int:
    """Backward operators that compute one norm's weight (and bias) gradients alone."""
    return 4 if config.norm == "rmsnorm" else 1 + 3 * config.bias


def weight_gradient_operators(config: ModelConfig, layout: TrainLayout, layer: int) -> int:
    """Operators of a block's backward that compute only its weights' gradients, which zero
    bubble's B leaves to W (PyTorch 2.13's dispatch, counted again in tests/test_eager_time.py):
    5 per matmul weight, 2 per linear bias, and the norms' (norm_weight_operators)."""
    params = [p for p in block_params(config, layout, layer) if not p.frozen]
    norms = 2 + (config.attention == "mla") * (1 + bool(config.q_lora_rank))
    norm_tensors = norms * norm_params(config) // config.hidden_size
    matmuls = sum(p.matmul for p in params)
    biases = len(params) - matmuls - norm_tensors
    return 5 * matmuls + 2 * biases + norms * norm_weight_operators(config)


def split_backward_operators(config: ModelConfig, layout: TrainLayout, stage: int) -> float:
    """What a split backward (zero bubble) that walks twice (TrainLayout.backward_walks) adds
    to a stage's backward operators per microbatch: B walks the stage's graph for the input's
    gradient, all but the weights' gradients, and W walks it again from the output for the
    weights, every operator but the few that lead to the
    stage input alone (its first norm's input path and the residual). A whole backward does
    each once. On the first stage B has no input gradient to compute and W does it all."""
    if layout.backward_walks(stage) == 1:
        return 0.0
    added = -(1 + 14 * (config.norm == "rmsnorm"))
    for layer in stage_blocks(config, layout, stage):
        added += (block_operators(config, layout, layer).backward
                  - weight_gradient_operators(config, layout, layer))
    if stage == layout.pp * layout.vpp - 1:  # the final norm and head, walked twice too
        added += outer_operators(config, False, True).backward - 5 - norm_weight_operators(
            config)
    return added


def issue(kernels: float, operators: float, profile: EfficiencyProfile) -> float:
    """A CPU runs each operator's Python, dispatch and kernel one after another; a GPU runs its
    kernels while the host issues the next ones, so the slower of the two sets the pace."""
    return max(kernels, operators) if profile.concurrent_ranks == 0 else kernels + operators


@dataclass(frozen=True)
class RankTime:
    forward: float  # one microbatch through the rank's stages
    backward: float
    weight_backward: float  # the part of backward zero bubble defers (the forward's matmuls)
    optimizer: float
    communication: float  # every call of the step, less what compute hides (eager_overlap)
    call_compute: float  # the calls' time outside their waits (call_compute_s)
    communication_cpu: float  # CPU seconds of the step's calls on this rank (cpu_bound_step;
    # 0 unless the step is bound by the cores)


def rank_time(config: ModelConfig, cluster: Cluster, layout: TrainLayout, seq_len: int,
              precision: TrainingPrecision, flash: bool, pp_rank: int) -> RankTime:
    layout = with_runtime_cut(config, layout, seq_len)
    gpu = cluster.gpu
    profile = gpu.efficiency
    fp8 = precision.compute_dtype == "fp8"
    weight_bytes = 1.0 if fp8 else precision.param_bytes
    # tetrad's FP8 linears quantize their weight from the master copy in every forward
    # (tetrad.models.fp8), and the LM head stays bf16.
    fp8_casts = "inputs+weights" if fp8 else ""
    head_dtype, head_weight_bytes = ("bf16", precision.param_bytes) if fp8 else (
        precision.compute_dtype, weight_bytes)
    act = precision.activation_bytes
    args = (layout.micro_batch, seq_len, layout.tp, layout.cp, layout.ep,
            layout.sequence_parallel, layout.recompute, flash, False, precision.compute_dtype,
            act, weight_bytes)
    forward = backward = matmul = 0.0
    forward_ops = backward_ops = 0.0
    last_stage = layout.pp * layout.vpp - 1
    for stage in rank_stages(layout, pp_rank):
        # Where zero bubble's W walks the stage's graph again: every kernel of the backward
        # once more but the weight-gradient matmuls B left to it (split_backward_operators).
        walks = layout.backward_walks(stage)
        for layer in stage_blocks(config, layout, stage):
            kernels = layer_times(config, gpu, layer, *args, portable_attention=True,
                                  fp8_casts=fp8_casts)
            ops = block_operators(config, layout, layer)
            forward += kernels.forward
            backward += (walks * (kernels.backward + kernels.recompute)
                         - (walks - 1) * kernels.matmul_forward)
            matmul += kernels.matmul_forward
            forward_ops += ops.forward
            backward_ops += ops.backward
        outer = outer_operators(config, stage == 0, stage == last_stage)
        forward_ops += outer.forward
        backward_ops += outer.backward + split_backward_operators(config, layout, stage)
        if stage == last_stage:
            head = head_times(config, gpu, layout.micro_batch, seq_len, layout.tp, layout.cp,
                              head_dtype, act, head_weight_bytes)
            forward += head.forward
            backward += walks * head.backward - (walks - 1) * head.matmul_forward
            matmul += head.matmul_forward
    forward = issue(forward, forward_ops * profile.op_forward_s, profile)
    backward = issue(backward, backward_ops * profile.op_backward_s, profile)
    params = rank_parameters(config, layout, pp_rank)
    elements = sum(p.elements for p in params)
    tensors = len(params)
    if layout.zero >= 1:
        elements /= layout.zero_group
    optimizer = (optimizer_time(gpu, elements, precision.grad_bytes, precision.param_bytes,
                                precision.optimizer_state_bytes,
                                layout.offload, gpu.host_memory_bandwidth, layout.offload_params)
                 + tensors * (profile.optimizer_tensor_s + 2 * profile.op_forward_s))
    # Not scaled by step_scale: its calibration step makes no offload copies, and calibrate
    # times them as a step makes them (inside a step they run at that rate: BENCHMARKS.md).
    host_link = offload_time(config, layout, precision, gpu, pp_rank)
    ledger = pipeline_ranks(config, layout, seq_len, precision)[pp_rank].comm
    scale = profile.step_scale or 1.0
    # A call after compute also waits for its peers to be scheduled again when the ranks share
    # the cores; calls right behind another (the step's closing burst) find them running.
    # Beyond the cores, a rank blocked in a call leaves its core to the others, whose compute
    # the step's demand bound (eager_step_time) already counts: such a call costs what it
    # costs back to back.
    world, cores = layout.world_size, profile.concurrent_ranks
    bound_by_cpu = cpu_bound(profile, world)
    if bound_by_cpu:  # the calls' cost is CPU time, in cpu_bound_step
        wait = back_to_back = 0.0
    else:
        back_to_back = profile.sync_wait_back_to_back_s(world)
        wait = (back_to_back if profile.sync_wait_back_to_back and cores and world > cores
                else profile.sync_wait_s(world))
    calls = waiting_calls(config, layout, seq_len, precision, pp_rank)
    # Calls right behind another find their peers running: the back-to-back wait.
    queued = queued_calls(config, layout, seq_len, precision, pp_rank)
    # Where the ranks fill the cores, the cores that compute also move the bytes (gloo):
    # nothing is hidden behind compute (the launcher leaves overlap off on gloo for this).
    hidden = (0.0 if cores and world >= cores else
              hidden_communication(config, cluster, layout, seq_len, precision, pp_rank, args,
                                   scale))
    issued = calls + queued + overlapped_calls(config, layout, precision, pp_rank)
    communication_cpu = 0.0
    if bound_by_cpu:
        # A collective's fit over n ranks measured their CPU time shared by the cores.
        communication_cpu = issued * (profile.call_cpu_s(world) + profile.call_compute_s) + sum(
            count * comm.call_time(cluster, kind, size, nbytes) * min(1.0, cores / size)
            for (kind, size, nbytes), count in ledger.calls.items())
    return RankTime(forward * scale, backward * scale, matmul * scale,
                    optimizer * scale + host_link,
                    comm.ledger_time(cluster, ledger) + calls * wait + queued * back_to_back
                    - hidden, issued * profile.call_compute_s, communication_cpu)


def cpu_bound(profile: EfficiencyProfile, world: int) -> bool:
    """More ranks than cores, and what a call costs them in CPU time measured (call_cpu)."""
    return bool(profile.call_cpu and profile.concurrent_ranks
                and world > profile.concurrent_ranks)


def cpu_bound_step(ranks: list[RankTime], busy: list[float], layout: TrainLayout,
                   profile: EfficiencyProfile) -> StepTime:
    """The ranks' total CPU time over the cores (module doc): every pipeline rank stands for
    world / pp ranks alike. Compute is their share of it, communication the calls' share."""
    world, cores = layout.world_size, profile.concurrent_ranks
    copies = world / layout.pp / cores
    # The slowdown of all ranks at once is their compute's share of the cores (world / cores
    # where nothing is measured) and what sharing them costs besides (caches, switching).
    slowdown = profile.slowdown(world) if profile.concurrent_slowdown else world / cores
    compute = sum(busy) * slowdown / layout.pp
    return StepTime(compute, copies * sum(rank.communication_cpu for rank in ranks), 0.0)


@lru_cache(maxsize=1024)
def eager_step_time(config: ModelConfig, cluster: Cluster, layout: TrainLayout, seq_len: int,
                    precision: TrainingPrecision, flash: bool = True) -> StepTime:
    """One optimizer step of tetrad's runtime on `cluster` (module doc)."""
    layout = with_runtime_cut(config, layout, seq_len)
    ranks = [rank_time(config, cluster, layout, seq_len, precision, flash, r)
             for r in range(layout.pp)]
    m = layout.num_microbatches
    busy = [m * (r.forward + r.backward) + r.optimizer for r in ranks]
    slowest = max(range(layout.pp), key=lambda r: busy[r] + ranks[r].communication
                  + ranks[r].call_compute)
    forward = max(r.forward for r in ranks)
    backward = max(r.backward for r in ranks)
    weight = max(r.weight_backward for r in ranks)
    ratio = pipeline_bubble_ratio(layout.schedule, layout.pp, layout.schedule_microbatches,
                                  layout.vpp, forward, backward, min(weight, backward / 2))
    bubble = ratio * m * (forward + backward)
    communication = ranks[slowest].communication
    profile = cluster.gpu.efficiency
    cores, world = profile.concurrent_ranks, layout.world_size
    # Ranks sharing the cores slow each other (caches, memory, turbo; 1 when not measured). The
    # calls' compute was measured with its 2 ranks computing at once: not slowed again.
    compute = (busy[slowest] * profile.slowdown(min(world, cores or world))
               + ranks[slowest].call_compute)
    if profile.concurrent_slowdown:
        # Beyond the cores the ranks queue; waiting ranks (collectives, bubble) leave the cores
        # to others.
        demand = sum(busy) / layout.pp * profile.slowdown(world)
        # Measured waits (sync_wait) come on top of compute: then a rank in a collective frees
        # no core for the others, as that measurement found.
        compute = max(compute, demand - bubble - (0.0 if profile.sync_wait else communication))
    elif cores and world > cores:
        # Every rank's compute must pass through the cores; waiting ranks leave them to others.
        demand = sum(busy) * world / layout.pp / cores
        compute = max(compute, demand - communication - bubble)
    critical = StepTime(compute, communication, bubble)
    if cpu_bound(profile, world):
        return max(critical, cpu_bound_step(ranks, busy, layout, profile),
                   key=lambda step: step.total)
    return critical
