"""Collectives under the alpha-beta model on a two-level topology, and where each group lands.

time = latency + bytes / bandwidth. A group of `size` ranks whose members sit `stride` apart in the
rank grid (tp innermost) stays inside one node when size * stride fits in it; otherwise it spans
nodes with `members_per_node` of its ranks in each. NCCL then runs one ring per member of a node,
each crossing nodes on its own NIC (rail-optimized fabric), so the ring's bus bandwidth is
min(NVLink, members_per_node * NIC). Latency, as NCCL's own tuning model counts it
(src/graph/tuning.cc, ncclTopoTuneModel): an all-reduce runs a tree across nodes at scale, a
ring step per rank inside the node and 2 log2 of the node count steps across; reduce-scatter and
all-gather have no tree algorithm in NCCL (ring, or NVLS inside a node), so their ring takes
n - 1 steps, of which the node count minus one cross the network and the rest stay inside a node.

Bytes *sent* per rank (for the run report's comm_bytes) follow the ring algorithms, by the share
the runtime's byte counter counts (tetrad.spec.runtime_rules.ring_share): all-reduce 2(n-1)/n * S,
reduce-scatter and all-gather (n-1)/n * S of the full tensor, all-to-all (n-1)/n of what the rank
holds, point-to-point the whole message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tetrad.hardware.catalog import Cluster
from tetrad.spec.runtime_rules import COLLECTIVE_KINDS as COLLECTIVES, ring_share


@dataclass(frozen=True, slots=True)
class Group:
    size: int
    members_per_node: int  # == size when the whole group is inside one node
    num_nodes: int

    @property
    def intra_node(self) -> bool:
        return self.num_nodes == 1


def place_group(cluster: Cluster, size: int, stride: int) -> Group:
    node = cluster.node_size
    if size * stride <= node or size == 1:
        return Group(size, size, 1)
    per_node = max(1, node // stride) if stride < node else 1
    return Group(size, per_node, max(1, size // per_node))


def bus_bandwidth(cluster: Cluster, group: Group) -> float:
    profile = cluster.gpu.efficiency
    intra = cluster.intra_bandwidth * profile.intra_link
    if group.intra_node:
        return intra
    inter = group.members_per_node * cluster.inter_bandwidth * profile.inter_link
    return min(intra, inter) if group.members_per_node > 1 else inter


def latency(cluster: Cluster, group: Group, ring_steps_per_rank: int) -> float:
    """Latency of an all-reduce (`ring_steps_per_rank` 2): ring steps inside the node, a tree
    across nodes."""
    profile = cluster.gpu.efficiency
    intra_steps = ring_steps_per_rank * (group.members_per_node - 1)
    inter_steps = 2 * math.ceil(math.log2(group.num_nodes)) if group.num_nodes > 1 else 0
    return intra_steps * profile.intra_latency_s + inter_steps * profile.inter_latency_s


def ring_latency(cluster: Cluster, group: Group) -> float:
    """Latency of a reduce-scatter or all-gather: one ring of n - 1 steps around every rank, the
    node count minus one of them over the network (NCCL's nsteps and nInterSteps)."""
    profile = cluster.gpu.efficiency
    inter_steps = group.num_nodes - 1
    intra_steps = group.size - 1 - inter_steps
    return intra_steps * profile.intra_latency_s + inter_steps * profile.inter_latency_s


def all_reduce_time(cluster: Cluster, group: Group, size_bytes: float) -> float:
    if group.size == 1 or size_bytes == 0:
        return 0.0
    n = group.size
    return latency(cluster, group, 2) + 2 * (n - 1) / n * size_bytes / bus_bandwidth(cluster, group)


def all_gather_time(cluster: Cluster, group: Group, full_bytes: float) -> float:
    """All-gather producing `full_bytes` on every rank (reduce-scatter of `full_bytes` costs the
    same)."""
    if group.size == 1 or full_bytes == 0:
        return 0.0
    n = group.size
    return ring_latency(cluster, group) + (n - 1) / n * full_bytes / bus_bandwidth(cluster, group)


reduce_scatter_time = all_gather_time


def all_to_all_time(cluster: Cluster, group: Group, local_bytes: float,
                    off_node_bytes: float | None = None) -> float:
    """Every rank sends (n-1)/n of its `local_bytes`; the off-node share goes over the NIC
    (`off_node_bytes` instead, when a dispatch sends less across nodes than that share)."""
    if group.size == 1 or local_bytes == 0:
        return 0.0
    profile = cluster.gpu.efficiency
    n = group.size
    intra_share = (group.members_per_node - 1) / n * local_bytes
    inter_share = ((n - group.members_per_node) / n * local_bytes if off_node_bytes is None
                   else off_node_bytes)
    intra_time = intra_share / (cluster.intra_bandwidth * profile.intra_link)
    inter_time = (inter_share / (cluster.inter_bandwidth * profile.inter_link)
                  if inter_share else 0.0)
    hops = profile.intra_latency_s + (profile.inter_latency_s if group.num_nodes > 1 else 0.0)
    return hops + max(intra_time, inter_time)


def p2p_time(cluster: Cluster, crosses_nodes: bool, size_bytes: float) -> float:
    if size_bytes == 0:
        return 0.0
    profile = cluster.gpu.efficiency
    if crosses_nodes:
        return profile.inter_latency_s + size_bytes / (cluster.inter_bandwidth
                                                       * profile.inter_link)
    return profile.intra_latency_s + size_bytes / (cluster.intra_bandwidth * profile.intra_link)


def sent_bytes(kind: str, group_size: int, size_bytes: float) -> float:
    """Bytes one rank sends in a ring collective over `size_bytes` (see the module doc). A p2p
    call's group size is its one peer here: it sends the whole message."""
    if kind == "p2p":
        return size_bytes
    return float(ring_share(kind, group_size)) * size_bytes


class CommLedger:
    """Per-step bytes by collective kind for one rank: what it sends (ring algorithms), the
    payload it hands to the collective calls, and the calls themselves ((kind, group size,
    payload bytes) -> how many), which a calibrated profile times one by one."""

    def __init__(self) -> None:
        self.sent = dict.fromkeys(COLLECTIVES, 0.0)
        self.payload = dict.fromkeys(COLLECTIVES, 0.0)
        self.calls: dict[tuple[str, int, float], float] = {}

    def add(self, kind: str, group_size: int, size_bytes: float, count: float = 1.0) -> None:
        # A runtime holding no tensor of a kind (no experts, nothing partial) issues no call.
        if (group_size <= 1 and kind != "p2p") or size_bytes == 0 or count == 0:
            return
        self.sent[kind] += count * sent_bytes(kind, group_size, size_bytes)
        self.payload[kind] += count * size_bytes
        key = (kind, group_size, size_bytes)
        self.calls[key] = self.calls.get(key, 0.0) + count

    def calls_by_kind(self) -> dict[str, float]:
        """Calls per step by kind (the run report's comm_calls)."""
        calls = dict.fromkeys(COLLECTIVES, 0.0)
        for (kind, _, _), count in self.calls.items():
            calls[kind] += count
        return calls


def call_time(cluster: Cluster, kind: str, group_size: int, size_bytes: float) -> float:
    """One collective call: the profile's measured alpha-beta fit for its kind and group size,
    else the topology formulas above for a group of neighbours."""
    fit = cluster.gpu.efficiency.collective_fit(kind, group_size)
    if fit is not None:
        alpha, beta = fit
        return alpha + beta * size_bytes
    if kind == "p2p":
        return p2p_time(cluster, False, size_bytes)
    group = place_group(cluster, group_size, 1)
    if kind == "all_reduce":
        return all_reduce_time(cluster, group, size_bytes)
    if kind == "all_to_all":
        return all_to_all_time(cluster, group, size_bytes)
    return all_gather_time(cluster, group, size_bytes)  # reduce-scatter, all-gather, broadcast


def ledger_time(cluster: Cluster, ledger: CommLedger) -> float:
    """Seconds the calls of `ledger` take one after another."""
    return sum(count * call_time(cluster, kind, size, nbytes)
               for (kind, size, nbytes), count in ledger.calls.items())
