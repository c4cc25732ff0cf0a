"""Experts spread over a tensor-parallel group (`--tp T --ep T`): the planner's "ep = tp" layout,
where each tp rank holds whole experts instead of every rank computing every expert.

After a layer's attention every tp rank holds the same tokens, so no dispatch is needed: each
rank routes all of them with the replicated router, runs its own E/T experts on the tokens routed
there and adds their weighted outputs, and one all-reduce over the tp group sums the ranks'
partial outputs. The shared expert is split by hidden units like a dense MLP (column-parallel up,
row-parallel down, its own all-reduce), as the planner counts it: apply_tensor_parallel did that
already, as it does for every MoE layer.
"""

from __future__ import annotations

import torch
from torch import nn

from tetrad.models.moe import MoE
from tetrad.parallel.tp_operators import TensorParallel, g


class TensorParallelExperts(nn.Module):
    """An MoE layer whose routed experts are divided over the tp ranks: rank i keeps experts
    i*E/T .. (i+1)*E/T - 1 (names experts.{global index}, as expert parallelism keeps them)."""

    def __init__(self, moe: MoE, tp: TensorParallel):
        super().__init__()
        self.tp, self.router, self.shared = tp, moe.router, moe.shared
        per_rank = len(moe.experts) // tp.size
        first = tp.index * per_rank
        self.experts = nn.ModuleDict({str(e): moe.experts[e]
                                      for e in range(first, first + per_rank)})

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts, aux_loss = self.router(tokens)
        out = torch.zeros_like(tokens)
        for name, expert in self.experts.items():
            token_ids, slot = torch.where(experts == int(name))
            if token_ids.numel():
                contribution = expert(tokens[token_ids]) * weights[token_ids, slot].unsqueeze(-1)
                out = out.index_add(0, token_ids, contribution)
        out = g(out, self.tp)  # the other ranks' experts
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(shape), aux_loss


def spread_experts(model: nn.Module, tp: TensorParallel) -> None:
    """Every MoE layer of `model` (already split over tp) keeps only this rank's experts."""
    for block in model.layers:
        if block.is_moe:
            block.mlp = TensorParallelExperts(block.mlp, tp)
