"""ZeRO-3's start: rank 0's sharded parameters reach the other ranks as a scatter of shards (each
rank receives its 1/N), not a broadcast of every parameter. Counted bytes, and the values: the
ranks start from different seeds, and every rank ends up with rank 0's parameters.
"""

from fractions import Fraction

import torch
import torch.distributed as dist
from dist import run_ranks
from zero_harness import Case, distributed_strategy, whole_parameters

from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import CommCounter
from tetrad.parallel.mesh import build_mesh
from tetrad.spec.model import ParallelConfig
from tetrad.spec.presets import resolve_model

N = 2


def seeded(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(resolve_model("tiny"))


def start(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    mesh = build_mesh(ParallelConfig(dp=world_size), rank, world_size)
    counter = CommCounter()
    strategy = distributed_strategy(Case(3), mesh, counter, model=seeded(rank))
    setup = {kind: value for kind, value in counter.totals(("setup",)).items() if value}
    shards = sum(shard.numel for shard in strategy.engine.shards)  # padded flat units
    dist.barrier()
    return {"setup": setup, "shards": shards, "params": whole_parameters(strategy)}


def test_zero3_scatters_rank0s_shards_instead_of_broadcasting_them():
    results = run_ranks(start, N)
    model = seeded(0)
    for rank, result in enumerate(results):
        padded = 4 * result["shards"]  # fp32 units, each padded to a multiple of N
        # Rank 0 sends every other rank its shard, the others only receive; nothing is
        # broadcast (every parameter the engine holds is in a unit; the old start broadcast
        # them all, (N-1)/N of 4 bytes per parameter from every rank).
        expected = {"scatter": Fraction(N - 1, N) * padded} if rank == 0 else {}
        assert result["setup"] == expected, (rank, result["setup"])
        for name, value in model.state_dict().items():
            torch.testing.assert_close(result["params"][name], value, rtol=0, atol=0,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
    assert results[0]["shards"] >= sum(p.numel() for p in model.parameters() if p.requires_grad)
