"""Pipeline cuts against first principles: piece costs counted by hand from the matmul shapes,
and the balanced cut against every contiguous cut tried."""

from __future__ import annotations

import itertools

import pytest

from tetrad.spec.model import ModelConfig
from tetrad.errors import ConfigError
from tetrad.planner.partition import check_stages, partition, piece_costs

H, SEQ = 64, 32


def _model(layers=7, vocab=6000, **overrides):
    fields = dict(vocab_size=vocab, hidden_size=H, num_layers=layers, num_heads=4,
                  ffn_hidden_size=4 * H, max_seq_len=SEQ, norm="layernorm", position="learned",
                  mlp="gelu", bias=True, tie_embeddings=True)
    return ModelConfig(**{**fields, **overrides})


def test_piece_costs_are_the_matmul_flops_per_token():
    # A GPT block: 2 FLOPs per weight (4h^2 attention + 8h^2 MLP), and causal attention reads
    # (s+1)/2 keys on average per query for QK^T and again for AV.
    config = _model()
    costs = piece_costs(config, SEQ)
    assert costs.blocks == pytest.approx([24 * H * H + 2 * (SEQ + 1) * H] * 7)
    assert costs.embed == H  # the learned position add
    assert costs.head == 2 * H * 6000 + 5 * 6000  # the output matmul plus cross-entropy
    # SwiGLU with 2 of 4 heads for k and v (head dim 16), rotary positions: no position add.
    gqa = _model(norm="rmsnorm", position="rope", mlp="swiglu", bias=False, num_kv_heads=2)
    matmuls = 2 * (H * H + H * 2 * 2 * 16 + H * H + 3 * H * 4 * H)
    assert piece_costs(gqa, SEQ).blocks == pytest.approx([matmuls + 2 * (SEQ + 1) * H] * 7)
    assert piece_costs(gqa, SEQ).embed == 0


def _stage_costs(config, counts):
    costs = piece_costs(config, SEQ)
    out, start = [], 0
    for stage, count in enumerate(counts):
        cost = sum(costs.blocks[start:start + count])
        cost += costs.embed if stage == 0 else 0
        cost += costs.head if stage == len(counts) - 1 else 0
        out.append(cost)
        start += count
    return out


def _every_cut(num_layers, num_stages):
    for inner in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *inner, num_layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("layers, stages, vocab", [(7, 2, 6000), (7, 3, 6000), (9, 4, 20000),
                                                   (6, 6, 100), (8, 3, 100), (5, 1, 6000)])
def test_balanced_cut_has_the_smallest_bottleneck_of_every_cut(layers, stages, vocab):
    config = _model(layers, vocab)
    result = partition(config, stages, SEQ)
    assert sum(result.stage_layers) == layers and min(result.stage_layers) >= 1
    assert list(result.costs) == pytest.approx(_stage_costs(config, result.stage_layers))
    bottlenecks = {cut: max(_stage_costs(config, cut)) for cut in _every_cut(layers, stages)}
    best = min(bottlenecks.values())
    assert max(result.costs) == pytest.approx(best)
    # Ties leave the later stages the extra blocks: no optimal cut gives the last stage more.
    optimal = [cut for cut, value in bottlenecks.items() if value <= best * (1 + 1e-12)]
    assert result.stage_layers[-1] == max(cut[-1] for cut in optimal)
    assert result.imbalance == pytest.approx(max(result.costs) * stages / sum(result.costs))
    covered = [layer for stage in range(stages) for layer in result.layers(stage)]
    assert covered == list(range(layers))


def test_a_heavy_head_leaves_the_last_stage_fewer_blocks():
    # The head weighs 133 * 2000 FLOPs, 2.6 blocks: 5 blocks against 3 and the head beats 4 + 4.6.
    assert partition(_model(8, 2000), 2, SEQ).stage_layers == (5, 3)
    assert partition(_model(8, 100), 2, SEQ).stage_layers == (4, 4)


def test_a_given_cut_is_kept_and_costed():
    config = _model(7)
    result = partition(config, 3, SEQ, stage_layers=[1, 4, 2])
    assert result.stage_layers == (1, 4, 2) and result.num_stages == 3
    assert list(result.costs) == pytest.approx(_stage_costs(config, (1, 4, 2)))
    assert list(result.layers(1)) == [1, 2, 3, 4]


@pytest.mark.parametrize("layers, stages, cut, fragment", [
    (4, 5, None, "at least one transformer layer each"),
    (4, 2, [1, 2], "sums to 3"),
    (4, 2, [0, 4], "no transformer layer"),
    (4, 2, [1, 1, 2], "lists 3 stages"),
    (4, 2, [1.5, 2.5], "whole numbers")])
def test_impossible_cuts_are_refused(layers, stages, cut, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_stages(layers, stages, cut)


def test_every_stage_may_hold_exactly_one_layer():
    check_stages(4, 4, [1, 1, 1, 1])
    check_stages(4, 4)
