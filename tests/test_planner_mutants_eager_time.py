"""The eager time model against independent references on one process: the operators PyTorch
dispatches for an MoE model (counted with the calibration's dispatch counter) and the tensors
its optimizer steps, each priced at the profile's per-operator cost; a rank's compute as the sum
of its kernels; the step's bounds by their definitions (the cores must do every rank's work;
a pipeline idles (p - 1)(F + B), Narayanan et al. 2021); the shared experts' matmuls by their
shapes."""

from __future__ import annotations

import dataclasses

import pytest
from test_eager_time import dispatched

from tetrad.hardware.catalog import GPUS, Cluster
from tetrad.models.transformer import Transformer
from tetrad.planner.compute import gemm_time, head_times, layer_times, optimizer_time
from tetrad.planner.eager_overlap import shared_experts_forward
from tetrad.planner.eager_time import block_operators, eager_step_time, outer_operators, rank_time
from tetrad.planner.flops import Gemm
from tetrad.planner.layout import TrainLayout
from tetrad.planner.precision import training_precision
from tetrad.spec.presets import preset

FP32 = training_precision("fp32")
MOE = {
    "shared": preset("tiny-moe"),
    "no-shared": preset("tiny-moe").replace(num_shared_experts=0),
    "dense-first": preset("tiny-moe").replace(num_dense_layers=1, num_layers=3),
}
H100 = GPUS["h100-sxm"]


def _cluster(gpus: int = 1, **profile) -> Cluster:
    gpu = dataclasses.replace(H100, efficiency=dataclasses.replace(H100.efficiency, **profile))
    return Cluster(gpu, gpus, gpus)


def test_moe_operators_grow_as_pytorch_dispatches():
    """Each routed expert more, and a shared expert, add to every MoE block the operators
    PyTorch dispatches for them, forward and backward. (The base count of an MoE block is
    5 forward and 18 backward operators above this dispatch, noted in docs/testing.md: only the
    differences are held here.)"""
    def counted(config) -> tuple[int, int]:
        blocks = [block_operators(config, TrainLayout(), layer)
                  for layer in range(config.num_layers)]
        outer = outer_operators(config, first=True, last=True)
        return (sum(b.forward for b in blocks) + outer.forward,
                sum(b.backward for b in blocks) + outer.backward)

    base = MOE["shared"]
    for changed in (base.replace(num_experts=8), MOE["no-shared"]):
        planned = [a - b for a, b in zip(counted(changed), counted(base))]
        by_torch = [a - b for a, b in zip(dispatched(changed), dispatched(base))]
        assert planned == by_torch != [0, 0]


def test_each_dispatched_operator_and_stepped_tensor_costs_the_profile():
    """On a CPU (operators one after another) each dispatched forward operator adds
    op_forward_s, each backward one op_backward_s; the optimizer pays optimizer_tensor_s and two
    operators per tensor torch steps. On a GPU the host's operators overlap the kernels: the
    slower of the two sets the pace."""
    config = preset("tiny")
    forward_ops, backward_ops = dispatched(config)
    tensors = len(list(Transformer(config).parameters()))
    layout = TrainLayout(micro_batch=2)

    def time(**profile):
        return rank_time(config, _cluster(**profile), layout, 16, FP32, True, 0)

    cpu = {"concurrent_ranks": 1}
    plain = time(**cpu)
    costly = time(op_forward_s=1e-6, op_backward_s=3e-6, optimizer_tensor_s=5e-6, **cpu)
    assert costly.forward - plain.forward == pytest.approx(forward_ops * 1e-6)
    assert costly.backward - plain.backward == pytest.approx(backward_ops * 3e-6)
    assert costly.optimizer - plain.optimizer == pytest.approx(tensors * (5e-6 + 2 * 1e-6))
    gpu = time(op_forward_s=1.0, op_backward_s=1e-12)
    assert gpu.forward == pytest.approx(forward_ops * 1.0)
    assert gpu.backward == pytest.approx(time().backward)


