"""What the eager profile hides of a rank's communication behind its compute, where the compute
is far longer than the calls: a collective pipelined in C chunks with independent compute then
leaves exposed only its first chunk, 1/C of it (one issued whole beside the compute: nothing).
The calls are timed by fits far faster than the tiny model's kernels; the chunks are the
runtime's: TP overlap's four, ZeRO-3's units as FSDP cuts them (the module doc of
tetrad/planner/eager_overlap.py)."""

from __future__ import annotations

import dataclasses

import pytest

from tetrad.hardware.catalog import GPUS, Cluster
from tetrad.models.transformer import Transformer
from tetrad.parallel.fsdp import transformer_units
from tetrad.planner.comm import call_time, ledger_time
from tetrad.planner.eager_comm import rank_comm
from tetrad.planner.eager_overlap import shared_experts_forward
from tetrad.planner.eager_time import rank_time
from tetrad.planner.layout import TrainLayout
from tetrad.planner.precision import TrainingPrecision, training_precision
from tetrad.spec.presets import preset

MIXED = TrainingPrecision("bf16", param_bytes=4, grad_bytes=4, master_bytes=0,
                          optimizer_bytes=8, activation_bytes=2)
H100 = GPUS["h100-sxm"]
SEQ, MICRO = 16, 2


def _fast_calls(gpus: int, alpha_s: float = 1e-9) -> Cluster:
    """Collectives of any kind over 2 or 4 ranks at `alpha_s` plus a picosecond a byte: the
    bytes count, and at a nanosecond the tiny model's calls stay far shorter than its
    kernels."""
    fits = tuple((kind, size, alpha_s, 1e-12) for size in (2, 4)
                 for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"))
    gpu = dataclasses.replace(H100, efficiency=dataclasses.replace(H100.efficiency,
                                                                   collectives=fits))
    return Cluster(gpu, gpus, gpus)


def _hidden(config, layout, cluster, precision=MIXED, pp_rank=0) -> float:
    exposed = rank_time(config, cluster, layout, SEQ, precision, True, pp_rank).communication
    return ledger_time(cluster, rank_comm(config, layout, SEQ, precision, pp_rank)) - exposed


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_overlap_hides_all_but_a_chunk_of_each_blocks_calls(sequence_parallel):
    """Each block's f and g (SP: gathers and scatters), forward and backward, in 4 chunks behind
    its matmuls: 3/4 of them hidden, every microbatch."""
    config, m, cluster = preset("tiny"), 3, _fast_calls(2)
    t = MICRO * SEQ
    s_p, s_a = t * config.hidden_size * 4, t * config.hidden_size * 2
    layout = TrainLayout(tp=2, sequence_parallel=sequence_parallel, micro_batch=MICRO,
                         grad_accum=m)
    if sequence_parallel:
        block = 2 * sum(call_time(cluster, kind, 2, nbytes)
                        for kind in ("all_gather", "reduce_scatter") for nbytes in (s_p, s_a))
    else:
        block = 2 * (call_time(cluster, "all_reduce", 2, s_a)
                     + call_time(cluster, "all_reduce", 2, s_p))
    hidden = (_hidden(config, dataclasses.replace(layout, overlap=True), cluster)
              - _hidden(config, layout, cluster))
    assert hidden == pytest.approx(m * config.num_layers * block * 3 / 4)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_expert_dispatch_hides_behind_the_shared_experts(recompute):
    """With overlap each MoE block's dispatch all-to-all runs whole beside the shared experts'
    matmuls: hidden entirely, forward (again for each recomputed forward) and backward, every
    microbatch."""
    config, m, cluster = preset("tiny-moe"), 2, _fast_calls(2)
    t = MICRO * SEQ
    dispatch = call_time(cluster, "all_to_all", 2,
                         t * config.num_experts_per_token * config.hidden_size * 4)
    layout = TrainLayout(dp=2, ep=2, micro_batch=MICRO, grad_accum=m, recompute=recompute)
    hidden = (_hidden(config, dataclasses.replace(layout, overlap=True), cluster)
              - _hidden(config, layout, cluster))
    forwards = 2 if recompute == "full" else 1
    assert hidden == pytest.approx(m * config.num_layers * (forwards + 1) * dispatch)
    no_shared = config.replace(num_shared_experts=0)
    assert _hidden(no_shared, dataclasses.replace(layout, overlap=True), cluster) == (
        pytest.approx(_hidden(no_shared, layout, cluster)))


def test_a_dispatch_longer_than_the_shared_experts_hides_their_time():
    """A dispatch of a second beside the shared experts' microseconds: what it hides is their
    matmuls' time, forward once and backward twice over (the backward's matmuls)."""
    config, m, cluster = preset("tiny-moe"), 2, _fast_calls(2, alpha_s=1.0)
    shared = shared_experts_forward(config, cluster, MICRO * SEQ, MIXED)
    layout = TrainLayout(dp=2, ep=2, micro_batch=MICRO, grad_accum=m)
    hidden = (_hidden(config, dataclasses.replace(layout, overlap=True), cluster)
              - _hidden(config, layout, cluster))
    assert hidden == pytest.approx(m * config.num_layers * (shared + 2 * shared))


@pytest.mark.parametrize("tied", [False, True])
def test_zero3_hides_all_but_one_unit_of_its_gathers_and_scatters(tied):
    """ZeRO-3 prefetches each unit's gather and retires each reduce-scatter behind the next
    unit: of a microbatch's unit traffic (two gathers, one reduce-scatter per unit) all but one
    unit's share, 1/U, is hidden."""
    config, m, cluster = preset("tiny").replace(tie_embeddings=tied), 2, _fast_calls(4)
    precision = training_precision("bf16")
    units = [-(-sum(p.numel() for p in params) // 4) * 4
             for _, params in transformer_units(Transformer(config))]
    traffic = sum(2 * call_time(cluster, "all_gather", 4, unit * 2)
                  + call_time(cluster, "reduce_scatter", 4, unit * 2) for unit in units)
    layout = TrainLayout(dp=4, zero=3, micro_batch=MICRO, grad_accum=m)
    assert _hidden(config, layout, cluster, precision) == pytest.approx(
        m * traffic * (1 - 1 / len(units)))


def test_a_pipeline_hides_no_gradient_reduction():
    """DDP's buckets overlap backward only without a pipeline (the last stage's backward would
    not cover the first's); ZeRO-1 reduces after the step: nothing hidden."""
    config, cluster = preset("tiny").replace(num_layers=4), _fast_calls(4)
    for layout in (TrainLayout(dp=2, pp=2, microbatches=2, micro_batch=MICRO),
                   TrainLayout(dp=4, zero=1, micro_batch=MICRO)):
        assert _hidden(config, layout, cluster) == 0
