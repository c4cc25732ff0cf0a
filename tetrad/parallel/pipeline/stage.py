"""A pipeline stage: a slice of a tetrad Transformer that one rank runs.

Every rank builds the full model with the same seed and keeps only its stages' modules, so the
initialization equals the single-process model's without shipping any weights. Parameter names
stay those of the full model (`layers.5.attn.qkv.weight`), so a rank's state dict is a piece of
the single-process one and a checkpoint is the union of the ranks' pieces.

A stage of a tensor-parallel model (tetrad.parallel.tensor_parallel) holds its split layers, which
compute what they compute inside the whole model: under sequence parallelism the activations
between stages are sequence shards [b, s/tp, h], and the last stage's logits are this rank's
vocabulary slice, turned into the loss by the vocab-parallel cross-entropy.

Tied embeddings: the first stage embeds with the weight the last stage's head multiplies by. On
two ranks each holds a copy, initialized equal; after the backward their gradients are summed over
the two ranks (an all-reduce over `embedding_group`, Megatron's embedding group), so both copies
take the same optimizer step and stay equal bit for bit.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tetrad.spec.model import ParallelConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.mesh import Group
from tetrad.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
from tetrad.planner.partition import Partition
from tetrad.spec.runtime_rules import rank_stages


class PipelineStage(nn.Module):
    """Stage `index` of `num_stages`: the blocks `layers` of `model`; the first stage also embeds
    (token and learned positions), the last applies the final norm and the output head. Rotary
    tables carry no parameters and are recomputed on every stage."""

    def __init__(self, model: Transformer, index: int, num_stages: int, layers: range):
        super().__init__()
        config = model.config
        self.config = config
        # Tensor parallelism swapped in the vocabulary-split embedding (and its operators).
        self.tp = model.embed.tp if isinstance(model.embed, VocabParallelEmbedding) else None
        # Tokens per sequence on the wire between stages: 1/tp of them under sequence parallelism.
        self.sequence_shards = self.tp.size if self.tp and self.tp.sequence_parallel else 1
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        holds_embedding = self.is_first or (self.is_last and config.tie_embeddings)
        self.embed = model.embed if holds_embedding else None
        self.pos_embed = model.pos_embed if self.is_first else None
        self.rotary = model.rotary
        self.layers = nn.ModuleDict({str(layer): model.layers[layer] for layer in layers})
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: Any = None) -> torch.Tensor:
        """First stage: token ids [batch, seq]; later stages: hidden states [batch, seq, hidden]
        ([batch, seq/tp, hidden] under sequence parallelism). Returns hidden states, or logits
        [batch, seq, vocab] (vocab/tp under tensor parallelism) on the last stage. `positions`
        [seq] are the tokens' places in their sequences (a context-parallel shard's are not
        0..seq-1; None: 0..seq-1). The operations are the whole model's forward, in its order, so
        the numbers match it. `cache`: the serving engine's paged KV cache of this stage's layers
        (Transformer.forward's; the pool's layer i is the stage's i-th block)."""
        if positions is None:
            seq = x.shape[1] if self.is_first else x.shape[1] * self.sequence_shards
            positions = torch.arange(seq, device=x.device)
        if self.is_first:
            x = self.embed(x)
            if self.pos_embed is not None:  # under SP, this rank's sequence shard of them
                x = x + self.pos_embed(positions)
        rope = self.rotary(positions) if self.rotary is not None else None
        for index, layer in enumerate(self.layers.values()):
            x = layer(x, rope, None if cache is None else partial(cache.attend, index))
        if self.is_last:
            if cache is not None:
                x = x[:, cache.logits_indices]
            x = self.norm(x)
            if self.lm_head is not None:
                return self.lm_head(x)
            return self.embed.unembed(x)
        return x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the last stage's logits against targets [batch, seq]."""
        if self.tp is not None:
            return vocab_parallel_cross_entropy(logits, targets, self.tp)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of this stage's MoE load-balance losses from its last forward, or None (dense)."""
        losses = [layer.aux_loss for layer in self.layers.values() if layer.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None


def build_stages(model: Transformer, partition: Partition, pp: int, pp_index: int,
                 v_shape: bool = False) -> dict[int, PipelineStage]:
    """The stages pipeline rank `pp_index` holds: s = pp_index, pp_index + pp, ... (Megatron's
    interleaved placement), or pp_index and 2 * pp - 1 - pp_index in the V placement (as
    tetrad.schedules places them), keyed by stage index. In the V, rank 0 holds the first and
    the last stage, so a tied embedding is one module there and needs no embedding group."""
    return {stage: PipelineStage(model, stage, partition.num_stages, partition.layers(stage))
            for stage in rank_stages(pp_index, partition.num_stages, pp, v_shape)}


def embedding_group(dims: ParallelConfig, rank: int) -> Group | None:
    """The first and last rank of this rank's pipeline group, which hold the two copies of a tied
    embedding; None on the ranks in between. Collective: every rank calls it (new_group must see
    every pair on every rank, in the same order), and only when embeddings are tied and pp > 1."""
    mine = None
    for ranks in dims.group_ranks("pp"):
        pair = (ranks[0], ranks[-1])
        handle = dist.group.WORLD if dims.world_size == 2 else dist.new_group(list(pair))
        if rank in pair:
            mine = Group("embedding", pair, pair.index(rank), handle)
    return mine
