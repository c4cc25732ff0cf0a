"""One training step of the planner taken apart: with every overlap switched off, the exposed
communication is the sum of each collective's own time, counted call by call from the layout (ZeRO
paper's schedule of reduce-scatters and gathers, Megatron's TP collectives per block and pass, one
all-to-all pair per MoE block and pass, one send per microbatch and boundary); the compute is the
stages' kernels times the microbatches plus the optimizer; the bubble is 1F1B's (p-1)/m; the
throughput figures are their definitions."""

from __future__ import annotations

import dataclasses

import pytest

from tetrad.hardware.catalog import Cluster
from tetrad.hardware.catalog import gpu as catalog_gpu
from tetrad.planner import comm
from tetrad.planner.compute import optimizer_time, stage_times
from tetrad.planner.flops import training_flops_per_sequence
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import stage_params
from tetrad.planner.runtime_memory import ALLOCATOR_RESERVE_SHARE
from tetrad.planner.training import TrainWorkload, evaluate_training
from tetrad.spec.presets import preset

H100 = catalog_gpu("h100-sxm")
NODE = Cluster(H100, 8)
TWO_NODES = Cluster(H100, 16)
SMALL = preset("small")
MOE = preset("tiny-moe").replace(num_layers=4, num_dense_layers=1, num_experts=8,
                                 num_experts_per_token=2)
SEQ = 128
EXPOSED = TrainWorkload(SEQ, overlap_grad_reduce=False, overlap_param_gather=False,
                        overlap_p2p=False)


def _kernels(config, layout, stage=0):
    return stage_times(config, H100, layout.pp, stage, layout.micro_batch, SEQ, layout.tp,
                       layout.cp, layout.ep, layout.sequence_parallel, layout.recompute, True,
                       False, "bf16", 2.0, 2.0, layout.expert_tp)


def _data_parallel_time(cluster, layout, elements, group_size, stride):
    """The ZeRO stage's collectives over one group, none hidden: ZeRO-0 all-reduces the bf16
    gradients once a step; ZeRO-1 reduce-scatters them and gathers the parameters once; ZeRO-2
    reduce-scatters after each microbatch; ZeRO-3 gathers before each forward and backward and
    reduce-scatters after each backward."""
    if group_size == 1 or elements == 0:
        return 0.0
    group = comm.place_group(cluster, group_size, stride)
    gather = comm.all_gather_time(cluster, group, 2 * elements)
    scatter = comm.reduce_scatter_time(cluster, group, 2 * elements)
    m = layout.num_microbatches
    return {0: comm.all_reduce_time(cluster, group, 2 * elements), 1: scatter + gather,
            2: m * scatter + gather, 3: m * (2 * gather + scatter)}[layout.zero]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("cluster", [NODE, TWO_NODES], ids=["node", "two-nodes"])
def test_exposed_data_parallel_time_is_each_zero_collective_once(zero, cluster):
    dp = cluster.num_gpus
    layout = TrainLayout(dp=dp, zero=zero, microbatches=3, micro_batch=2)
    estimate = evaluate_training(SMALL, cluster, layout, EXPOSED)
    dense, _ = stage_params(SMALL, 1, 0, 1, 1)
    assert estimate.step.communication_exposed == pytest.approx(
        _data_parallel_time(cluster, layout, dense, dp, 1))
    assert estimate.step.bubble == 0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_experts_reduce_over_the_ranks_holding_them(zero):
    """dp 8, ep 2: dense gradients over the 8, each expert's over the 4 ranks holding it; the
    expert all-to-alls (dispatch and combine, forward and backward, per MoE block) add theirs."""
    layout = TrainLayout(dp=8, ep=2, zero=zero, microbatches=2, micro_batch=2)
    estimate = evaluate_training(MOE, NODE, layout, EXPOSED)
    dense, expert = stage_params(MOE, 1, 0, 1, 2)
    data_parallel = (_data_parallel_time(NODE, layout, dense, 8, 1)
                     + _data_parallel_time(NODE, layout, expert, 4, 2))
    num_moe = MOE.num_layers - MOE.num_dense_layers
    size = 2 * SEQ * MOE.num_experts_per_token * MOE.hidden_size * 2
    a2a = comm.all_to_all_time(NODE, comm.place_group(NODE, 2, 1), size)
    assert estimate.step.communication_exposed == pytest.approx(
        data_parallel + layout.num_microbatches * 4 * num_moe * a2a)
    assert estimate.comm.payload["all_to_all"] == pytest.approx(
        layout.num_microbatches * 4 * num_moe * size)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_tensor_parallel_collectives_per_block_and_pass(sequence_parallel, recompute):
    """Two all-reduces per block and pass (forward, backward, and the forward again under full
    recomputation), two around the head; sequence parallelism makes each an all-gather plus a
    reduce-scatter of the same bytes."""
    tp, m = 2, 3
    layout = TrainLayout(tp=tp, sequence_parallel=sequence_parallel, recompute=recompute,
                         microbatches=m, micro_batch=2)
    estimate = evaluate_training(SMALL, NODE, layout, EXPOSED)
    passes = 3 if recompute == "full" else 2
    calls = 2 * passes * SMALL.num_layers + 2
    size = 2 * SEQ * SMALL.hidden_size * 2
    group = comm.place_group(NODE, tp, 1)
    one = (2 * comm.all_gather_time(NODE, group, size) if sequence_parallel
           else comm.all_reduce_time(NODE, group, size))
    assert estimate.step.communication_exposed == pytest.approx(m * calls * one)
    kinds = ("all_gather", "reduce_scatter") if sequence_parallel else ("all_reduce",)
    assert sum(estimate.comm.payload[kind] for kind in kinds) == pytest.approx(
        m * calls * size * len(kinds))


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_ring_sends_kv_chunks_three_times_per_hop(cp):
    """Forward K/V, backward K/V and dK/dV: 3(cp - 1) chunks per block and microbatch, a chunk
    being the rank's tokens times the kv heads' key and value widths."""
    layout = TrainLayout(cp=cp, microbatches=2, micro_batch=2)
    estimate = evaluate_training(SMALL, NODE, layout, EXPOSED)
    chunk = 2 * SEQ / cp * SMALL.num_kv_heads * 2 * SMALL.head_dim * 2
    assert estimate.comm.payload["p2p"] == pytest.approx(
        2 * 3 * (cp - 1) * SMALL.num_layers * chunk)


