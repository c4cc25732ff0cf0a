"""The eager time model's operator counts are what PyTorch dispatches for tetrad's model code,
counted again here with the calibration's own dispatch counter, for every block variant."""

import pytest
import torch
import torch.nn.functional as F

from tetrad.calibrate.compute import OperatorCount
from tetrad.spec.model import ModelConfig
from tetrad.models.transformer import Transformer
from tetrad.planner.eager_time import block_operators, outer_operators
from tetrad.planner.layout import TrainLayout
from tetrad.spec.presets import preset

VARIANTS = {
    "llama": {},
    "layernorm": {"norm": "layernorm"},
    "gelu": {"mlp": "gelu"},
    "learned positions": {"position": "learned"},
    "gpt2": {"norm": "layernorm", "bias": True, "position": "learned", "mlp": "gelu",
             "tie_embeddings": True},
}


def dispatched(config: ModelConfig) -> tuple[int, int]:
    model = Transformer(config)
    tokens = torch.randint(0, config.vocab_size, (2, 17))
    with OperatorCount() as forward:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    with OperatorCount() as backward:
        loss.backward()
    return forward.count, backward.count


@pytest.mark.parametrize("name", VARIANTS)
def test_operator_counts_match_dispatch(name):
    config = preset("tiny").replace(**VARIANTS[name])
    block = block_operators(config, TrainLayout(), 0)
    outer = outer_operators(config, first=True, last=True)
    forward, backward = dispatched(config)
    assert forward == config.num_layers * block.forward + outer.forward
    assert backward == config.num_layers * block.backward + outer.backward


def test_full_recomputation_runs_the_forward_again():
    config = preset("tiny")
    plain = block_operators(config, TrainLayout(), 0)
    again = block_operators(config, TrainLayout(recompute="full"), 0)
    assert again.backward == plain.backward + plain.forward


def test_measured_step_scale_and_concurrent_slowdown_scale_compute():
    import dataclasses

    from tetrad.hardware.catalog import GPUS, Cluster
    from tetrad.planner.eager_time import eager_step_time
    from tetrad.planner.precision import training_precision

    base = GPUS["h100-sxm"]
    config, layout = preset("tiny"), TrainLayout(dp=2, micro_batch=2)
    precision = training_precision("fp32")

    def step(**fields):
        gpu = dataclasses.replace(base, efficiency=dataclasses.replace(base.efficiency,
                                                                        **fields))
        return eager_step_time(config, Cluster(gpu, 2, 2), layout, 64, precision)

    plain = step()
    assert step(step_scale=2.0).compute == pytest.approx(2 * plain.compute)
    shared = step(concurrent_slowdown=((2, 1.5), (4, 3.0)), concurrent_ranks=2)
    assert shared.compute == pytest.approx(1.5 * plain.compute)
    assert shared.communication_exposed == plain.communication_exposed
    # A measured wait per collective call: the step's calls (gradient buckets) each pay it.
    calls = (step(sync_wait=((2, 1e-3),)).communication_exposed
             - plain.communication_exposed) / 1e-3
    assert calls >= 1 and calls == pytest.approx(round(calls))


def test_beyond_the_cores_a_waiting_call_costs_the_back_to_back_wait():
    """With more ranks than cores, the compute a call's peers do first is in the step's demand
    bound: each waiting call pays what such calls cost back to back, not sync_wait."""
    import dataclasses

    from tetrad.hardware.catalog import GPUS, Cluster
    from tetrad.planner.eager_comm import waiting_calls
    from tetrad.planner.eager_time import eager_step_time
    from tetrad.planner.precision import training_precision

    base = GPUS["h100-sxm"]
    config, layout = preset("tiny"), TrainLayout(dp=4, micro_batch=1)
    precision = training_precision("fp32")

    def exposed(cores, **waits):
        gpu = dataclasses.replace(base, efficiency=dataclasses.replace(
            base.efficiency, concurrent_ranks=cores, **waits))
        return eager_step_time(config, Cluster(gpu, 4, 4), layout, 64,
                               precision).communication_exposed

    calls = waiting_calls(config, layout, 64, precision, 0)
    waits = dict(sync_wait=((4, 1e-3),), sync_wait_back_to_back=((4, 1e-4),))
    for cores, wait in ((2, 1e-4), (4, 1e-3)):
        assert exposed(cores, **waits) - exposed(cores) == pytest.approx(calls * wait)


