"""The rank grid and group membership (plain Python: no processes)."""

import itertools

import pytest

from tetrad.cli.main import main
from tetrad.spec.model import ParallelConfig
from tetrad.errors import ConfigError
from tetrad.parallel.mesh import GROUP_NAMES


def test_the_classic_16_gpu_example():
    dims = ParallelConfig(tp=2, pp=4, dp=2)
    assert dims.world_size == 16
    assert dims.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11],
                                      [12, 13], [14, 15]]
    assert dims.group_ranks("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14],
                                      [3, 7, 11, 15]]
    assert dims.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11],
                                      [12, 14], [13, 15]]
    # Megatron's docstring (initialize_model_parallel): 2 model-parallel groups of tp x pp ranks.
    assert dims.group_ranks("mp") == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def test_tetrad_mesh_prints_the_groups(capsys):
    assert main(["mesh", "--tp", "2", "--pp", "4", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "[g0,g1] [g2,g3]" in out
    assert "[g0,g4,g8,g12] [g1,g5,g9,g13]" in out
    assert "[g0,g2] [g1,g3]" in out
    assert "mp groups (2 of 8): [g0,g1,g4,g5,g8,g9,g12,g13] [g2,g3,g6,g7,g10,g11,g14,g15]" in out


@pytest.mark.parametrize("dp, pp, cp, tp, ep", [(2, 4, 1, 2, 1), (2, 1, 2, 2, 4), (3, 2, 2, 1, 2),
                                                (4, 1, 1, 1, 2), (1, 1, 1, 1, 1)])
def test_rank_order_and_partitions(dp, pp, cp, tp, ep):
    dims = ParallelConfig(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)
    # TP innermost, then CP, then DP, PP outermost: the rank is the mixed-radix number.
    for rank, (p, d, c, t) in enumerate(itertools.product(range(pp), range(dp), range(cp),
                                                          range(tp))):
        coords = dims.coords(rank)
        assert (coords["pp"], coords["dp"], coords["cp"], coords["tp"]) == (p, d, c, t)
        assert dims.rank_of(pp=p, dp=d, cp=c, tp=t) == rank
    expected_sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "dp_cp": dp * cp, "mp": tp * pp,
                      "ep": ep,
                      "edp": dp * cp // ep, "world": dp * pp * cp * tp}
    for name in GROUP_NAMES:
        groups = dims.group_ranks(name)
        assert sorted(r for group in groups for r in group) == list(range(dims.world_size)), name
        assert {len(group) for group in groups} == {expected_sizes[name]}, name
    # Members of a group differ only along the group's axes.
    for group in dims.group_ranks("dp_cp"):
        assert len({(dims.coords(r)["pp"], dims.coords(r)["tp"]) for r in group}) == 1
    # A model-parallel group is one replica: one (dp, cp) position, every (pp, tp) pair once.
    for group in dims.group_ranks("mp"):
        assert len({(dims.coords(r)["dp"], dims.coords(r)["cp"]) for r in group}) == 1
        assert len({(dims.coords(r)["pp"], dims.coords(r)["tp"]) for r in group}) == pp * tp


def test_experts_fold_over_data_and_context_ranks():
    dims = ParallelConfig(dp=2, cp=2, tp=2, ep=2)
    # d = dp_index * cp + cp_index runs over ranks 0,2,4,6 at tp 0; EP takes neighbours in d.
    assert dims.group_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for rank in range(dims.world_size):
        coords = dims.coords(rank)
        assert coords["ep"] + dims.ep * coords["edp"] == coords["dp"] * dims.cp + coords["cp"]


def test_validation_names_the_fix():
    with pytest.raises(ConfigError, match="ep 3 must divide dp\\*cp = 4"):
        ParallelConfig(dp=4, ep=3)
    with pytest.raises(ConfigError, match="tp must be a positive integer"):
        ParallelConfig(tp=0)
    with pytest.raises(ConfigError, match="make the process count equal"):
        ParallelConfig(dp=2, tp=2).check_world_size(8)
    dims = ParallelConfig(dp=2, pp=2, tp=2)
    assert (dims.dp, dims.pp, dims.tp, dims.world_size) == (2, 2, 2, 8)
