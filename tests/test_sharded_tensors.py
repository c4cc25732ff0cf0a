"""The checkpoint piece format on its own: tensors cut as tensor parallelism (rows of a dimension,
some held by two ranks) and ZeRO (flat ranges of a rank's rows) cut them come back whole, from
memory and from files; a missing element is an error, never a silent zero."""

import json
import os

import pytest
import torch

from tetrad.errors import ConfigError
from tetrad.sharded_tensors import (INDEX, Piece, ShardedReader, assemble, row_runs, rows_of,
                                    whole_pieces, write_index, write_pieces)

WEIGHT = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)


def tp_zero_pieces(weight: torch.Tensor) -> list[list[Piece]]:
    """Four ranks: tp2 over rows (rows 2 and 3 replicated on both, as kv heads are when there
    are fewer than tp) times ZeRO over 2 ranks splitting each tp shard's flat elements."""
    rows_by_tp = [torch.tensor([0, 1, 2, 3]), torch.tensor([2, 3, 4, 5])]
    ranks = []
    for rows in rows_by_tp:
        shard = weight.index_select(0, rows).reshape(-1)
        half = shard.numel() // 2
        for start, end in ((0, half), (half, shard.numel())):
            ranks.append([Piece("model", "w", shard[start:end].clone(), tuple(weight.shape),
                                0, rows, (start, end))])
    return ranks


def test_tensor_and_zero_pieces_assemble_whole():
    pieces = [piece for rank in tp_zero_pieces(WEIGHT) for piece in rank]
    assert torch.equal(assemble(pieces), WEIGHT)
    assert torch.equal(assemble(whole_pieces("model", {"w": WEIGHT})), WEIGHT)


def test_a_missing_element_is_an_error():
    pieces = [piece for rank in tp_zero_pieces(WEIGHT) for piece in rank]
    with pytest.raises(ValueError, match="model of w misses 8 of 24 elements"):
        assemble(pieces[:-1])  # the second tp shard's second half: rows 4 and 5
    with pytest.raises(ValueError, match="model of w misses 8 of 24 elements"):
        assemble(pieces[:2])  # no second tp shard at all: rows 4 and 5 again
    with pytest.raises(ValueError, match="misses 12 of 24"):
        assemble([Piece("model", "w", WEIGHT.view(-1)[:12].clone(), (6, 4), flat=(0, 12))])


def test_row_runs_are_short_and_exact():
    rows = torch.tensor([0, 1, 2, 8, 9, 4])
    assert row_runs(rows) == [[0, 3], [8, 10], [4, 5]]
    assert torch.equal(rows_of(row_runs(rows)), rows)


def test_files_written_by_every_rank_read_back_whole(tmp_path):
    bias = torch.randn(6)
    entries = []
    for rank, pieces in enumerate(tp_zero_pieces(WEIGHT)):
        if rank == 0:
            pieces += whole_pieces("exp_avg", {"b": bias})
        entries += write_pieces(tmp_path, rank, pieces)
    assert write_pieces(tmp_path, 4, []) == []  # a rank holding nothing writes no file
    write_index(tmp_path, entries)
    assert sorted(p.name for p in tmp_path.glob("shard_*")) == [
        f"shard_0000{rank}.safetensors" for rank in range(4)]
    umask = os.umask(0)
    os.umask(umask)  # readable as the process's other files, not safetensors' owner-only 0600
    assert {p.stat().st_mode & 0o777 for p in tmp_path.glob("shard_*")} == {0o666 & ~umask}
    reader = ShardedReader(tmp_path)
    assert torch.equal(reader.whole("model", "w"), WEIGHT)
    assert torch.equal(dict(reader.tensors("exp_avg"))["b"], bias)
    assert list(reader.tensors("model")) == ["w"]
    with pytest.raises(KeyError):
        reader.tensors("model")["b"]
    with pytest.raises(ConfigError, match="has no exp_avg of w"):
        reader.whole("exp_avg", "w")


def test_a_foreign_or_broken_index_is_a_config_error(tmp_path):
    (tmp_path / INDEX).write_text(json.dumps({"format": "other/9", "pieces": []}))
    with pytest.raises(ConfigError, match="has format 'other/9'"):
        ShardedReader(tmp_path)
    (tmp_path / INDEX).write_text("{ truncated")
    with pytest.raises(ConfigError, match="is corrupt"):
        ShardedReader(tmp_path)