@pytest.mark.parametrize("dtype, recompute", [("fp32", "none"), ("fp32", "full"),
                                             ("fp8", "none")])
def test_compute_is_the_sum_of_the_kernels(dtype, recompute):
    """Without operator costs a rank's forward is its blocks' kernels and the head's; its
    backward theirs (and the recomputed forwards). Under fp8 the block linears read 1-byte
    weights and quantize inputs and weights in every forward; the head stays bf16."""
    config, gpu = MOE["dense-first"], H100
    precision = training_precision(dtype)
    act = precision.activation_bytes
    layout = TrainLayout(micro_batch=2, recompute=recompute)
    time = rank_time(config, Cluster(gpu, 1, 1), layout, 16, precision, True, 0)
    fp8 = dtype == "fp8"
    kernels = [layer_times(config, gpu, layer, 2, 16, 1, 1, 1, False, recompute, True, False,
                           dtype, act, 1 if fp8 else precision.param_bytes,
                           portable_attention=True, fp8_casts="inputs+weights" if fp8 else "")
               for layer in range(config.num_layers)]
    head = head_times(config, gpu, 2, 16, 1, 1, "bf16" if fp8 else dtype, act,
                      precision.param_bytes)
    assert time.forward == pytest.approx(sum(k.forward for k in kernels) + head.forward)
    assert time.backward == pytest.approx(sum(k.backward + k.recompute for k in kernels)
                                          + head.backward)
    assert time.weight_backward == pytest.approx(sum(k.matmul_forward for k in kernels)
                                                 + head.matmul_forward)


def _busy(config, cluster, layout, pp_rank=0):
    rank = rank_time(config, cluster, layout, 16, FP32, True, pp_rank)
    return layout.num_microbatches * (rank.forward + rank.backward) + rank.optimizer, rank


def test_one_rank_step_is_its_compute_and_its_calls():
    config, layout = preset("tiny"), TrainLayout(dp=2, micro_batch=2, grad_accum=3)
    cluster = Cluster(H100, 2, 2)
    busy, rank = _busy(config, cluster, layout)
    step = eager_step_time(config, cluster, layout, 16, FP32)
    assert (step.compute, step.communication_exposed, step.bubble) == (
        pytest.approx(busy), pytest.approx(rank.communication), 0.0)


def test_a_pipeline_idles_its_warm_up_and_cool_down():
    """1F1B over p stages of equal work: (p - 1)(F + B) idle per step, whatever m."""
    config = preset("tiny").replace(num_layers=4, tie_embeddings=False)
    cluster = Cluster(H100, 4, 4)
    for m in (4, 8):
        layout = TrainLayout(pp=4, microbatches=m, micro_batch=2, schedule="1f1b")
        ranks = [rank_time(config, cluster, layout, 16, FP32, True, r) for r in range(4)]
        forward, backward = max(r.forward for r in ranks), max(r.backward for r in ranks)
        step = eager_step_time(config, cluster, layout, 16, FP32)
        assert step.bubble == pytest.approx(3 * (forward + backward), rel=0.02)


def test_beyond_the_cores_the_step_holds_every_ranks_compute():
    """dp 4 on 2 cores: the cores do the 4 ranks' work, 4/2 of one rank's busy time, exposed
    communication included (a rank waiting in a call leaves its core to the others); with the
    slowdown of 4 ranks at once measured, that slowdown replaces 4/2, and a measured sync_wait
    keeps the calls on top of it."""
    config, layout = preset("tiny"), TrainLayout(dp=4, micro_batch=2, grad_accum=2)
    plain = _cluster(4, concurrent_ranks=2)
    busy, rank = _busy(config, plain, layout)
    assert rank.communication < busy / 2
    step = eager_step_time(config, plain, layout, 16, FP32)
    assert step.total == pytest.approx(4 * busy / 2)
    assert step.communication_exposed == pytest.approx(rank.communication)
    slowdown = {"concurrent_ranks": 2, "concurrent_slowdown": ((2, 1.5), (4, 3.0))}
    step = eager_step_time(config, _cluster(4, **slowdown), layout, 16, FP32)
    assert step.total == pytest.approx(3.0 * busy)
    waits = _cluster(4, sync_wait=((4, 1e-9),), **slowdown)
    step = eager_step_time(config, waits, layout, 16, FP32)
    assert step.compute == pytest.approx(3.0 * busy)