def test_beyond_the_cores_with_call_cpu_measured_the_step_is_the_ranks_cpu_time_over_the_cores():
    """dp4 on 2 cores: no call waits (sync_wait_back_to_back no longer matters); every call issued
    adds call_cpu and call_compute_s of CPU time on each of the 4 ranks, so the step grows by 4/2
    of it per call; a collective fitted over 4 ranks on 2 cores gave each rank half its time."""
    import dataclasses

    from tetrad.hardware.catalog import GPUS, Cluster
    from tetrad.planner.eager import pipeline_ranks
    from tetrad.planner.eager_comm import overlapped_calls, queued_calls, waiting_calls
    from tetrad.planner.eager_time import eager_step_time
    from tetrad.planner.precision import training_precision

    base = GPUS["h100-sxm"]
    config, layout = preset("tiny"), TrainLayout(dp=4, micro_batch=1)
    precision = training_precision("fp32")
    fit = ("all_reduce", 4, 1e-3, 1e-9)

    def step(**fields):
        fields = {"concurrent_ranks": 2, "concurrent_slowdown": ((2, 1.0), (4, 2.0)),
                  "collectives": (fit,), "call_cpu": ((4, 1e-3),), **fields}
        gpu = dataclasses.replace(base, efficiency=dataclasses.replace(base.efficiency,
                                                                        **fields))
        return eager_step_time(config, Cluster(gpu, 4, 4), layout, 64, precision)

    issued = (waiting_calls(config, layout, 64, precision, 0)
              + queued_calls(config, layout, 64, precision, 0)
              + overlapped_calls(config, layout, precision, 0))
    plain = step()
    assert issued >= 1 and plain.bubble == 0.0
    assert step(sync_wait_back_to_back=((4, 5e-3),)).total == pytest.approx(plain.total)
    assert step(call_cpu=((4, 3e-3),)).total - plain.total == pytest.approx(issued * 2e-3 * 2)
    assert step(call_compute_s=1e-3).total - plain.total == pytest.approx(issued * 1e-3 * 2)
    all_reduces = sum(count for (kind, size, _), count in pipeline_ranks(
        config, layout, 64, precision)[0].comm.calls.items() if kind == "all_reduce")
    slower = step(collectives=(("all_reduce", 4, 2e-3, 1e-9),))
    assert slower.total - plain.total == pytest.approx(all_reduces * 1e-3 * (2 / 4) * (4 / 2))
    # Without call_cpu the waits price the calls, as before.
    assert step(call_cpu=()).total != pytest.approx(plain.total)


def test_each_waiting_call_adds_its_compute_outside_the_wait():
    """call_compute_s is rank time outside the waits: the compute grows by it once per waiting
    call (tp2 waits between its blocks), unscaled by the slowdown it was measured under, and
    the exposed communication stays what the waits are."""
    import dataclasses

    from tetrad.hardware.catalog import GPUS, Cluster
    from tetrad.planner.eager_comm import waiting_calls
    from tetrad.planner.eager_time import eager_step_time
    from tetrad.planner.precision import training_precision

    base = GPUS["h100-sxm"]
    config, layout = preset("tiny"), TrainLayout(tp=2, micro_batch=2)
    precision = training_precision("fp32")

    def step(**fields):
        gpu = dataclasses.replace(base, efficiency=dataclasses.replace(
            base.efficiency, concurrent_ranks=2, concurrent_slowdown=((2, 1.5),), **fields))
        return eager_step_time(config, Cluster(gpu, 2, 2), layout, 64, precision)

    calls = waiting_calls(config, layout, 64, precision, 0)
    plain, paid = step(), step(call_compute_s=1e-3)
    assert calls > 10
    assert paid.compute - plain.compute == pytest.approx(calls * 1e-3)
    assert paid.communication_exposed == plain.communication_exposed


