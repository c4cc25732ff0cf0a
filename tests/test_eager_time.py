"""The eager time model's operator counts are what PyTorch dispatches for tetrad's model code,
counted again here with the calibration's own dispatch counter, for every block variant."""

import pytest
import torch
import torch.nn.functional as F

from tetrad.calibrate.compute import OperatorCount
from tetrad.config import ModelConfig
from tetrad.models.transformer import Transformer
from tetrad.planner.eager_time import block_operators, outer_operators
from tetrad.planner.layout import TrainLayout
from tetrad.presets import preset

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

    from tetrad.hardware import GPUS, Cluster
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

    from tetrad.hardware import GPUS, Cluster
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


def test_each_waiting_call_adds_its_compute_outside_the_wait():
    """call_compute_s is rank time outside the waits: the compute grows by it once per waiting
    call (tp2 waits between its blocks), unscaled by the slowdown it was measured under, and
    the exposed communication stays what the waits are."""
    import dataclasses

    from tetrad.hardware import GPUS, Cluster
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
