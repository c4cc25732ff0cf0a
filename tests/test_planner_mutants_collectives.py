"""Collective times of the planner against a step-by-step ring and against where a group's ranks
really sit: groups placed by listing their members' ranks, ring collectives inside a node timed
step by step (each step one latency plus its chunk over the link), across nodes by the
rail-optimized bandwidth and a tree's latency (all-reduce) or a ring's (reduce-scatter, all-gather),
and the byte ledger against its own definition."""

from __future__ import annotations

import math

import pytest

from tetrad.hardware.catalog import Cluster
from tetrad.hardware.catalog import gpu as catalog_gpu
from tetrad.planner import comm

H100 = catalog_gpu("h100-sxm")
CLUSTER = Cluster(H100, 64, gpus_per_node=8)
PROFILE = H100.efficiency
INTRA = CLUSTER.intra_bandwidth * PROFILE.intra_link
NIC = CLUSTER.inter_bandwidth * PROFILE.inter_link


def _members(size, stride, node):
    """Node of each member of a group of `size` ranks `stride` apart."""
    return [rank * stride // node for rank in range(size)]


@pytest.mark.parametrize("size", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("stride", [1, 2, 4, 8, 16])
def test_a_group_lands_where_its_ranks_are(size, stride):
    if size * stride > CLUSTER.num_gpus:
        return
    nodes = _members(size, stride, CLUSTER.node_size)
    group = comm.place_group(CLUSTER, size, stride)
    assert group.size == size
    assert group.num_nodes == len(set(nodes))
    assert group.members_per_node == max(nodes.count(node) for node in set(nodes))
    assert group.intra_node == (len(set(nodes)) == 1)


def _ring(steps, chunk, step_latency, bandwidth):
    """A ring collective run step by step: every step sends one chunk to the next rank."""
    total = 0.0
    for _ in range(steps):
        total += step_latency + chunk / bandwidth
    return total


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("size_bytes", [1e3, 3e8])
def test_ring_collectives_inside_a_node_step_by_step(n, size_bytes):
    group = comm.place_group(CLUSTER, n, 1)
    step = PROFILE.intra_latency_s
    # All-reduce: n - 1 reduce-scatter steps then n - 1 all-gather steps, each of S/n bytes.
    assert comm.all_reduce_time(CLUSTER, group, size_bytes) == pytest.approx(
        _ring(2 * (n - 1), size_bytes / n, step, INTRA))
    assert comm.all_gather_time(CLUSTER, group, size_bytes) == pytest.approx(
        _ring(n - 1, size_bytes / n, step, INTRA))
    assert comm.reduce_scatter_time(CLUSTER, group, size_bytes) == \
        comm.all_gather_time(CLUSTER, group, size_bytes)
    for collective in (comm.all_reduce_time, comm.all_gather_time, comm.all_to_all_time):
        assert collective(CLUSTER, group, 0) == 0
        assert collective(CLUSTER, comm.place_group(CLUSTER, 1, 1), size_bytes) == 0
    # All-to-all: each rank keeps 1/n and sends the rest in one hop over NVLink.
    assert comm.all_to_all_time(CLUSTER, group, size_bytes) == pytest.approx(
        step + (n - 1) / n * size_bytes / INTRA)


@pytest.mark.parametrize("size,stride", [(16, 1), (32, 1), (64, 1), (8, 8), (16, 4), (4, 16)])
def test_collectives_across_nodes_use_a_nic_per_member_and_a_tree_or_ring(size, stride):
    group = comm.place_group(CLUSTER, size, stride)
    per_node, nodes = group.members_per_node, group.num_nodes
    bandwidth = min(INTRA, per_node * NIC) if per_node > 1 else NIC
    assert comm.bus_bandwidth(CLUSTER, group) == pytest.approx(bandwidth)
    tree = 2 * math.ceil(math.log2(nodes)) * PROFILE.inter_latency_s
    for ring_steps in (1, 2):
        assert comm.latency(CLUSTER, group, ring_steps) == pytest.approx(
            ring_steps * (per_node - 1) * PROFILE.intra_latency_s + tree)
    s = 5e8
    assert comm.all_reduce_time(CLUSTER, group, s) == pytest.approx(
        comm.latency(CLUSTER, group, 2) + 2 * (size - 1) / size * s / bandwidth)
    # NCCL's all-gather is a ring only: size - 1 steps, nodes - 1 of them over the network.
    ring = (size - nodes) * PROFILE.intra_latency_s + (nodes - 1) * PROFILE.inter_latency_s
    assert comm.all_gather_time(CLUSTER, group, s) == pytest.approx(
        ring + (size - 1) / size * s / bandwidth)
    # All-to-all: the members of this node over NVLink, the others over the NIC, side by side.
    on_node = (per_node - 1) / size * s / INTRA
    off_node = (size - per_node) / size * s / NIC
    assert comm.all_to_all_time(CLUSTER, group, s) == pytest.approx(
        PROFILE.intra_latency_s + PROFILE.inter_latency_s + max(on_node, off_node))


def test_point_to_point_is_one_hop_of_the_whole_message():
    for crosses, hop, bandwidth in ((False, PROFILE.intra_latency_s, INTRA),
                                    (True, PROFILE.inter_latency_s, NIC)):
        assert comm.p2p_time(CLUSTER, crosses, 4e6) == pytest.approx(hop + 4e6 / bandwidth)
        assert comm.p2p_time(CLUSTER, crosses, 0) == 0


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_bytes_sent_by_one_rank_of_each_ring(n):
    """Counted per step: all-reduce 2(n-1) steps of S/n, gather and scatter n-1 steps, all-to-all
    the n-1 shares for the others, point-to-point the whole message."""
    s = 1200.0
    assert comm.sent_bytes("all_reduce", n, s) == pytest.approx(2 * (n - 1) * s / n)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert comm.sent_bytes(kind, n, s) == pytest.approx((n - 1) * s / n)
    assert comm.sent_bytes("p2p", n, s) == s


def test_the_ledger_adds_calls_sent_bytes_and_payloads():
    ledger = comm.CommLedger()
    ledger.add("all_reduce", 4, 100.0, 3)
    ledger.add("all_reduce", 4, 100.0)
    ledger.add("all_gather", 2, 60.0, 2)
    ledger.add("p2p", 1, 10.0, 5)  # a send has one peer: counted
    ledger.add("all_reduce", 1, 100.0)  # nothing to reduce with
    ledger.add("all_gather", 2, 0.0)
    ledger.add("all_to_all", 4, 50.0, 0)
    assert ledger.calls == {("all_reduce", 4, 100.0): 4, ("all_gather", 2, 60.0): 2,
                            ("p2p", 1, 10.0): 5}
    assert ledger.payload["all_reduce"] == 400 and ledger.payload["all_gather"] == 120
    assert ledger.sent["all_reduce"] == pytest.approx(4 * 2 * 3 / 4 * 100)
    assert ledger.sent["all_gather"] == pytest.approx(2 * 60 / 2)
    assert ledger.sent["p2p"] == 50 and ledger.sent["all_to_all"] == 0
    calls = ledger.calls_by_kind()
    assert (calls["all_reduce"], calls["all_gather"], calls["p2p"], calls["broadcast"]) == \
        (4, 2, 5, 0)
    assert comm.ledger_time(CLUSTER, ledger) == pytest.approx(
        4 * comm.call_time(CLUSTER, "all_reduce", 4, 100.0)
        + 2 * comm.call_time(CLUSTER, "all_gather", 2, 60.0)
        + 5 * comm.call_time(CLUSTER, "p2p", 1, 10.0))


def test_a_call_without_a_measured_fit_is_timed_among_neighbours():
    neighbours = comm.place_group(CLUSTER, 4, 1)
    assert comm.call_time(CLUSTER, "all_reduce", 4, 1e6) == \
        comm.all_reduce_time(CLUSTER, neighbours, 1e6)
    assert comm.call_time(CLUSTER, "all_to_all", 4, 1e6) == \
        comm.all_to_all_time(CLUSTER, neighbours, 1e6)
    for kind in ("all_gather", "reduce_scatter", "broadcast"):
        assert comm.call_time(CLUSTER, kind, 4, 1e6) == \
            comm.all_gather_time(CLUSTER, neighbours, 1e6)
    assert comm.call_time(CLUSTER, "p2p", 2, 1e6) == comm.p2p_time(CLUSTER, False, 1e6)
