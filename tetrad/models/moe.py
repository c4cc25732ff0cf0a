"""Mixture of experts: a top-k router, routed experts, optional always-on shared experts.

Routing is dropless (every token reaches its k experts). The router follows Mixtral by default:
softmax over all experts, keep the top k, renormalize their weights to sum to one. DeepSeek-V3's
fields change it: sigmoid scores, a balancing bias on the choice only, group-limited top-k, and
weights renormalized (norm_topk_prob) and scaled (routed_scaling_factor). The auxiliary
load-balance loss is Switch Transformer's: num_experts * sum_e(fraction of routed slots to e * mean
prob of e), with sigmoid scores normalized per token to make the probabilities.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.spec.model import ModelConfig
from tetrad.models.layers import MLP


class Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.num_experts = config.num_experts
        self.sigmoid = config.router_score == "sigmoid"
        self.groups, self.kept_groups = config.num_expert_groups, config.topk_expert_groups
        self.normalize, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        # Aux-loss-free balancing (DeepSeek-V3): a bias added to the scores only to choose the
        # experts, never to weight them, and moved against each expert's load after every step
        # (update_bias). A parameter without gradient, so checkpoints carry it.
        self.bias_update_rate = config.router_bias_update_rate
        self.bias = (nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
                     if self.sigmoid else None)
        # Tokens routed to each expert since the last update (training with a bias update rate
        # only): a plain tensor made by the forward on its device, not a buffer to materialize.
        self.load: torch.Tensor | None = None
        # Context parallelism splits each sequence over ranks; it sets this to average the
        # routed fractions over them, so the loss balances whole sequences as on one device.
        self.reduce_fraction: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden] -> (weights [tokens, k], experts [tokens, k], aux_loss [])."""
        logits = self.gate(x).float()
        scores = logits.sigmoid() if self.sigmoid else F.softmax(logits, dim=-1)
        experts = self._choose(scores if self.bias is None else scores + self.bias)
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling
        routed = F.one_hot(experts, self.num_experts).sum(dim=1).float()  # [tokens, experts]
        if self.training and self.bias_update_rate:
            counts = routed.detach().sum(dim=0)
            self.load = counts if self.load is None else self.load + counts
        fraction_routed = routed.mean(dim=0) / self.top_k
        if self.reduce_fraction is not None:
            fraction_routed = self.reduce_fraction(fraction_routed)
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.sigmoid else scores
        aux_loss = self.num_experts * (fraction_routed * probs.mean(dim=0)).sum()
        return weights.to(x.dtype), experts, aux_loss

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The top-k experts, within the best topk_expert_groups groups (a group scored by the
        sum of its two best experts) when the experts are grouped."""
        if self.groups > 1:
            grouped = scores.view(-1, self.groups, self.num_experts // self.groups)
            best_groups = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(self.kept_groups, dim=-1)[1]
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups,
                                                                                  True)
            scores = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        return scores.topk(self.top_k, dim=-1)[1]

    @torch.no_grad()
    def update_bias(self) -> None:
        """Move each expert's bias by the update rate towards the mean load: down when it took
        more than its share of tokens since the last update, up when it took fewer."""
        if self.bias is not None and self.load is not None:
            self.bias += self.bias_update_rate * torch.sign(self.load.mean() - self.load)
            self.load = None


def update_router_biases(model: nn.Module) -> None:
    """After an optimizer step: aux-loss-free balancing's bias update in every router."""
    for module in model.modules():
        if isinstance(module, Router):
            module.update_bias()


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
