"""Cutting a decoder into pipeline stages.

A model of L blocks becomes pp*vpp stages of consecutive blocks, at least one block each. The
first stage also holds the embedding (and learned positions), the last the final norm, the output
head and the loss. Balancing is by cost: FLOPs per token of each piece, from the planner's own
matmul shapes (tetrad.planner.flops), so planner and runtime cut the model the same way. The head
counts in full: with a large vocabulary it weighs several blocks, and the last stage gets fewer
blocks to make up for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tetrad.spec.model import ModelConfig
from tetrad.errors import ConfigError
from tetrad.planner.flops import attention_core_flops, head_gemm, layer_gemms


@dataclass(frozen=True)
class PieceCosts:
    """Forward FLOPs per token of each piece of the model."""

    embed: float
    blocks: tuple[float, ...]
    head: float


def piece_costs(config: ModelConfig, seq_len: int) -> PieceCosts:
    """The embedding is a lookup plus the position add (h FLOPs per token: next to nothing, but
    counted); a block is its matmuls plus causal attention at `seq_len`; the head is the output
    matmul plus softmax cross-entropy (about 5 FLOPs per logit)."""
    attention = attention_core_flops(config, seq_len) / seq_len
    blocks = tuple(sum(g.flops for g in layer_gemms(config, layer, 1)) + attention
                   for layer in range(config.num_layers))
    embed = float(config.hidden_size) if config.position == "learned" else 0.0
    return PieceCosts(embed, blocks, head_gemm(config, 1).flops + 5.0 * config.vocab_size)


@dataclass(frozen=True)
class Partition:
    """Blocks per stage, in stage order, and each stage's cost (forward FLOPs per token)."""

    stage_layers: tuple[int, ...]
    costs: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def layers(self, stage: int) -> range:
        """Indices of the blocks of `stage`."""
        start = sum(self.stage_layers[:stage])
        return range(start, start + self.stage_layers[stage])

    @property
    def imbalance(self) -> float:
        """Slowest stage over the mean stage: 1.0 is perfect balance."""
        return max(self.costs) * len(self.costs) / sum(self.costs)


def partition(config: ModelConfig, num_stages: int, seq_len: int | None = None,
              stage_layers: Sequence[int] | None = None) -> Partition:
    """Split `config`'s blocks into `num_stages` (pp*vpp) stages: as `stage_layers` says, or,
    without it, so that the slowest stage is as fast as possible."""
    check_stages(config.num_layers, num_stages, stage_layers)
    costs = piece_costs(config, seq_len or config.max_seq_len)
    stage_layers = (_balanced(costs, num_stages) if stage_layers is None
                    else tuple(stage_layers))
    starts = [sum(stage_layers[:s]) for s in range(num_stages)]
    stage_costs = tuple(
        sum(costs.blocks[start:start + count]) + (costs.embed if s == 0 else 0.0)
        + (costs.head if s == num_stages - 1 else 0.0)
        for s, (start, count) in enumerate(zip(starts, stage_layers)))
    return Partition(tuple(stage_layers), stage_costs)


def check_stages(num_layers: int, num_stages: int,
                 stage_layers: Sequence[int] | None = None) -> None:
    """Every one of the pp*vpp stages needs a layer; a given cut must cover the model exactly."""
    if num_stages > num_layers:
        raise ConfigError(f"pp*vpp = {num_stages} pipeline stages need at least one transformer "
                          f"layer each, but the model has {num_layers}: lower --pp or --vpp to "
                          f"at most {num_layers} stages in all")
    if stage_layers is None:
        return
    stage_layers = tuple(stage_layers)
    if not all(isinstance(n, int) for n in stage_layers):
        raise ConfigError(f"stage_layers must be whole numbers of layers, got {list(stage_layers)}")
    if len(stage_layers) != num_stages:
        raise ConfigError(f"stage_layers lists {len(stage_layers)} stages but pp*vpp = "
                          f"{num_stages}: give one layer count per stage")
    if min(stage_layers) < 1:
        raise ConfigError(f"stage_layers {list(stage_layers)} gives a stage no transformer layer: "
                          f"every stage needs at least 1")
    if sum(stage_layers) != num_layers:
        raise ConfigError(f"stage_layers {list(stage_layers)} sums to {sum(stage_layers)} but the "
                          f"model has {num_layers} layers: make the counts add up to {num_layers}")


def _balanced(costs: PieceCosts, num_stages: int) -> tuple[int, ...]:
    """Contiguous split minimizing the largest stage cost (dynamic programming over split
    points; L and the stage count are small). Ties go to the split with fewer blocks early on,
    which leaves the later stages, whose activations live shorter under 1F1B, the extra work."""
    blocks = costs.blocks
    num_layers = len(blocks)
    prefix = [0.0]
    for cost in blocks:
        prefix.append(prefix[-1] + cost)

    def stage_cost(stage: int, start: int, end: int) -> float:
        return (prefix[end] - prefix[start] + (costs.embed if stage == 0 else 0.0)
                + (costs.head if stage == num_stages - 1 else 0.0))

    # best[s][end]: the smallest bottleneck of stages 0..s covering blocks [0, end).
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for end in range(1, num_layers + 1):
        best[0][end] = stage_cost(0, 0, end)
    for s in range(1, num_stages):
        for end in range(s + 1, num_layers + 1):
            for start in range(s, end):
                value = max(best[s - 1][start], stage_cost(s, start, end))
                if value < best[s][end]:
                    best[s][end], cut[s][end] = value, start
    counts, end = [], num_layers
    for s in range(num_stages - 1, 0, -1):
        start = cut[s][end]
        counts.append(end - start)
        end = start
    counts.append(end)
    return tuple(reversed(counts))