def test_calls_right_behind_another_do_not_wait_again():
    """The step's closing burst (gradient reduction, norms, losses) waits for its peers once;
    ZeRO-1/2 wait once more for the gather after the optimizer; every tensor-parallel call
    sits between computations and waits each time."""
    from tetrad.planner.comm import CommLedger
    from tetrad.planner.eager_comm import _activations, rank_comm, waiting_calls
    from tetrad.planner.precision import training_precision

    config, precision = preset("tiny"), training_precision("fp32")

    def calls(layout):
        return (sum(rank_comm(config, layout, 32, precision, 0).calls.values()),
                waiting_calls(config, layout, 32, precision, 0))

    # The runtime's calls (one DDP bucket for this model; DDP's replicas need no norm call).
    total, waiting = calls(TrainLayout(dp=2, micro_batch=2))
    assert total == 2 and waiting == 1  # gradients, loss: one burst
    total, waiting = calls(TrainLayout(dp=2, zero=1, micro_batch=2))
    assert total == 4 and waiting == 2  # reduce-scatter, loss, norm; the gather
    tp = TrainLayout(tp=2, micro_batch=2)
    during = CommLedger()
    _activations(during, config, tp, 32, precision, 0)
    total, waiting = calls(tp)
    # Its closing burst is the gradient norm's one call.
    assert waiting == sum(during.calls.values()) + 1 == total


def split_backward_dispatched(config: ModelConfig, blocks: int) -> tuple[int, int]:
    """(whole backward, B + W) operators of a middle pipeline stage of `blocks` blocks, run as
    tetrad's executor runs zero bubble where W walks again (ZeRO-3, recomputation): B by
    autograd.grad for the stage input with the graph retained, W by a backward from the outputs
    into the stage's parameters (split_backward.DeferredWeights with every parameter off the
    captured paths). The whole backward also accumulates the input's gradient (one operator)
    where the executor's B hands it on."""
    from tetrad.parallel.pipeline.split_backward import DeferredWeights

    from tetrad.parallel.pipeline.stage import PipelineStage

    layers = config.num_layers
    stage = PipelineStage(Transformer(config), 1, 3, range(layers - blocks, layers))
    x = torch.randn(2, 16, config.hidden_size, requires_grad=True)
    grad = torch.randn(2, 16, config.hidden_size)
    out = stage(x)
    with OperatorCount() as whole:
        out.backward(grad)
    out = stage(x)
    with OperatorCount() as b:
        torch.autograd.grad([out], [x], [grad], retain_graph=True)
    params = [p for p in stage.parameters() if p.requires_grad]
    with OperatorCount() as w:
        DeferredWeights([], [out], [grad], params, params).run()
    return whole.count, b.count + w.count


@pytest.mark.parametrize("name", VARIANTS)
def test_split_backward_operators_match_dispatch(name):
    """Where zero bubble's W walks a stage's graph again (ZeRO-3 here), what it adds to the
    stage's backward operators is what PyTorch dispatches for B and W beyond one whole backward;
    without ZeRO-3 or recomputation W shares B's walk and adds none."""
    from tetrad.planner.eager_time import split_backward_operators

    config = preset("tiny").replace(num_layers=4, **VARIANTS[name])
    layout = TrainLayout(pp=3, dp=2, zero=3, schedule="zb", stage_layers=(1, 2, 1),
                         micro_batch=2)
    one_walk = TrainLayout(pp=3, schedule="zb", stage_layers=(1, 2, 1), micro_batch=2)
    assert split_backward_operators(config, one_walk, 1) == 0
    whole, split = split_backward_dispatched(config, 2)
    blocks = sum(block_operators(config, layout, layer).backward for layer in (1, 2))
    assert whole == blocks + 1
    assert split == blocks + split_backward_operators(config, layout, 1)
    assert split_backward_operators(config, layout, 0) == 0  # B computes nothing: W does all
    one_f_one_b = TrainLayout(pp=3, schedule="1f1b", stage_layers=(1, 2, 1), micro_batch=2)
    assert split_backward_operators(config, one_f_one_b, 1) == 0


