"""Mixture of experts: a top-k router, routed experts, optional always-on shared experts.

Routing is dropless (every token reaches its k experts). The router follows Mixtral: softmax over
all experts, keep the top k, renormalize their weights to sum to one. The auxiliary load-balance
loss is Switch Transformer's: num_experts * sum_e(fraction of routed slots to e * mean prob of e).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.config import ModelConfig
from tetrad.models.layers import MLP


class Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.num_experts = config.num_experts
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        # Context parallelism splits each sequence over ranks; it sets this to average the
        # routed fractions over them, so the loss balances whole sequences as on one device.
        self.reduce_fraction: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden] -> (weights [tokens, k], experts [tokens, k], aux_loss [])."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = F.one_hot(experts, self.num_experts).sum(dim=1).float()  # [tokens, experts]
        fraction_routed = routed.mean(dim=0) / self.top_k
        if self.reduce_fraction is not None:
            fraction_routed = self.reduce_fraction(fraction_routed)
        aux_loss = self.num_experts * (fraction_routed * probs.mean(dim=0)).sum()
        return weights.to(x.dtype), experts, aux_loss


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.router = Router(config)
        self.experts = nn.ModuleList(MLP(config, config.moe_ffn_hidden_size)
                                     for _ in range(config.num_experts))
        self.shared = (MLP(config, config.moe_ffn_hidden_size * config.num_shared_experts)
                       if config.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts, aux_loss = self.router(tokens)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            token_ids, slot = torch.where(experts == index)
            if token_ids.numel():
                contribution = expert(tokens[token_ids]) * weights[token_ids, slot].unsqueeze(-1)
                out = out.index_add(0, token_ids, contribution)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(shape), aux_loss