@pytest.mark.parametrize("overlap_p2p", [False, True])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_pipeline_time_is_kernels_bubble_and_boundary_sends(overlap_p2p, pp, m):
    layout = TrainLayout(pp=pp, microbatches=m, micro_batch=2)
    workload = dataclasses.replace(EXPOSED, overlap_p2p=overlap_p2p)
    estimate = evaluate_training(SMALL, NODE, layout, workload)
    slowest = max((_kernels(SMALL, layout, stage) for stage in range(pp)),
                  key=lambda k: k.forward + k.backward)
    per_microbatch = slowest.forward + slowest.backward + slowest.recompute
    fullest = estimate.fullest_stage
    dense, _ = stage_params(SMALL, pp, fullest, 1, 1)
    optimizer = optimizer_time(H100, dense, 2, 2, 12, False, H100.host_memory_bandwidth)
    assert estimate.step.compute == pytest.approx(m * per_microbatch + optimizer)
    # 1F1B idles (p - 1) microbatch slots of the slowest stage (Narayanan et al. 2021).
    assert estimate.step.bubble == pytest.approx((pp - 1) * per_microbatch, rel=1e-6)
    send = comm.p2p_time(NODE, False, 2 * SEQ * SMALL.hidden_size * 2)
    on_critical_path = pp - 1 if overlap_p2p else m + pp - 1
    assert estimate.step.communication_exposed == pytest.approx(2 * on_critical_path * send)


def test_throughput_figures_are_their_definitions():
    layout = TrainLayout(dp=2, tp=2, pp=2, microbatches=4, micro_batch=2, recompute="full")
    estimate = evaluate_training(SMALL, NODE, layout, TrainWorkload(SEQ))
    model, hardware = training_flops_per_sequence(SMALL, SEQ, "full")
    sequences = 2 * 2 * 4
    total = estimate.step.total
    assert total == pytest.approx(estimate.step.compute + estimate.step.communication_exposed
                                  + estimate.step.bubble)
    assert estimate.tokens_per_step == sequences * SEQ
    assert estimate.tokens_per_s == pytest.approx(sequences * SEQ / total)
    assert estimate.model_flops_per_step == pytest.approx(model * sequences)
    assert estimate.hardware_flops_per_step == pytest.approx(hardware * sequences)
    assert estimate.tflops_per_gpu == pytest.approx(model * sequences / total / 8 / 1e12)
    assert estimate.hardware_tflops_per_gpu == pytest.approx(
        hardware * sequences / total / 8 / 1e12)
    assert estimate.mfu == pytest.approx(model * sequences / total / 8 / H100.peak("bf16"))
    assert estimate.num_gpus == 8
    # Beside the tensors: the CUDA context and cuBLAS workspace, three two-rank communicators
    # (tp, pp, dp) and the allocator's share of the tensors (tetrad.planner.runtime_memory).
    held = 400e6 + 32 * 2**20 + 3 * 544 * 2**20
    share = ALLOCATOR_RESERVE_SHARE
    assert estimate.usable_memory == pytest.approx((H100.memory_bytes - held) / (1 + share))
    needed = estimate.memory.total * (1 + share) + held
    assert estimate.fits == (needed <= H100.memory_bytes)
    for scale, fits in ((1.001, True), (0.999, False)):
        gpu = dataclasses.replace(H100, memory_bytes=needed * scale)
        assert evaluate_training(SMALL, Cluster(gpu, 8), layout, TrainWorkload(SEQ)).fits == fits


SLOW_LINKS = Cluster(dataclasses.replace(H100, nvlink_bandwidth=H100.nvlink_bandwidth / 1e4,
                                        nic_bandwidth=H100.nic_bandwidth / 1e4), 16)


