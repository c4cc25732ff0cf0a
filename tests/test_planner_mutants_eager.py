"""The eager model's byte and call counts against independent references on one process: the
activation meter's storages on a real forward, torch's parameters, gradients and AdamW state,
the weights' shapes in 128x128 blocks, and the tensor-parallel calls of one block counted by
hand. Fast in-process checks for what tests/test_report*.py compares in slow spawns."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from tetrad.hardware.catalog import Cluster, gpu
from tetrad.hardware.profile import cluster
from tetrad.memory import ActivationMeter
from tetrad.models.transformer import Transformer
from tetrad.planner.comm import CommLedger, call_time
from tetrad.planner.eager import pipeline_ranks
from tetrad.planner.eager_activations import stage_bytes
from tetrad.planner.eager_comm import SCALAR as SCALAR_BYTES, tensor_parallel_block
from tetrad.planner.eager_overlap import hidden_communication
from tetrad.planner.eager_params import block_params, rank_parameters
from tetrad.planner.eager_state import model_state
from tetrad.planner.eager_time import rank_time
from tetrad.planner.layout import TrainLayout
from tetrad.planner.precision import FP8_BLOCK, training_precision
from tetrad.spec.presets import preset

VARIANTS = {
    "llama": {},
    "layernorm": {"norm": "layernorm"},
    "gelu": {"mlp": "gelu"},
    "gpt2": {"norm": "layernorm", "bias": True, "position": "learned", "mlp": "gelu",
             "tie_embeddings": True},
}
FP32 = training_precision("fp32")


def _trained_once(config):
    """A model after one AdamW step on a small batch, with that batch's saved-activation bytes."""
    torch.manual_seed(0)
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters())
    rows = torch.randint(0, config.vocab_size, (2, 17))
    meter = ActivationMeter(model)
    with meter.measure():
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
    saved = meter.finish_microbatch()
    loss.backward()
    optimizer.step()
    return model, optimizer, saved


@pytest.mark.parametrize("name", VARIANTS)
def test_saved_activations_are_what_the_meter_counts(name):
    """Every block's norms, MLP outputs and attention tensors, plus the ids and the loss: the
    bytes autograd keeps for backward on one process, storage by storage."""
    config = preset("tiny").replace(**VARIANTS[name])
    _, _, saved = _trained_once(config)
    assert stage_bytes(config, TrainLayout(micro_batch=2), 0, 16, FP32) == saved


@pytest.mark.parametrize("config", [preset("tiny"), preset("tiny-moe"),
                                    preset("tiny-moe").replace(router_score="sigmoid")],
                         ids=["dense", "moe", "moe-frozen-bias"])
def test_model_state_is_torch_parameters_gradients_and_adamw_state(config):
    """Parameters (a sigmoid router's frozen bias included), gradients (not for the frozen bias)
    and AdamW's moments and step counters, as torch holds them after one step."""
    model, optimizer, _ = _trained_once(config)
    state = model_state(config, TrainLayout(), FP32, 0)
    assert state.params == sum(p.nbytes for p in model.parameters())
    assert state.grads == sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    assert state.optimizer == sum(value.nbytes for slot in optimizer.state.values()
                                  for value in slot.values() if torch.is_tensor(value))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert bool(frozen) == (config.router_score == "sigmoid")


@pytest.mark.parametrize("config", [preset("tiny"), preset("small"), preset("tiny-moe")],
                         ids=["tiny", "small", "moe"])
def test_fp8_weight_blocks_cover_each_block_matmul_weight(config):
    """FP8 weights carry one scale per 128x128 block, a partial block at an edge included: the
    blocks of the block linears' weights (2-D, inside layers, but the router's gate) as torch
    shapes them."""
    model = Transformer(config)
    expected = sorted(math.ceil(weight.shape[0] / FP8_BLOCK)
                      * math.ceil(weight.shape[1] / FP8_BLOCK)
                      for name, weight in model.named_parameters()
                      if name.startswith("layers.") and weight.dim() == 2
                      and "router" not in name)
    planned = sorted(p.fp8_blocks for p in rank_parameters(config, TrainLayout(), 0)
                     if p.fp8_blocks)
    assert planned == expected
    assert any(size % FP8_BLOCK for p in model.parameters() for size in p.shape)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_block_calls_counted_by_hand(overlap, sequence_parallel):
    """A dense block has two column-parallel entries (f) and two row-parallel exits (g). Per
    microbatch: each forward exits twice; each backward enters twice; a recomputed forward
    stops before the MLP's closing g (one exit), but reruns both when overlap is on (the
    overlapped layer's saved tensors are packed after its g)."""
    microbatches, backwards, reruns = 3, 2, 2
    stream_bytes, activation_bytes = 1000.0, 3000.0
    ledger = CommLedger()
    layout = TrainLayout(tp=2, overlap=overlap, sequence_parallel=sequence_parallel,
                         recompute="full")
    tensor_parallel_block(ledger, preset("tiny"), layout, 0, stream_bytes, activation_bytes,
                          microbatches, backwards, reruns)
    exits = microbatches * (2 + reruns * (2 if overlap else 1))
    entries = microbatches * 2 * backwards
    if sequence_parallel:
        assert ledger.calls == {("reduce_scatter", 2, activation_bytes): exits,
                                ("all_gather", 2, activation_bytes): entries,
                                ("all_gather", 2, stream_bytes): microbatches * 2 * (1 + reruns),
                                ("reduce_scatter", 2, stream_bytes): entries}
    else:
        assert ledger.calls == {("all_reduce", 2, activation_bytes): exits,
                                ("all_reduce", 2, stream_bytes): entries}


