"""The runtime's rules the planner prices (tetrad.spec.runtime_rules), checked on what the runtime
really builds: the trainer's strategy constructed in this process on a mesh of one rank's groups
(a pipeline rank's stages built without their peers; dp 1, so nothing is exchanged), its engine's
buckets and units set against the planner's for the same layout; the byte counter's count of each
collective against the planner's ledger; FP8's scales as the runtime quantizes each block linear.
The planner's side is always the rank's tensors as tetrad.planner.eager_params lists them, so a
change to either side's registration order, bucketing, padding or placement fails here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tetrad.models.fp8 import quantize_blocks
from tetrad.models.fp8_layers import FP8Linear, convert_to_fp8
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.mesh import Group, Mesh
from tetrad.parallel.tp_overlap import row_chunks
from tetrad.parallel.zero_optimizer import FlatShard
from tetrad.planner.comm import CommLedger
from tetrad.planner.eager_overlap import TP_OVERLAP_CHUNKS
from tetrad.planner.eager_params import Param, rank_parameters, rank_stages
from tetrad.planner.eager_state import reduced_together, zero3_units, zero_buckets
from tetrad.planner.layout import TrainLayout
from tetrad.spec.layout import GROUP_NAMES
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.spec.presets import preset
from tetrad.train.metrics import zero_per_comm_kind
from tetrad.train.strategy import MeshStrategy

CPU = torch.device("cpu")
# Big enough for several of DDP's and ZeRO's 25 MiB buckets (about 75 MB of fp32 parameters).
MANY_BUCKETS = dataclasses.replace(preset("small"), name="buckets", hidden_size=512,
                                   num_layers=6, ffn_hidden_size=1408)
MODELS = {
    "buckets": MANY_BUCKETS,
    "gpt2": dataclasses.replace(preset("tiny"), norm="layernorm", bias=True, position="learned",
                                mlp="gelu", tie_embeddings=True, num_layers=4),
    "moe": dataclasses.replace(preset("tiny-moe"), router_score="sigmoid",
                               router_bias_update_rate=1e-3),
}
LAYOUTS = [dict(), dict(pp=2), dict(pp=2, vpp=2, schedule="interleaved", microbatches=2)]


def one_rank_mesh(dims: ParallelConfig, rank: int) -> Mesh:
    """Rank `rank`'s groups of `dims` without process groups: enough to build its strategy while
    its groups of more than one rank (the pipeline's) are not asked to talk."""
    groups = {name: Group(name, tuple(ranks), ranks.index(rank))
              for name in GROUP_NAMES for ranks in dims.group_ranks(name) if rank in ranks}
    return Mesh(dims, rank, groups)


def built_strategy(model_name: str, parallel: ParallelConfig, pp_rank: int) -> MeshStrategy:
    config = TrainConfig(model=model_name, batch_size=2, seq_len=16, parallel=parallel)
    torch.manual_seed(0)
    return MeshStrategy(Transformer(MODELS[model_name]), config, CPU,
                        one_rank_mesh(parallel, pp_rank), Comm())


def planned_replicated(model_name: str, layout: TrainLayout, pp_rank: int) -> list[Param]:
    """The tensors the planner says the data-parallel engine of this rank takes."""
    return [p for p in rank_parameters(MODELS[model_name], layout, pp_rank)
            if not p.expert and not p.frozen]


def runtime_reductions(engine) -> list[int]:
    """Elements of each reduction the engine built: DDP's buckets, ZeRO-1/2's flat buckets."""
    if hasattr(engine, "buckets"):
        return [sum(p.numel() for p in bucket) for bucket in engine.buckets]
    return [shard.numel for shard in engine.shards]


CASES = [(model, zero, layout, pp_rank) for model in MODELS for zero in (0, 1, 2, 3)
         for layout in LAYOUTS for pp_rank in range(layout.get("pp", 1))
         if model == "gpt2" or layout.get("vpp", 1) == 1]


@pytest.mark.parametrize("model_name,zero,degrees,pp_rank", CASES,
                         ids=[f"{m}-zero{z}-pp{d.get('pp', 1)}x{d.get('vpp', 1)}-rank{r}"
                              for m, z, d, r in CASES])
def test_the_engine_builds_the_buckets_and_units_the_planner_prices(model_name, zero, degrees,
                                                                    pp_rank):
    """DDP's buckets (the first small), ZeRO-1's one run of buckets, ZeRO-2's per stage with a
    tied embedding's copy alone, ZeRO-3's units in forward order with their stages, and the
    stages a pipeline rank runs: each reduction's elements, in the order the engine issues
    them."""
    parallel = ParallelConfig(zero=zero, **degrees)
    strategy = built_strategy(model_name, parallel, pp_rank)
    layout = TrainLayout.of(parallel, 1)
    planned = planned_replicated(model_name, layout, pp_rank)
    engine = strategy.engine
    if zero == 3:
        runtime = [(unit.stage, unit.shard.numel) for unit in engine.units]
        assert runtime == [(stage, numel) for stage, units in zero3_units(planned, 1).items()
                           for numel in units.all]
    elif zero == 0:
        assert runtime_reductions(engine) == [sum(p.elements for p in bucket)
                                              for bucket in reduced_together(planned, layout)]
    else:
        assert runtime_reductions(engine) == zero_buckets(planned, layout)
    pipeline = strategy.parallel.pipeline
    if pipeline is not None:
        assert tuple(sorted(pipeline.stages)) == rank_stages(layout, pp_rank)
    if model_name == "buckets" and zero < 3:  # several buckets: their order is checked too
        assert len(runtime_reductions(engine)) > 1


@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize("group", [3, 7])
def test_flat_buffers_are_padded_to_the_group_as_the_planner_pads_them(zero, group):
    """The runtime's buckets (ZeRO-1) and units (ZeRO-3) laid out over `group` data-parallel
    ranks (FlatShard, which every ZeRO engine builds them with) against the planner's padded
    sizes for dp = `group`: the same rank's tensors, so only the padding can differ."""
    strategy = built_strategy("gpt2", ParallelConfig(zero=zero), 0)
    ranks = Group("dp_cp", tuple(range(group)), 0)
    runtime = [FlatShard.build([(name, 0.0, p) for name, p in zip(shard.names, shard.params)],
                               ranks).numel for shard in strategy.engine.shards]
    layout = TrainLayout.of(ParallelConfig(dp=group, zero=zero), 1)
    planned = planned_replicated("gpt2", layout, 0)
    if zero == 3:
        assert runtime == [numel for units in zero3_units(planned, group).values()
                           for numel in units.all]
    else:
        assert runtime == zero_buckets(planned, layout)
    assert any(numel % group == 0 and numel != sum(p.numel() for p in shard.params)
               for numel, shard in zip(runtime, strategy.engine.shards))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_the_byte_counter_counts_what_the_ledger_predicts(size):
    """Every collective kind the counter knows, on a tensor whose bytes do not divide by the
    group: what the runtime's counter records for one call is what the planner's ledger says
    one rank sends, and the run report has a field for each."""
    counter = CommCounter()
    ledger = CommLedger()
    group = Group("dp", tuple(range(size)), 0)
    nbytes = 1001
    kinds = [kind for kind in zero_per_comm_kind() if kind != "p2p"]
    for kind in kinds:
        Comm(counter)._count(kind, nbytes, group, "grads")
        ledger.add(kind, size, nbytes)
    totals = counter.totals()
    assert set(ledger.sent) == set(totals) == set(zero_per_comm_kind())
    for kind in kinds:
        assert ledger.sent[kind] == pytest.approx(float(totals[kind]), rel=1e-12), kind
    assert (totals["all_reduce"] > totals["all_gather"]) == (size > 1)


def test_tensor_parallel_overlap_cuts_collectives_into_the_chunks_the_planner_prices():
    """Any microbatch of at least as many rows as chunks: the runtime's chunk count is the
    planner's."""
    for rows in (TP_OVERLAP_CHUNKS, 128, 4097):
        assert len(row_chunks(rows)) == TP_OVERLAP_CHUNKS


@pytest.mark.parametrize("model_name", ["gpt2", "moe"])
def test_fp8_scales_are_the_blocks_the_planner_counts(model_name):
    """The scales the runtime keeps for each FP8 linear's weight (quantize_blocks on the swapped
    layers) against the planner's blocks per tensor, an edge block included."""
    model = convert_to_fp8(Transformer(MODELS[model_name]))
    runtime = sorted(quantize_blocks(module.weight.detach())[1].numel()
                     for module in model.modules() if isinstance(module, FP8Linear))
    planned = sorted(p.fp8_blocks for p in rank_parameters(MODELS[model_name], TrainLayout(), 0)
                     if p.fp8_blocks)
    assert runtime == planned
    assert any(size % 128 for module in model.modules() if isinstance(module, FP8Linear)
               for size in module.weight.shape)
