"""The planner's parameter-server model: per-link bytes and time against ring all-reduce."""

import pytest

from tetrad.errors import ConfigError
from tetrad.hardware.catalog import GB
from tetrad.hardware.profile import cluster
from tetrad.planner import parameter_server as ps

PHI = 100e6  # a 25M-parameter fp32 gradient
BANDWIDTH, LATENCY = 10 * GB, 20e-6


def test_one_server_link_carries_every_workers_gradient():
    for workers in (1, 2, 4, 8, 16):
        step = ps.parameter_server_step(workers, 1, PHI, BANDWIDTH, LATENCY)
        assert (step.worker_out, step.worker_in) == (PHI, PHI)
        assert (step.server_in, step.server_out) == (workers * PHI, workers * PHI)
        assert step.time_s == pytest.approx(2 * LATENCY + 2 * workers * PHI / BANDWIDTH)


def test_servers_split_the_load_down_to_a_workers_link():
    eight = [ps.parameter_server_step(8, servers, PHI, BANDWIDTH, LATENCY)
             for servers in (1, 2, 4, 8, 16)]
    assert [s.server_in for s in eight] == [8 * PHI, 4 * PHI, 2 * PHI, PHI, PHI / 2]
    # Once the servers outnumber the workers the workers' own links are the bottleneck.
    assert eight[3].time_s == eight[4].time_s == pytest.approx(2 * LATENCY
                                                               + 2 * PHI / BANDWIDTH)


def test_ring_link_load_stays_under_twice_the_gradient():
    loads = [ps.ring_all_reduce_step(w, PHI, BANDWIDTH, LATENCY) for w in (2, 4, 8, 64)]
    assert [s.busiest_link for s in loads] == pytest.approx([PHI, 1.5 * PHI, 1.75 * PHI,
                                                             2 * 63 / 64 * PHI])
    assert loads[1].time_s == pytest.approx(6 * LATENCY + 1.5 * PHI / BANDWIDTH)
    assert ps.ring_all_reduce_step(1, PHI, BANDWIDTH, LATENCY).time_s == 0.0


def test_one_server_loses_to_the_ring_linearly_in_the_workers():
    ratios = [ps.compare(w, 1, PHI, BANDWIDTH, LATENCY)["ps_over_ring_time"]
              for w in (2, 4, 8, 16)]
    assert ratios == sorted(ratios) and ratios[0] > 1.9
    ps_time = 2 * LATENCY + 2 * 16 * PHI / BANDWIDTH
    ring_time = 30 * LATENCY + 2 * 15 / 16 * PHI / BANDWIDTH
    assert ratios[-1] == pytest.approx(ps_time / ring_time)
    sharded = ps.compare(8, 8, PHI, BANDWIDTH, LATENCY)
    assert sharded["parameter_server"]["busiest_link_bytes"] == PHI
    assert sharded["ring_all_reduce"]["busiest_link_bytes"] == pytest.approx(1.75 * PHI)


def test_sparse_rows_move_instead_of_the_whole_table():
    table, row = 50_000 * 1024.0, 1024.0  # 50k rows of 256 fp32
    result = ps.compare(4, 1, PHI, BANDWIDTH, LATENCY, table_bytes=table, touched_rows=300,
                        row_bytes=row)
    worker = result["parameter_server"]["worker_link_bytes"]
    assert worker == {"out": PHI + 300 * (row + 16), "in": PHI + 300 * row}
    assert result["ring_all_reduce"]["link_bytes"]["out"] == pytest.approx(1.5 * (PHI + table))


def test_on_a_cluster_the_network_link_is_the_nic_at_its_efficiency():
    world = cluster("dgx-h100", 16)
    bandwidth, latency = ps.network_link(world)
    profile = world.gpu.efficiency
    assert bandwidth == pytest.approx(50 * GB * profile.inter_link)
    assert latency == profile.inter_latency_s
    result = ps.compare_on_cluster(world, 4, 2, PHI)
    assert result == ps.compare(4, 2, PHI, bandwidth, latency)
    with pytest.raises(ConfigError, match="--nic-gbps"):
        ps.network_link(cluster("rtx-4090", 2))


@pytest.mark.parametrize("args, fragment", [
    ((0, 1, PHI, BANDWIDTH, LATENCY), "at least one worker and one server"),
    ((2, 0, PHI, BANDWIDTH, LATENCY), "at least one worker and one server"),
    ((2, 1, PHI, 0.0, LATENCY), "bandwidth must be positive"),
])
def test_bad_inputs_say_what_is_wrong(args, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ps.parameter_server_step(*args)
