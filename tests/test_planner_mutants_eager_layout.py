"""What each rank of a layout holds and sends, in the eager profile, against tetrad's runtime
modules built in this process without their peers: the parameters of a pipeline rank's stages
and of a tensor-parallel rank's shards (and which of their gradients tp sums), ZeRO-3's units
and the data-parallel buckets as the engines cut them, and the schedule's microbatches in flight
(1F1B: pp - rank, GPipe: all of them, Narayanan et al. 2021)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from test_eager_time import _NothingArrives

from tetrad.memory import ActivationMeter
from tetrad.models.transformer import Transformer
from tetrad.parallel.context_parallel import apply_context_parallel
from tetrad.parallel.data_parallel import bucket_params
from tetrad.parallel.fsdp import stage_units, transformer_units
from tetrad.parallel.mesh import Group
from tetrad.parallel.pipeline.stage import PipelineStage
from tetrad.parallel.tensor_parallel import TensorParallelSplit
from tetrad.parallel.tp_operators import TensorParallel
from tetrad.planner.eager import pipeline_ranks
from tetrad.planner.eager_activations import activations_peak, stage_bytes
from tetrad.planner.eager_comm import rank_comm
from tetrad.planner.eager_params import rank_parameters
from tetrad.planner.eager_state import model_state
from tetrad.planner.layout import TrainLayout
from tetrad.planner.precision import training_precision
from tetrad.spec.presets import preset

FOUR_LAYERS = {
    "llama": preset("tiny").replace(num_layers=4),
    "gpt2": preset("tiny").replace(num_layers=4, norm="layernorm", bias=True,
                                   position="learned", mlp="gelu", tie_embeddings=True),
    "tied": preset("tiny").replace(num_layers=4, tie_embeddings=True),
}
TP_MODELS = {
    "llama": preset("tiny"),
    "gpt2": FOUR_LAYERS["gpt2"].replace(num_layers=2),
    "qwen-one-kv-head": preset("tiny").replace(qkv_bias=True, num_kv_heads=1),
    "moe": preset("tiny-moe"),
}
# (pp, vpp, blocks per stage): uneven cuts, and interleaving (stage s on rank s % pp).
PIPELINES = [(2, 1, (1, 3)), (3, 1, (1, 2, 1)), (2, 2, (1, 1, 1, 1))]
# DDP's and ZeRO's buckets: torch DDP's caps (bucket_cap_mb=25; the first bucket 1 MiB).
BUCKET_BYTES, FIRST_BUCKET_BYTES = 25 * 2**20, 2**20
BF16, FP32 = training_precision("bf16"), training_precision("fp32")


def _padded(elements: int, group: int) -> int:
    return -(-elements // group) * group


def _pipeline_stages(config, pp: int, vpp: int, cut: tuple[int, ...], pp_rank: int):
    """The PipelineStage modules pipeline rank `pp_rank` builds, the model they share."""
    model = Transformer(config)
    starts = [sum(cut[:stage]) for stage in range(len(cut))]
    return model, [PipelineStage(model, stage, pp * vpp, range(starts[stage],
                                                               starts[stage] + cut[stage]))
                   for stage in range(pp_rank, pp * vpp, pp)]


@pytest.mark.parametrize("pp, vpp, cut", PIPELINES)
@pytest.mark.parametrize("name", FOUR_LAYERS)
def test_pipeline_rank_holds_its_stages_parameters_in_registration_order(name, pp, vpp, cut):
    """Each stage's embedding (and a tied one's copy on the last stage), its blocks, final norm
    and head, tensor by tensor as the stages register them; the tied copies marked."""
    config = FOUR_LAYERS[name]
    layout = TrainLayout(pp=pp, vpp=vpp, stage_layers=cut, microbatches=4,
                         schedule="interleaved" if vpp > 1 else "1f1b")
    for pp_rank in range(pp):
        model, stages = _pipeline_stages(config, pp, vpp, cut, pp_rank)
        planned = rank_parameters(config, layout, pp_rank)
        held = [p for stage in stages for p in stage.parameters()]
        assert [p.elements for p in planned] == [p.numel() for p in held]
        assert [p.tied for p in planned] == [p is model.embed.weight and config.tie_embeddings
                                            for p in held]
        assert [p.stage for p in planned] == [stage.index for stage in stages
                                              for _ in stage.parameters()]


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", TP_MODELS)
def test_tensor_parallel_rank_holds_its_shards_and_sums_the_partial_gradients(
        name, tp, sequence_parallel):
    """Every tp rank's tensors as TensorParallelSplit leaves them, and the elements of each
    gradient tp sums: a sequence-parallel replica's whole, the union of rows that several ranks
    hold (kv heads fewer than tp)."""
    config = TP_MODELS[name]
    planned = rank_parameters(config, TrainLayout(tp=tp, sequence_parallel=sequence_parallel),
                              0)
    for index in range(tp):
        model = Transformer(config)
        split = TensorParallelSplit(model, TensorParallel(Group("tp", tuple(range(tp)), index),
                                                          None, sequence_parallel))
        partial = {id(p): p.numel() for p in split.partial_params}
        for param, rows, _, union in split.shared_rows:
            partial[id(param)] = union * param.numel() // param.shape[0]
        held = list(model.parameters())
        assert [p.elements for p in planned] == [p.numel() for p in held]
        assert [p.partial for p in planned] == [partial.get(id(p), 0) for p in held]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_each_stage_keeps_what_the_meter_counts_on_its_forward(name):
    """A stage's saved tensors for one microbatch, as the meter counts its forward: the first
    stage's copy of the token ids (the executor's microbatch), a later stage's received hidden
    states, the last stage's head and loss."""
    config, cut = FOUR_LAYERS[name], (1, 2, 1)
    layout = TrainLayout(pp=3, stage_layers=cut, microbatches=4, micro_batch=2)
    rows = torch.randint(0, config.vocab_size, (2, 17))
    for pp_rank in range(3):
        _, (stage,) = _pipeline_stages(config, 3, 1, cut, pp_rank)
        meter = ActivationMeter(stage)
        inputs = (rows[:, :-1].clone() if stage.is_first
                  else torch.randn(2, 16, config.hidden_size, requires_grad=True))
        with meter.measure():
            out = stage(inputs)
            if stage.is_last:
                F.cross_entropy(out.float().flatten(0, 1), rows[:, 1:].flatten())
        assert stage_bytes(config, layout, pp_rank, 16, FP32) == meter.finish_microbatch()