def test_zero_bubble_walks_the_later_stages_backward_twice():
    """Under ZeRO-3 a split backward costs a later stage the backward's kernels and operators
    again, less the weight-gradient matmuls B leaves to W; the first stage's backward is one
    walk, and so is every stage's without ZeRO-3 or recomputation."""
    from tetrad.hardware.catalog import GPUS, Cluster
    from tetrad.planner.compute import layer_times
    from tetrad.planner.eager_time import rank_time
    from tetrad.planner.precision import training_precision

    gpu, config = GPUS["h100-sxm"], preset("tiny").replace(num_layers=4)
    precision = training_precision("fp32")

    def backward(schedule, pp_rank, zero=3):
        layout = TrainLayout(pp=2, dp=2, zero=zero, schedule=schedule, micro_batch=2,
                             microbatches=4)
        return rank_time(config, Cluster(gpu, 2, 2), layout, 32, precision, True,
                         pp_rank).backward

    assert backward("zb", 0) == pytest.approx(backward("1f1b", 0))
    assert backward("zb", 1, zero=0) == pytest.approx(backward("1f1b", 1, zero=0))
    kernels = layer_times(config, gpu, 3, 2, 32, 1, 1, 1, False, "none", True, False, "fp32",
                          4, 4, portable_attention=True)
    again = kernels.backward - kernels.matmul_forward
    assert again > 0
    assert backward("zb", 1) - backward("1f1b", 1) > 2 * again  # two blocks and the head


def test_sequence_parallel_all_gathers_wait_as_calls_back_to_back():
    """Under sequence parallelism each all-gather comes right behind a reduce-scatter, a norm
    and a residual add apart: it pays the back-to-back wait, the reduce-scatters sync_wait."""
    import dataclasses

    from tetrad.hardware.catalog import GPUS, Cluster
    from tetrad.planner.comm import CommLedger
    from tetrad.planner.eager_comm import _activations, queued_calls, waiting_calls
    from tetrad.planner.eager_time import eager_step_time
    from tetrad.planner.precision import training_precision

    base, config = GPUS["h100-sxm"], preset("tiny")
    precision = training_precision("fp32")
    sp = TrainLayout(tp=2, sequence_parallel=True, micro_batch=2)
    during = CommLedger()
    _activations(during, config, sp, 32, precision, 0)
    gathers = sum(count for (kind, _, _), count in during.calls.items() if kind == "all_gather")
    assert gathers > 0 and queued_calls(config, sp, 32, precision, 0) == gathers
    waiting = waiting_calls(config, sp, 32, precision, 0)
    assert waiting + gathers == sum(during.calls.values()) + 1  # and the closing burst's one
    assert queued_calls(config, TrainLayout(tp=2, micro_batch=2), 32, precision, 0) == 0

    def exposed(**waits):
        gpu = dataclasses.replace(base, efficiency=dataclasses.replace(
            base.efficiency, concurrent_ranks=2, **waits))
        return eager_step_time(config, Cluster(gpu, 2, 2), sp, 32, precision
                               ).communication_exposed

    plain = exposed()
    assert exposed(sync_wait=((2, 1e-3),)) - plain == pytest.approx(waiting * 1e-3)
    assert exposed(sync_wait_back_to_back=((2, 1e-3),)) - plain == pytest.approx(gathers * 1e-3)


