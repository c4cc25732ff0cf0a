"""Collective costs, per-strategy communication volumes, the pipeline bubble (the schedule
simulator's) and the trainer's prediction API."""

from __future__ import annotations

import pytest

from tetrad.spec.model import ParallelConfig
from tetrad.hardware.catalog import GB
from tetrad.hardware.profile import cluster
from tetrad.planner import comm, predict_training
from tetrad.planner.model_stats import count_parameters
from tetrad.planner.timeline import (bubble_fraction_of_step, closed_form_in_flight,
                                     closed_form_makespan, overlapped,
                                     pipeline_bubble_ratio, pipeline_in_flight)
from tetrad.spec.presets import preset
from tetrad.schedules import Durations, build_schedule, peak_in_flight, simulate


def test_bubble_closed_forms():
    assert pipeline_bubble_ratio("1f1b", 8, 32) == pytest.approx(7 / 32)
    assert pipeline_bubble_ratio("gpipe", 8, 32) == pytest.approx(7 / 32)
    assert pipeline_bubble_ratio("interleaved", 8, 32, vpp=4) == pytest.approx(7 / 128)
    assert pipeline_bubble_ratio("zb", 8, 32) == pytest.approx(7 / 96)
    assert pipeline_bubble_ratio("1f1b", 1, 32) == 0
    assert bubble_fraction_of_step(7 / 32) == pytest.approx(7 / 39)


SHAPES = [(name, pp, 1, m) for name in ("gpipe", "1f1b", "zb") for pp in (2, 4)
          for m in (1, 3, 4, 8)]
SHAPES += [("interleaved", pp, vpp, m) for pp in (2, 4) for vpp in (2, 3) for m in (pp, 3 * pp)]


@pytest.mark.parametrize("name,pp,vpp,m", SHAPES)
def test_planner_bubble_and_in_flight_are_the_simulated_ones(name, pp, vpp, m):
    schedule = build_schedule(name, pp, m, vpp)  # the executor's schedule, sends and receives
    timeline = simulate(schedule, Durations(forward=1, backward=2))
    ratio = pipeline_bubble_ratio(name, pp, m, vpp, forward=1, backward=2)
    assert bubble_fraction_of_step(ratio) == pytest.approx(timeline.bubble_fraction)
    held = peak_in_flight(schedule, release="W" if name == "zb" else "B")
    assert pipeline_in_flight(name, pp, m, vpp) == tuple(peak / vpp for peak in held)


