"""The parameter-server model's edge cases against its module doc's formulas, in exact small
numbers: one worker, no sparse table, row ids without row bytes, pushes unequal to pulls."""

from __future__ import annotations

import math

from tetrad.planner import parameter_server as ps


def test_a_ring_of_one_moves_nothing_and_no_ring_has_a_server():
    assert ps.ring_all_reduce_step(1, 1000.0, 10.0, 1.0) == ps.Traffic(0.0, 0.0, 0.0, 0.0, 0.0)
    ring = ps.ring_all_reduce_step(4, 1000.0, 10.0, 1.0)
    assert (ring.worker_out, ring.worker_in, ring.server_in, ring.server_out) == (
        1500.0, 1500.0, 0.0, 0.0)
    assert ring.time_s == 2 * 3 * 1.0 + 1500.0 / 10.0
    assert math.isinf(ps.compare(1, 1, 1000.0, 10.0, 1.0)["ps_over_ring_time"])


def test_without_a_sparse_table_only_the_dense_gradient_moves():
    result = ps.compare(4, 2, 1000.0, 10.0, 1.0)
    assert result["parameter_server"]["worker_link_bytes"] == {"out": 1000.0, "in": 1000.0}
    assert result["parameter_server"]["server_link_bytes"] == {"in": 2000.0, "out": 2000.0}
    assert result["ring_all_reduce"]["link_bytes"] == {"out": 1500.0, "in": 1500.0}


def test_row_ids_go_with_the_push_and_each_phase_waits_for_its_busiest_link():
    """8-byte ids travel with every pushed row, not with the pull; with 4 workers on 2 servers a
    server link carries twice a worker's bytes in each phase."""
    ids_only = ps.parameter_server_step(1, 1, 1000.0, 10.0, 0.5, touched_rows=10)
    assert (ids_only.worker_out, ids_only.worker_in) == (1000.0 + 10 * 16, 1000.0)
    step = ps.parameter_server_step(4, 2, 1000.0, 10.0, 0.5, touched_rows=10, row_bytes=4.0)
    push, pull = 1000.0 + 10 * (4.0 + 16), 1000.0 + 10 * 4.0
    assert (step.worker_out, step.worker_in, step.server_in, step.server_out) == (
        push, pull, 2 * push, 2 * pull)
    assert step.time_s == (0.5 + 2 * push / 10.0) + (0.5 + 2 * pull / 10.0)
    assert step.busiest_link == 2 * push