@pytest.mark.parametrize("microbatches", [2, 5])
def test_pipeline_ranks_hold_the_microbatches_their_schedule_has_in_flight(microbatches):
    """1F1B: rank r holds min(pp - r, m) microbatches at its peak; GPipe all m."""
    config, cut = FOUR_LAYERS["llama"], (1, 2, 1)
    for schedule, in_flight in (("1f1b", lambda r: min(3 - r, microbatches)),
                                ("gpipe", lambda r: microbatches)):
        layout = TrainLayout(pp=3, stage_layers=cut, microbatches=microbatches,
                             schedule=schedule)
        for pp_rank in range(3):
            assert activations_peak(config, layout, 16, FP32, pp_rank) == (
                in_flight(pp_rank) * stage_bytes(config, layout, pp_rank, 16, FP32))


def _sharded_calls(layout: TrainLayout, config, precision) -> Counter:
    calls = Counter()
    for pp_rank in range(layout.pp):
        for (kind, size, nbytes), count in rank_comm(config, layout, 16, precision,
                                                     pp_rank).calls.items():
            if kind in ("all_gather", "reduce_scatter") and size == layout.zero_group:
                calls[kind, nbytes] += count
    return calls


@pytest.mark.parametrize("group", [2, 3])
@pytest.mark.parametrize("name", FOUR_LAYERS)
def test_zero3_gathers_and_reduces_every_unit_the_runtime_cuts(name, group):
    """ZeRO-3 without a pipeline: FSDP's units (transformer_units: a tied embedding's root unit
    first), each padded to the group, gathered for forward and again for backward and
    reduce-scattered, every microbatch; the state is the ZeRO paper's 16 bytes per parameter
    over N (bf16 parameters and gradients, fp32 master and moments) with tetrad's fp32 gradient
    shard, plus the gathered root and a unit with the next one prefetched."""
    config = FOUR_LAYERS[name]
    layout = TrainLayout(dp=group, zero=3, grad_accum=3)
    units = [_padded(sum(p.numel() for p in params), group)
             for _, params in transformer_units(Transformer(config))]
    expected = Counter()
    for unit in units:
        expected["all_gather", unit * 2] += 2 * 3
        expected["reduce_scatter", unit * 2] += 3
    assert _sharded_calls(layout, config, BF16) == expected
    state = model_state(config, layout, BF16, 0)
    shard = sum(units) // group
    assert (state.params - state.params_gathered, state.grads, state.optimizer) == (
        2 * shard, (2 + 4) * shard, (4 + 8) * shard)
    root = units[0] if config.tie_embeddings else 0
    in_turn = units[1:] if config.tie_embeddings else units
    assert state.params_gathered == 2 * (root + max(a + b for a, b in zip(in_turn,
                                                                          in_turn[1:])))


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
@pytest.mark.parametrize("name", FOUR_LAYERS)
def test_zero3_under_a_pipeline_gathers_each_stage_unit(name, schedule):
    """Each stage's units (stage_units: a tied copy the last stage's root), gathered per
    microbatch for forward and backward, and under zero bubble a third time for W on every
    stage but the first; reduce-scattered once per microbatch."""
    config, cut = FOUR_LAYERS[name], (1, 3)
    layout = TrainLayout(dp=2, zero=3, pp=2, stage_layers=cut, microbatches=4,
                         schedule=schedule)
    expected = Counter()
    for pp_rank in range(2):
        _, (stage,) = _pipeline_stages(config, 2, 1, cut, pp_rank)
        gathers = 3 if schedule == "zb" and pp_rank > 0 else 2
        for _, params in stage_units(stage):
            unit = _padded(sum(p.numel() for p in params), 2)
            expected["all_gather", unit * 2] += gathers * 4
            expected["reduce_scatter", unit * 2] += 4
    assert _sharded_calls(layout, config, BF16) == expected