def test_closed_forms_equal_the_simulation():
    """What lets the planner skip the simulation: the same makespan and in-flight peaks, for
    durations with W <= F and W <= B - W (the planner simulates ZB-H1 for any other)."""
    durations = [(1, 1, 1), (1, 2, 1), (8, 13, 6), (5, 3, 2), (2, 7, 1), (32, 33, 32)]
    for name, vpp in (("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2),
                      ("interleaved", 3)):
        for pp in (2, 3, 5, 8):
            for m in range(pp if vpp > 1 else 1, 3 * pp + 2, pp if vpp > 1 else 1):
                order = build_schedule(name, pp, m, vpp, communication=False)
                held = peak_in_flight(order, release="W" if name == "zb" else "B")
                assert closed_form_in_flight(name, pp, m, vpp) == tuple(p / vpp for p in held)
                for f, b, w in durations:
                    w = w if name == "zb" else 0
                    timed = Durations(f, b + w, b, w) if w else Durations(f, b)
                    assert closed_form_makespan(name, pp, m, vpp, f, b, w) == \
                        simulate(order, timed).makespan, (name, pp, m, vpp, f, b, w)


def test_interleaved_and_zero_bubble_rank_below_1f1b():
    # The zero-bubble paper's 1:1:1, and planner-like times (W, the forward's matmuls, is less
    # than half the backward: attention's backward and any recomputation are input gradient).
    for forward, backward, weight in ((1, 2, 1), (1.0, 2.6, 0.8)):
        one_f_one_b = pipeline_bubble_ratio("1f1b", 8, 32, 1, forward, backward, weight)
        assert pipeline_bubble_ratio("interleaved", 8, 32, 2, forward, backward) < one_f_one_b
        assert pipeline_bubble_ratio("zb", 8, 32, 1, forward, backward, weight) < one_f_one_b
    bubble = {}
    for schedule, vpp in (("1f1b", 1), ("interleaved", 2), ("zb", 1)):
        parallel = ParallelConfig(pp=4, schedule=schedule, vpp=vpp, microbatches=8)
        bubble[schedule] = predict_training(
            preset("llama3-8b"), parallel, micro_batch=1, seq_len=4096, dtype="bf16",
            gpu="h100-sxm")["step_time_s"]["bubble"]
    assert bubble["interleaved"] < bubble["1f1b"] and bubble["zb"] < bubble["1f1b"]


def test_ring_all_reduce_inside_a_node():
    world = cluster("h100-sxm", 8)
    profile = world.gpu.efficiency
    group = comm.place_group(world, 8, 1)
    assert group.intra_node
    size = 1 * GB
    expected = (2 * 7 * profile.intra_latency_s
                + 2 * 7 / 8 * size / (450 * GB * profile.intra_link))
    assert comm.all_reduce_time(world, group, size) == pytest.approx(expected)
    assert comm.all_gather_time(world, group, size) == pytest.approx(
        7 * profile.intra_latency_s + 7 / 8 * size / (450 * GB * profile.intra_link))


def test_groups_across_nodes_use_every_nic():
    world = cluster("a100-80gb", 64)
    profile = world.gpu.efficiency
    # A data-parallel group behind tp = 8 has one rank per node: one NIC carries the ring.
    one_per_node = comm.place_group(world, 8, 8)
    assert (one_per_node.members_per_node, one_per_node.num_nodes) == (1, 8)
    assert comm.bus_bandwidth(world, one_per_node) == pytest.approx(25 * GB * profile.inter_link)
    # All 64 GPUs: eight rings, one per rail, capped by NVLink.
    everyone = comm.place_group(world, 64, 1)
    assert comm.bus_bandwidth(world, everyone) == pytest.approx(
        min(300 * GB * profile.intra_link, 8 * 25 * GB * profile.inter_link))


def test_sent_bytes_of_ring_algorithms():
    assert comm.sent_bytes("all_reduce", 4, 100.0) == pytest.approx(150.0)
    assert comm.sent_bytes("reduce_scatter", 4, 100.0) == pytest.approx(75.0)
    assert comm.sent_bytes("all_to_all", 4, 100.0) == pytest.approx(75.0)
    assert comm.sent_bytes("p2p", 2, 100.0) == 100.0


def _predict(parallel, **kwargs):
    defaults = dict(micro_batch=2, seq_len=128, num_microbatches=1, dtype="bf16",
                    runtime="megatron")  # the published volumes, not tetrad's eager runtime
    return predict_training(preset("small"), parallel, **{**defaults, **kwargs})


def test_data_parallel_volumes_by_zero_stage():
    n = count_parameters(preset("small"))
    d = 4
    grads = 2 * n  # bf16
    zero0 = _predict(ParallelConfig(dp=d))["comm_bytes"]
    assert zero0["all_reduce"] == pytest.approx(2 * (d - 1) / d * grads)
    zero1 = _predict(ParallelConfig(dp=d, zero=1))["comm_bytes"]
    assert zero1["reduce_scatter"] + zero1["all_gather"] == pytest.approx(zero0["all_reduce"])
    zero3 = _predict(ParallelConfig(dp=d, zero=3))["comm_bytes"]
    total3 = zero3["reduce_scatter"] + zero3["all_gather"]
    assert total3 == pytest.approx(1.5 * zero0["all_reduce"])  # ZeRO paper, section 7.2.2


def test_tensor_parallel_volume():
    config = preset("small")
    t, b, s, m = 2, 2, 128, 3
    predicted = _predict(ParallelConfig(tp=t), num_microbatches=m)["comm_bytes"]
    size = b * s * config.hidden_size * 2
    # 2 all-reduces per block forward and 2 backward, 2 around head and embedding.
    collectives = (4 * config.num_layers + 2) * m
    assert predicted["all_reduce"] == pytest.approx(collectives * 2 * (t - 1) / t * size)
    sp = _predict(ParallelConfig(tp=t, sequence_parallel=True), num_microbatches=m)
    assert sp["comm_bytes"]["all_gather"] + sp["comm_bytes"]["reduce_scatter"] == \
        pytest.approx(predicted["all_reduce"])
    full = _predict(ParallelConfig(tp=t, recompute="full"), num_microbatches=m)["comm_bytes"]
    assert full["all_reduce"] == pytest.approx(
        (6 * config.num_layers + 2) * m * 2 * (t - 1) / t * size)


def test_pipeline_sends_one_message_per_microbatch_and_boundary():
    config = preset("small")
    m = 4
    size = 2 * 128 * config.hidden_size * 2
    # Two stages: each rank has one neighbour, and sends activations or gradients to it.
    assert _predict(ParallelConfig(pp=2), num_microbatches=m)["comm_bytes"]["p2p"] == \
        pytest.approx(m * size)


def test_prediction_api_shape():
    result = _predict(ParallelConfig(dp=2, pp=2, zero=1), num_microbatches=4, gpu="a100-80gb")
    assert set(result["bytes"]) == {"params", "grads", "optimizer", "activations_peak"}
    assert set(result["comm_bytes"]) == set(comm.COLLECTIVES)
    parts = result["step_time_s"]
    assert parts["total"] > 0 and result["hardware"] == "a100-80gb"
    assert parts["total"] == pytest.approx(parts["compute"] + parts["communication_exposed"]
                                           + parts["bubble"])
    assert _predict(ParallelConfig())["step_time_s"] is None
    assert result["num_parameters"] == count_parameters(preset("small"))


def test_overlapped_collectives_slow_the_compute_they_hide_behind():
    """A collective behind compute slows it by comm_interference of its own length (the SMs
    its kernels take from the GEMMs); one longer than the slowed compute sets the step."""
    assert overlapped(2.0, 5.0, True) == 0.0
    assert overlapped(2.0, 5.0, True, 0.25) == pytest.approx(0.5)  # compute 5 -> 5.5
    assert overlapped(4.8, 5.0, True, 0.25) == pytest.approx(1.2)  # compute 5 -> 6.2
    assert overlapped(8.0, 5.0, True, 0.25) == pytest.approx(3.0)  # the collective sets 8
    assert overlapped(7.0, 5.0, False, 0.25) == 7.0


@pytest.mark.parametrize("zero", range(4))
def test_data_parallel_calls_per_step_with_several_microbatches(zero):
    """ZeRO 0/1 reduce once per step; ZeRO-2 reduce-scatters each microbatch's gradients; ZeRO-3
    also gathers the parameters for each microbatch's forward and again for its backward."""
    n, d, m = count_parameters(preset("small")), 4, 3
    grads = params = 2 * n  # bf16
    result = _predict(ParallelConfig(dp=d, zero=zero), num_microbatches=m)
    expected = {0: {"all_reduce": 1}, 1: {"reduce_scatter": 1, "all_gather": 1},
                2: {"reduce_scatter": m, "all_gather": 1},
                3: {"reduce_scatter": m, "all_gather": 2 * m}}[zero]
    assert result["comm_calls"] == {kind: expected.get(kind, 0) for kind in comm.COLLECTIVES}
    sizes = {"all_reduce": grads, "reduce_scatter": grads, "all_gather": params}
    for kind, calls in expected.items():
        assert result["comm_payload_bytes"][kind] == pytest.approx(calls * sizes[kind])
        share = 2 * (d - 1) / d if kind == "all_reduce" else (d - 1) / d
        assert result["comm_bytes"][kind] == pytest.approx(calls * share * sizes[kind])


@pytest.mark.parametrize("schedule, pp, vpp, m", [("1f1b", 3, 1, 6), ("gpipe", 2, 1, 4),
                                                  ("interleaved", 3, 2, 6)])
def test_each_pipeline_stage_sends_from_every_chunk_but_the_model_ends(schedule, pp, vpp, m):
    """Counted chunk by chunk: a chunk sends its activations on unless it is the model's last, and
    its input gradient back unless it is the model's first; once per microbatch each."""
    config = preset("small")
    parallel = ParallelConfig(pp=pp, vpp=vpp, schedule=schedule)
    size = 2 * 128 * config.hidden_size * 2
    last = pp * vpp - 1
    sends = [m * sum((chunk < last) + (chunk > 0) for chunk in range(rank, last + 1, pp))
             for rank in range(pp)]
    stages = _predict(parallel, num_microbatches=m, runtime="tetrad")["stages"]
    assert [stage["comm_calls"]["p2p"] for stage in stages] == sends
    assert [stage["comm_payload_bytes"]["p2p"] for stage in stages] == \
        pytest.approx([count * size for count in sends])
    megatron = _predict(parallel, num_microbatches=m)
    assert megatron["comm_calls"]["p2p"] == sends[megatron["fullest_stage"]]
    assert megatron["comm_payload_bytes"]["p2p"] == \
        pytest.approx(sends[megatron["fullest_stage"]] * size)


def test_groups_partly_inside_a_node_and_their_latency():
    world = cluster("a100-80gb", 64)  # 8 GPUs and 8 NICs of 25 GB/s per node
    profile = world.gpu.efficiency
    assert comm.place_group(world, 4, 2) == comm.Group(4, 4, 1)  # 8 GPUs: one node
    two_per_node = comm.place_group(world, 8, 4)
    assert two_per_node == comm.Group(8, 2, 4)
    assert comm.bus_bandwidth(world, two_per_node) == pytest.approx(
        2 * 25 * GB * profile.inter_link)
    # A ring step per member inside each node, a tree across 4 nodes (2 log2 4 steps).
    size = 1 * GB
    assert comm.all_reduce_time(world, two_per_node, size) == pytest.approx(
        2 * 1 * profile.intra_latency_s + 4 * profile.inter_latency_s
        + 2 * 7 / 8 * size / (2 * 25 * GB * profile.inter_link))
    # Reduce-scatter has no tree in NCCL: one ring of 7 steps, 3 of them between the 4 nodes.
    assert comm.reduce_scatter_time(world, two_per_node, size) == pytest.approx(
        4 * profile.intra_latency_s + 3 * profile.inter_latency_s
        + 7 / 8 * size / (2 * 25 * GB * profile.inter_link))
    assert comm.all_reduce_time(world, comm.Group(1, 1, 1), size) == 0
    assert comm.all_gather_time(world, two_per_node, 0) == 0


def test_all_to_all_sends_off_node_shares_over_the_nic():
    world = cluster("a100-80gb", 16)
    profile = world.gpu.efficiency
    local = 1 * GB
    inside = comm.place_group(world, 8, 1)
    assert comm.all_to_all_time(world, inside, local) == pytest.approx(
        profile.intra_latency_s + 7 / 8 * local / (300 * GB * profile.intra_link))
    # 16 ranks on two nodes: 7/16 of the local bytes stay on NVLink, 8/16 cross one NIC.
    across = comm.place_group(world, 16, 1)
    assert comm.all_to_all_time(world, across, local) == pytest.approx(
        profile.intra_latency_s + profile.inter_latency_s
        + max(7 / 16 * local / (300 * GB * profile.intra_link),
              8 / 16 * local / (25 * GB * profile.inter_link)))


def test_point_to_point_within_and_across_nodes():
    world = cluster("a100-80gb", 16)
    profile = world.gpu.efficiency
    size = 1 * GB
    assert comm.p2p_time(world, False, size) == pytest.approx(
        profile.intra_latency_s + size / (300 * GB * profile.intra_link))
    assert comm.p2p_time(world, True, size) == pytest.approx(
        profile.inter_latency_s + size / (25 * GB * profile.inter_link))
    assert comm.p2p_time(world, True, 0) == 0
    assert comm.sent_bytes("all_gather", 1, size) == 0


def test_per_microbatch_collectives_are_counted_per_step():
    """Tensor- and context-parallel collectives run in every microbatch: calls, like bytes, are
    per step. Ring attention passes K/V around cp - 1 times forward, and K/V and dK/dV again
    backward, in every layer."""
    config, b, s, m = preset("small"), 2, 128, 3
    t, c = 2, 4
    tp = _predict(ParallelConfig(tp=t), num_microbatches=m)
    size = b * s * config.hidden_size * 2
    assert tp["comm_calls"]["all_reduce"] == (4 * config.num_layers + 2) * m
    assert tp["comm_payload_bytes"]["all_reduce"] == pytest.approx(
        tp["comm_calls"]["all_reduce"] * size)
    cp = _predict(ParallelConfig(cp=c), num_microbatches=m)
    chunk = b * s / c * config.num_kv_heads * 2 * config.head_dim * 2  # this rank's K and V
    calls = 3 * (c - 1) * config.num_layers * m
    assert cp["comm_calls"]["p2p"] == calls
    assert cp["comm_payload_bytes"]["p2p"] == pytest.approx(calls * chunk)