def test_ranks_that_fill_the_cores_hide_no_communication():
    """DDP's buckets overlap the backward where a spare core moves the bytes; with as many
    ranks as cores gloo moves them with the cores that compute, and every call counts whole."""
    import dataclasses

    from tetrad.hardware.catalog import GPUS, Cluster
    from tetrad.planner.comm import ledger_time
    from tetrad.planner.eager_comm import rank_comm
    from tetrad.planner.eager_time import rank_time
    from tetrad.planner.precision import training_precision

    base = GPUS["h100-sxm"]
    # Large enough for two buckets: the first is reduced while backward goes on.
    config = preset("tiny").replace(num_layers=4, hidden_size=128, ffn_hidden_size=352)
    layout, precision = TrainLayout(dp=2, micro_batch=2), training_precision("fp32")

    def communication(cores):
        gpu = dataclasses.replace(base, efficiency=dataclasses.replace(
            base.efficiency, concurrent_ranks=cores))
        cluster = Cluster(gpu, 2, 2)
        whole = ledger_time(cluster, rank_comm(config, layout, 64, precision, 0))
        return rank_time(config, cluster, layout, 64, precision, True, 0).communication, whole

    spare, whole = communication(4)
    assert spare < whole
    assert communication(2) == (pytest.approx(whole), whole)


def test_zero3_waits_only_for_the_first_gather_of_each_pass():
    """ZeRO-3 gathers a unit while the one before computes and retires each reduce-scatter
    behind the next unit's backward: per microbatch the forward's and the backward's first
    gathers wait, the other per-unit calls do not, and every one of them costs call_compute."""
    import dataclasses

    from tetrad.hardware.catalog import GPUS, Cluster
    from tetrad.planner.eager_comm import overlapped_calls, rank_comm, waiting_calls
    from tetrad.planner.eager_time import eager_step_time
    from tetrad.planner.precision import training_precision

    base, config = GPUS["h100-sxm"], preset("tiny")
    precision = training_precision("fp32")
    layout = TrainLayout(dp=2, zero=3, micro_batch=2)
    sharded = sum(count for (kind, _, _), count in
                  rank_comm(config, layout, 32, precision, 0).calls.items()
                  if kind in ("all_gather", "reduce_scatter"))
    waiting = waiting_calls(config, layout, 32, precision, 0)
    overlapped = overlapped_calls(config, layout, precision, 0)
    assert waiting == 2 + 1  # each pass's first gather, and the step's closing burst
    assert overlapped == sharded - 3 > 0

    def step(**fields):
        gpu = dataclasses.replace(base, efficiency=dataclasses.replace(
            base.efficiency, concurrent_ranks=2, **fields))
        return eager_step_time(config, Cluster(gpu, 2, 2), layout, 32, precision)

    plain = step()
    assert step(sync_wait=((2, 1e-3),)).communication_exposed - plain.communication_exposed \
        == pytest.approx(waiting * 1e-3)
    assert step(call_compute_s=1e-3).compute - plain.compute == pytest.approx(
        (waiting + overlapped) * 1e-3)


class _NothingArrives:
    """The ring's exchange without peers: the ring's own operators run, no collective's."""

    def exchange(self, outgoing, dst, incoming, src, group, tag):
        return self

    def wait(self) -> None:
        pass


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_attention_operators_match_dispatch(cp):
    """Context parallelism's blocks as the last cp rank dispatches them (the ring's blocks of
    scores, their merges and the dK/dV accumulators), counted as the time model counts them."""
    from tetrad.parallel.context_parallel import apply_context_parallel
    from tetrad.parallel.mesh import Group

    config = preset("tiny")
    model = Transformer(config)
    context = apply_context_parallel(model, Group("cp", tuple(range(cp)), cp - 1),
                                     _NothingArrives())
    inputs, targets, positions = context.shard(torch.randint(0, config.vocab_size, (2, 33)))
    with OperatorCount() as forward:
        logits = model(inputs, positions=positions)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    with OperatorCount() as backward:
        loss.backward()
    block = block_operators(config, TrainLayout(cp=cp), 0)
    outer = outer_operators(config, first=True, last=True)
    assert forward.count == config.num_layers * block.forward + outer.forward
    assert backward.count == config.num_layers * block.backward + outer.backward