def _large_model():
    """Several 25 MiB buckets of fp32 parameters, built without memory (meta tensors)."""
    config = preset("tiny").replace(hidden_size=512, ffn_hidden_size=1408, num_layers=8,
                                    num_heads=8, num_kv_heads=4, vocab_size=1001)
    with torch.device("meta"):
        return config, list(Transformer(config).parameters())


@pytest.mark.parametrize("zero, offload", [(0, False), (1, False), (2, False), (1, True)])
def test_data_parallel_buckets_are_the_runtimes(zero, offload):
    """DDP all-reduces the runtime's buckets (reverse registration order, the first small);
    ZeRO-1/2 reduce-scatter them padded to the group (ZeRO-2 every microbatch) and gather the
    parameters after the step; the state is the ZeRO paper's (ZeRO-1: whole 16-bit parameters
    and gradients, the fp32 master and moments over N; ZeRO-2 the gradients over N too) with
    tetrad's fp32 gradient shard, on the host with offload."""
    config, params = _large_model()
    group, precision = 3, BF16 if zero else FP32
    layout = TrainLayout(dp=group, zero=zero, offload=offload, grad_accum=2)
    calls = rank_comm(config, layout, 16, precision, 0).calls
    if zero == 0:
        buckets = bucket_params(params, BUCKET_BYTES, FIRST_BUCKET_BYTES)
        expected = Counter(("all_reduce", group, sum(p.numel() for p in bucket) * 4)
                           for bucket in buckets)
        assert len(buckets) > 2
        assert Counter({call: count for call, count in calls.items()
                        if call[0] == "all_reduce" and call[1] == group and call[2] > 8}
                       ) == expected
        return
    flats = [_padded(sum(p.numel() for p in bucket), group)
             for bucket in bucket_params(params, BUCKET_BYTES)]
    assert len(flats) > 2
    expected = Counter()
    for flat in flats:
        expected["reduce_scatter", flat * 2] += 2 if zero == 2 else 1
        expected["all_gather", flat * 2] += 1
    assert _sharded_calls(layout, config, precision) == expected
    state = model_state(config, layout, precision, 0)
    flat, shard = sum(flats), sum(flats) // group
    grads = 2 * (flat if zero == 1 else shard)
    assert (state.params, state.params_gathered) == (2 * flat, 0)
    if offload:
        assert (state.grads, state.optimizer, state.host_grads, state.host_optimizer) == (
            grads, 0, 4 * shard, (4 + 8) * shard)
    else:
        assert (state.grads, state.optimizer) == (grads + 4 * shard, (4 + 8) * shard)