def test_cpu_bound_pipeline_step_is_every_ranks_cpu_time_over_the_cores():
    """pp 2 x dp 2 on 1 core with call_cpu measured: each pipeline rank stands for its dp 2
    copies, their compute at the slowdown of 4 ranks and their calls' CPU time, over the one
    core."""
    config = preset("tiny").replace(num_layers=4)
    layout = TrainLayout(pp=2, dp=2, microbatches=2, micro_batch=2)
    cluster = _cluster(4, concurrent_ranks=1, concurrent_slowdown=((4, 4.0),),
                       call_cpu=((2, 1e-2), (4, 1e-2)))
    ranks = [_busy(config, cluster, layout, r) for r in range(2)]
    step = eager_step_time(config, cluster, layout, 16, FP32)
    assert step.compute == pytest.approx(sum(busy for busy, _ in ranks) * 4.0 / 2)
    assert step.communication_exposed == pytest.approx(
        2 * sum(rank.communication_cpu for _, rank in ranks))


@pytest.mark.parametrize("mlp, up_width", [("swiglu", 2), ("gelu", 1)])
def test_shared_experts_matmuls_are_their_up_and_down_projections(mlp, up_width):
    """The shared experts' MLP for T tokens: up [T, (2 under SwiGLU) w, h], down [T, h, w], w the
    shared experts' width."""
    config = preset("tiny-moe").replace(mlp=mlp, num_shared_experts=2)
    width = config.moe_ffn_hidden_size * 2
    precision = training_precision("bf16")
    expected = sum(gemm_time(H100, gemm, "bf16", 2, 2)
                   for gemm in (Gemm(64, up_width * width, config.hidden_size),
                                Gemm(64, config.hidden_size, width)))
    assert shared_experts_forward(config, Cluster(H100, 1, 1), 64, precision) == expected


@pytest.mark.parametrize("zero, offload", [(0, False), (1, False), (3, True)])
def test_optimizer_steps_the_ranks_shard(zero, offload):
    """The optimizer streams the rank's shard of the parameters torch holds (all of them
    without ZeRO, 1/N under it; from the host with offload)."""
    config, gpu = preset("tiny"), H100
    precision = training_precision("bf16")
    layout = TrainLayout(dp=4, zero=zero, offload=offload)
    elements = sum(p.numel() for p in Transformer(config).parameters()) / (4 if zero else 1)
    expected = optimizer_time(gpu, elements, precision.grad_bytes, precision.param_bytes,
                              precision.optimizer_state_bytes, offload,
                              gpu.host_memory_bandwidth)
    time = rank_time(config, Cluster(gpu, 4, 4), layout, 16, precision, True, 0)
    assert time.optimizer == pytest.approx(expected)


def test_the_slowest_pipeline_rank_sets_the_compute():
    """An uneven cut: the rank with three blocks of four is busiest and sets the step's
    compute."""
    config = preset("tiny").replace(num_layers=4)
    layout = TrainLayout(pp=2, stage_layers=(1, 3), microbatches=4, micro_batch=2)
    cluster = Cluster(H100, 2, 2)
    busy = [_busy(config, cluster, layout, r)[0] for r in range(2)]
    assert busy[1] > busy[0]
    assert eager_step_time(config, cluster, layout, 16, FP32).compute == pytest.approx(busy[1])
