"""Parameter server vs ring all-reduce: bytes on every link and communication time per step.

Every participant has one full-duplex link of `bandwidth` bytes/s per direction and a per-message
`latency_s`. Per step each of W workers pushes its gradient and pulls the parameters back; S
servers split the keys evenly, so a server's link carries W/S of every worker's traffic:

    worker link   out: D + r(R + 16)   in: D + rR      (D dense bytes, r rows touched of R bytes;
    server link   in:  W/S x out        out: W/S x in    8-byte ids go with push and pull)

Sync mode pushes, then pulls (the servers need every push before the step), and each phase
lasts as long as its busiest link:

    t_ps   = 2 latency + max(1, W/S) (push + pull bytes) / bandwidth

With --ps-replicas 1 each server sends its standby its range's whole gradient after the pushes
(the mean gradient of its dense range and of its rows of the table: (D + table) / S) and receives
its primary's, before the pull: that much more on a server's link each way, and one more phase
of latency + (D + table) / S / bandwidth.

A ring all-reduce over the W workers moves the whole gradient (it cannot skip rows nobody
touched) through 2(W-1) steps of 1/W of it each, every link equally loaded:

    t_ring = 2(W-1) latency + 2(W-1)/W (D + table) / bandwidth

With one server its link carries W times a worker's gradient each way, so t_ps grows linearly
with the workers while a ring link never carries more than 2x the gradient: why collectives
replaced parameter servers for dense models. S = W servers bring a server's load down to a
worker's, at the price of W extra machines; touched rows are what keep the parameter server in
use for large sparse embedding tables. The ring's latency term is a flat ring's, as
tetrad/planner/comm.py charges inside a node (NCCL's trees at scale only shorten it). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.errors import ConfigError
from tetrad.hardware.catalog import Cluster

ID_BYTES = 8  # an int64 row id


@dataclass(frozen=True)
class Traffic:
    """Bytes per step on one link, each direction, and the step's communication time."""

    worker_out: float
    worker_in: float
    server_in: float  # 0 for a ring: there is no server
    server_out: float
    time_s: float

    @property
    def busiest_link(self) -> float:
        """The most bytes any one link carries in one direction."""
        return max(self.worker_out, self.worker_in, self.server_in, self.server_out)


def _check(num_workers: int, num_servers: int, bandwidth: float) -> None:
    if num_workers < 1 or num_servers < 1:
        raise ConfigError(f"a parameter server needs at least one worker and one server, got "
                          f"{num_workers} workers and {num_servers} servers")
    if bandwidth <= 0:
        raise ConfigError(f"link bandwidth must be positive, got {bandwidth}")


def parameter_server_step(num_workers: int, num_servers: int, dense_bytes: float,
                          bandwidth: float, latency_s: float, touched_rows: float = 0.0,
                          row_bytes: float = 0.0, replicas: int = 0,
                          table_bytes: float = 0.0) -> Traffic:
    """A sync step: every worker pushes its dense gradient and `touched_rows` rows of the sparse
    table, then pulls the same back; with `replicas`, each server first sends its standby its
    range's gradient (`table_bytes`: the whole sparse table)."""
    _check(num_workers, num_servers, bandwidth)
    worker_out = dense_bytes + touched_rows * (row_bytes + 2 * ID_BYTES)
    worker_in = dense_bytes + touched_rows * row_bytes
    share = num_workers / num_servers
    replica = replica_bytes(num_servers, dense_bytes, table_bytes) if replicas else 0.0
    push = latency_s + max(worker_out, share * worker_out) / bandwidth
    replicate = latency_s + replica / bandwidth if replica else 0.0
    pull = latency_s + max(worker_in, share * worker_in) / bandwidth
    return Traffic(worker_out, worker_in, share * worker_out + replica,
                   share * worker_in + replica, push + replicate + pull)


def replica_bytes(num_servers: int, dense_bytes: float, table_bytes: float) -> float:
    """What a server sends its standby per sync step (--ps-replicas 1): its share of the dense
    gradient and of the table's, fp32 (ranges differ by at most one element or row)."""
    return (dense_bytes + table_bytes) / num_servers


def ring_all_reduce_step(num_workers: int, gradient_bytes: float, bandwidth: float,
                         latency_s: float) -> Traffic:
    """A ring all-reduce of the whole gradient over the workers: 2(W-1)/W of it on each link."""
    _check(num_workers, 1, bandwidth)
    if num_workers == 1:
        return Traffic(0.0, 0.0, 0.0, 0.0, 0.0)
    per_link = 2 * (num_workers - 1) / num_workers * gradient_bytes
    time_s = 2 * (num_workers - 1) * latency_s + per_link / bandwidth
    return Traffic(per_link, per_link, 0.0, 0.0, time_s)


def compare(num_workers: int, num_servers: int, dense_bytes: float, bandwidth: float,
            latency_s: float, table_bytes: float = 0.0, touched_rows: float = 0.0,
            row_bytes: float = 0.0, replicas: int = 0) -> dict:
    """Both strategies on the same links, as one JSON-ready dict (what the benchmark prints
    beside its measurements). `table_bytes` is the sparse table, whole: what a ring moves."""
    ps = parameter_server_step(num_workers, num_servers, dense_bytes, bandwidth, latency_s,
                               touched_rows, row_bytes, replicas, table_bytes)
    ring = ring_all_reduce_step(num_workers, dense_bytes + table_bytes, bandwidth, latency_s)
    return {"workers": num_workers, "servers": num_servers,
            "parameter_server": {"worker_link_bytes": {"out": ps.worker_out, "in": ps.worker_in},
                                 "server_link_bytes": {"in": ps.server_in, "out": ps.server_out},
                                 "busiest_link_bytes": ps.busiest_link,
                                 "comm_time_s": ps.time_s},
            "ring_all_reduce": {"link_bytes": {"out": ring.worker_out, "in": ring.worker_in},
                                "busiest_link_bytes": ring.busiest_link,
                                "comm_time_s": ring.time_s},
            "ps_over_ring_time": ps.time_s / ring.time_s if ring.time_s else float("inf")}


def network_link(cluster: Cluster) -> tuple[float, float]:
    """(bandwidth, latency) of one machine's network link in `cluster`: its NIC at the
    calibrated efficiency. Parameter servers are separate hosts, so every byte crosses it."""
    if cluster.nic_bandwidth <= 0:
        raise ConfigError(f"{cluster.gpu.name} has no published network: pass --nic-gbps with "
                          f"the per-machine network bandwidth (Gb/s)")
    profile = cluster.gpu.efficiency
    return cluster.nic_bandwidth * profile.inter_link, profile.inter_latency_s


def compare_on_cluster(cluster: Cluster, num_workers: int, num_servers: int,
                       dense_bytes: float, **sparse: float) -> dict:
    bandwidth, latency_s = network_link(cluster)
    return compare(num_workers, num_servers, dense_bytes, bandwidth, latency_s, **sparse)