@pytest.mark.parametrize("zero", [1, 3])
def test_experts_keep_their_own_fp32_adamw_beside_zero(zero):
    """Under expert parallelism a rank's experts (E / ep of them) stay out of ZeRO: fp32
    parameters and gradients and torch AdamW's two moments and step count per tensor, added to
    what ZeRO shards of the rest."""
    config, ep = preset("tiny-moe"), 2
    model = Transformer(config)
    experts = [p for name, p in model.named_parameters() if ".experts." in name]
    elements, tensors = sum(p.numel() for p in experts) // ep, len(experts) // ep
    with_experts = model_state(config, TrainLayout(dp=2, ep=ep, zero=zero), BF16, 0)
    without = model_state(config, TrainLayout(dp=2, zero=zero), BF16, 0)
    replicated = [p for p in model.parameters() if not any(p is e for e in experts)]
    shard_elements = sum(p.numel() for p in replicated) / 2
    assert with_experts.optimizer == pytest.approx(
        (4 + 8) * shard_elements + 8 * elements + 4 * tensors, rel=1e-3)
    # Without ep the experts' bf16 gradients are whole (ZeRO-1) or a shard (ZeRO-3), beside
    # an fp32 shard; with it their fp32 gradients of the rank's experts.
    every = sum(p.numel() for p in experts)
    sharded = (2 * every if zero == 1 else 2 * every / 2) + 4 * every / 2
    assert with_experts.grads - without.grads == pytest.approx(4 * elements - sharded,
                                                               rel=1e-3)


def test_a_ranks_total_is_its_state_and_activations():
    """What a rank holds at its peak: parameters, gradients, optimizer state and activations."""
    config = FOUR_LAYERS["gpt2"]
    layout = TrainLayout(pp=2, dp=2, zero=1, stage_layers=(1, 3), microbatches=3)
    for pp_rank, rank in enumerate(pipeline_ranks(config, layout, 16, BF16)):
        state = model_state(config, layout, BF16, pp_rank)
        assert rank.total == (state.params + state.grads + state.optimizer
                              + activations_peak(config, layout, 16, BF16, pp_rank))
        assert rank.comm.calls == rank_comm(config, layout, 16, BF16, pp_rank).calls


class _NoPeers(_NothingArrives):
    """The ring's exchange and the routers' mean over cp without peers (values unchanged)."""

    def all_reduce(self, tensor, group, tag=None):
        return self


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", ["llama", "gpt2", "moe"])
def test_context_parallel_rank_keeps_what_the_meter_counts(name, cp):
    """A cp rank's share of the sequence through ring attention (its log-sum-exp and the
    output's copy in token order), its positions and rotary tables, its copy of the ids, the
    routers over its tokens: the meter's count on the last cp rank's forward."""
    config = {**FOUR_LAYERS, "moe": preset("tiny-moe")}[name]
    model = Transformer(config)
    context = apply_context_parallel(model, Group("cp", tuple(range(cp)), cp - 1), _NoPeers())
    inputs, targets, positions = context.shard(torch.randint(0, config.vocab_size, (2, 33)))
    meter = ActivationMeter(model)
    with meter.measure():
        logits = model(inputs, positions=positions)
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    assert stage_bytes(config, TrainLayout(cp=cp, micro_batch=2), 0, 32, FP32) == (
        meter.finish_microbatch())