@pytest.mark.parametrize("cluster", [NODE, SLOW_LINKS], ids=["nvlink", "slow-links"])
def test_chunked_tp_collectives_hide_behind_the_matmuls_but_their_first_chunk(cluster):
    """overlap_tp_comm: at best all but one of tp chunks hide, never more than three forward
    matmuls' worth, and the SMs the collective takes slow the compute by `interference`."""
    tp, m = 4, 2
    layout = TrainLayout(tp=tp, dp=cluster.num_gpus // tp, microbatches=m, micro_batch=2)
    workload = dataclasses.replace(EXPOSED, overlap_tp_comm=True)
    estimate = evaluate_training(SMALL, cluster, layout, workload)
    calls = 2 * 2 * SMALL.num_layers + 2
    whole = calls * comm.all_reduce_time(cluster, comm.place_group(cluster, tp, 1),
                                         2 * SEQ * SMALL.hidden_size * 2)
    matmuls = _kernels(SMALL, layout).matmul_forward
    hidden = max(whole / tp, whole - 3 * matmuls, H100.efficiency.comm_interference * whole)
    dense, _ = stage_params(SMALL, 1, 0, tp, 1)
    data = comm.all_reduce_time(cluster, comm.place_group(cluster, layout.dp, tp), 2 * dense)
    assert estimate.step.communication_exposed == pytest.approx(m * hidden + data)


@pytest.mark.parametrize("cluster,tp", [(NODE, 1), (TWO_NODES, 8), (SLOW_LINKS, 8)],
                         ids=["nvlink", "nic", "slow-links"])
def test_context_parallel_ring_hides_behind_three_and_a_half_attention_forwards(cluster, tp):
    """The K/V ring runs behind the attention it feeds (forward, and the backward's 2.5); its
    hops cross nodes when cp ranks, tp apart, do not fit in one."""
    cp, m = 2, 2
    layout = TrainLayout(cp=cp, tp=tp, dp=cluster.num_gpus // (cp * tp), microbatches=m,
                         micro_batch=2)
    config = SMALL.replace(num_heads=8, num_kv_heads=8)
    estimate = evaluate_training(config, cluster, layout, EXPOSED)
    chunk = 2 * SEQ / cp * (config.num_kv_heads // tp) * 2 * config.head_dim * 2
    crosses = cp * tp > cluster.node_size
    ring = 3 * (cp - 1) * config.num_layers * comm.p2p_time(cluster, crosses, chunk)
    attention = _kernels(config, layout).attention_forward
    exposed_ring = max(0.0, ring - 3.5 * attention, H100.efficiency.comm_interference * ring)
    tensor = 0.0
    if tp > 1:
        tensor = (2 * 2 * config.num_layers + 2) * comm.all_reduce_time(
            cluster, comm.place_group(cluster, tp, 1), 2 * SEQ / cp * config.hidden_size * 2)
    dense, _ = stage_params(config, 1, 0, tp, 1)
    data = comm.all_reduce_time(cluster, comm.place_group(cluster, layout.dp * cp, tp),
                                2 * dense)
    assert estimate.step.communication_exposed == pytest.approx(
        m * (exposed_ring + tensor) + data)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_deepspeeds_per_parameter_zero3_gathers_cross_nodes_on_one_nic(recompute):
    """zero3_per_parameter: each parameter's gather is too small to spread over a node's rails,
    so the group is placed as one rank per node; recomputation re-runs the gather hooks."""
    layout = TrainLayout(dp=16, zero=3, microbatches=2, micro_batch=2, recompute=recompute)
    workload = dataclasses.replace(EXPOSED, zero3_per_parameter=True)
    estimate = evaluate_training(SMALL, TWO_NODES, layout, workload)
    dense, _ = stage_params(SMALL, 1, 0, 1, 1)
    group = comm.place_group(TWO_NODES, 16, TWO_NODES.node_size)
    gather = comm.all_gather_time(TWO_NODES, group, 2 * dense)
    scatter = comm.reduce_scatter_time(TWO_NODES, group, 2 * dense)
    backward_gathers = 2 if recompute == "full" else 1
    assert estimate.step.communication_exposed == pytest.approx(
        2 * ((1 + backward_gathers) * gather + scatter))
    assert estimate.comm.calls_by_kind()["all_gather"] == 2 * (1 + backward_gathers)


def test_a_workloads_recipe_and_options():
    from tetrad.errors import ConfigError
    from tetrad.planner.precision import training_precision

    with pytest.raises(ConfigError, match="seq_len must be at least 1"):
        TrainWorkload(0)
    assert TrainWorkload(1).precision == training_precision("bf16")
    assert TrainWorkload(8, dtype="fp32", fp32_grads=True).precision == \
        training_precision("fp32", True)
    assert TrainWorkload(8, fp32_grads=True).precision.grad_bytes == 4
    custom = training_precision("fp16")
    assert TrainWorkload(8, dtype="fp32", recipe=custom).precision is custom
    options = TrainWorkload(8, flash_attention=False, dropout=True,
                            zero3_live_params=5.0).activation_options
    assert (options.flash_attention, options.dropout, options.runtime,
            options.zero3_live_params) == (False, True, "megatron", 5.0)