def _cpu_bound_cluster(cores: int):
    """Two H100s per node whose profile measured `cores` concurrent ranks and a CPU cost per
    collective call: more ranks than cores makes the step CPU-bound."""
    base = gpu("h100-sxm")
    profile = dataclasses.replace(base.efficiency, concurrent_ranks=cores,
                                  call_cpu=((2, 1e-4), (4, 3e-4)), call_compute_s=2e-5)
    return Cluster(dataclasses.replace(base, efficiency=profile), 4, gpus_per_node=2)


def test_calls_among_fewer_ranks_than_cores_cost_their_whole_time():
    """Every collective of a tp 2 x pp 2 layout joins 2 ranks; with 2 cores or 3 each member
    already has a core, so a third core changes none of the calls' CPU time (a collective can
    use at most one core per member), while one core for 2 ranks halves each call's share: the
    difference is half of the rank's collectives as its ledger times them."""
    layout = TrainLayout(tp=2, pp=2, microbatches=2, schedule="1f1b")
    config = preset("tiny")

    def calls_cpu(cores: int) -> float:
        return rank_time(config, _cpu_bound_cluster(cores), layout, 16, FP32, True,
                         0).communication_cpu

    # Sends name one peer (group 1): a core each however few there are.
    calls = pipeline_ranks(config, layout, 16, FP32)[0].comm.calls
    assert {group for _, group, _ in calls} == {1, 2}
    calls_s = sum(count * call_time(_cpu_bound_cluster(1), *call)
                  for call, count in calls.items() if call[1] == 2)
    assert calls_cpu(3) == calls_cpu(2)
    assert calls_cpu(2) - calls_cpu(1) == pytest.approx(calls_s / 2)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ddp_buckets_hide_behind_a_long_backward_as_the_ledger_prices_them(dtype):
    """DDP's gradient all-reduces (the ledger's calls past the 8-byte scalars) overlap the
    backward bucket by bucket: with a backward forty times longer than them, all is hidden
    but one bucket's average share, the one that waits for the last gradient."""
    config, seq_len, precision = preset("small"), 2048, training_precision(dtype)
    layout, machines = TrainLayout(dp=2, micro_batch=8), cluster("h100-sxm", 2)
    calls = pipeline_ranks(config, layout, seq_len, precision)[0].comm.calls
    gradients = {call: count for call, count in calls.items() if call[2] > SCALAR_BYTES}
    reduce = sum(count * call_time(machines, *call) for call, count in gradients.items())
    assert len(gradients) > 1
    assert rank_time(config, machines, layout, seq_len, precision, True, 0).backward > 40 * reduce
    kernel_args = (layout.micro_batch, seq_len, 1, 1, 1, False, "none", True, False,
                   precision.compute_dtype, precision.activation_bytes, precision.param_bytes)
    hidden = hidden_communication(config, machines, layout, seq_len, precision, 0, kernel_args)
    assert hidden == pytest.approx(reduce * (1 - 1 / len(gradients)))


@pytest.mark.parametrize("tp, heads_held", [(1, 4 + 2 * 2), (2, 2 + 2 * 1), (4, 1 + 2 * 1)])
def test_tensor_parallel_rank_holds_its_query_heads_and_the_kv_head_they_read(tp, heads_held):
    """tiny: 4 query heads and 2 kv heads of 16 dims over a hidden size of 64. A tp rank holds
    4/tp query heads and, for k and v each, its share of the kv heads, or with more ranks than
    kv heads the one its query heads read (a copy the other ranks of its pair hold too)."""
    config = preset("tiny")
    qkv = next(p for p in block_params(config, TrainLayout(tp=tp), 0) if p.matmul)
    assert qkv.elements == heads_held * 16 * 64
    assert qkv.partial == (2 * 2 * 16 * 64 if tp > config.num_kv_heads else 0)
    if tp == 1:
        whole = Transformer(config).layers[0].attn.qkv.weight
        assert qkv.elements == whole.numel()
