"""The search's candidate set, the pipeline's node crossings, the bottleneck stage and the text
report, each against what the cluster's shape or the report's own rows imply."""

from __future__ import annotations

import pytest

from tetrad.hardware.profile import cluster
from tetrad.planner import comm
from tetrad.planner.comm import CommLedger
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import representative_stages
from tetrad.planner.report import training_json, training_text
from tetrad.planner.search import TrainSpace, search_training, training_layouts
from tetrad.planner.training import TrainWorkload, _bottleneck, _microbatch_comm, _pipeline_p2p
from tetrad.planner.compute import stage_times
from tetrad.spec.presets import preset

WORKLOAD = TrainWorkload(seq_len=2048)


def test_tensor_parallel_never_spans_nodes_and_fills_one():
    """tp groups stay inside a node (their collectives ride NVLink); a node's full width is a
    candidate, nothing wider, even where the GPU count divides by it."""
    machines = cluster("h100-sxm", 16, gpus_per_node=4)
    tps = {layout.tp for layout in training_layouts(preset("llama3-8b"), machines, 64, 2048,
                                                    TrainSpace())}
    assert max(tps) == machines.node_size == 4
    assert tps == {1, 2, 4}


def _p2p_seconds(gpus_per_node: int, cp: int) -> float:
    """Exposed send time of stage 0 of a tp 2 x (cp x dp = 2) x pp 2 layout on 8 GPUs."""
    layout = TrainLayout(tp=2, cp=cp, dp=2 // cp, pp=2, microbatches=4, micro_batch=1)
    return _pipeline_p2p(preset("llama3-8b"), cluster("h100-sxm", 8, gpus_per_node=gpus_per_node),
                         layout, WORKLOAD, 0, CommLedger())


@pytest.mark.parametrize("cp", [1, 2])
def test_pipeline_sends_cross_nodes_when_a_stage_fills_its_nodes(cp):
    """Ranks are laid out tp, cp, dp inner and pp outer: with tp*cp*dp = 4 GPUs per node, the
    next stage starts on the next node, exactly as when every GPU is its own node; only with
    all 8 GPUs in one node do the sends stay on NVLink (faster)."""
    own_node, one_per_node, shared_node = (_p2p_seconds(size, cp) for size in (4, 1, 8))
    assert own_node == one_per_node
    assert shared_node < own_node


def test_bottleneck_is_the_stage_slowest_with_its_exposed_communication():
    """Among every stage (not only the representative ones), none takes longer per microbatch
    than the stage the estimate is built on, counting compute, recomputation and exposed
    TP communication; and its exposed time is the one _microbatch_comm gives that stage."""
    config, machines = preset("llama3-8b"), cluster("h100-sxm", 16, gpus_per_node=8)
    workload = TrainWorkload(seq_len=2048, overlap_tp_comm=False)
    # Full recomputation: a large term every stage shares, which must count on both sides.
    tp, pp, recompute = 8, 2, "full"
    stage, kernels, exposed = _bottleneck(config, machines, workload, tp, pp, 1, 1, True,
                                          recompute, 1, 1, 0)
    shape = TrainLayout(tp=tp, pp=pp, dp=1, cp=1, sequence_parallel=True, recompute=recompute,
                        micro_batch=1)
    weight = workload.precision.param_bytes
    totals = {}
    for candidate in range(pp):
        times = stage_times(config, machines.gpu, pp, candidate, 1, 2048, tp, 1, 1, True,
                            recompute, workload.flash_attention, workload.dropout,
                            workload.precision.compute_dtype, workload.precision.activation_bytes,
                            weight, 1, workload.portable_attention, "inputs")
        hidden = _microbatch_comm(config, machines, shape, workload, times, candidate, None, 1)
        assert hidden > 0
        totals[candidate] = times.forward + times.backward + times.recompute + hidden
    assert stage in representative_stages(config.num_layers, pp)
    assert totals[stage] == max(totals.values())
    assert exposed == _microbatch_comm(config, machines, shape, workload, kernels, stage, None, 1)


def _search(space: TrainSpace):
    config, machines = preset("llama3-8b"), cluster("h100-sxm", 16)
    return config, machines, search_training(config, machines, WORKLOAD, 64, space, top=3)


def test_text_report_names_the_schedule_and_adds_days_only_for_a_token_budget():
    """A virtual-stage suffix only where there are virtual stages; the 'days' column only when
    a token budget was given (one value per row, as the JSON says)."""
    for vpp, suffix in ((1, ""), (2, "/v2")):
        space = TrainSpace(tp=4, pp=2, schedule="interleaved" if vpp > 1 else "1f1b", vpp=vpp,
                           micro_batch=1)
        config, machines, result = _search(space)
        text = training_text(config, machines, WORKLOAD, 64, result)
        header, _, first = text.splitlines()[3:6]
        assert header.split()[-1] == "MFU" and "days" not in header
        schedule = first.split()[header.split().index("schedule")]
        assert schedule == training_json(config, machines, WORKLOAD, 64, result)["configs"][0][
            "parallel"]["schedule"] + suffix
    budgeted = training_text(config, machines, WORKLOAD, 64, result, tokens=1e12)
    budget_header, _, budget_first = budgeted.splitlines()[3:6]
    assert budget_header.split() == header.split() + ["days"]
    assert budget_first.split()[:-1] == first.split()
