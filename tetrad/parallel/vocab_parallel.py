"""The vocabulary split over the tensor-parallel ranks: the embedding by rows, and the
cross-entropy computed from each rank's slice of the logits (Megatron's vocab-parallel
cross-entropy), so that full [tokens, vocab] logits never exist on one rank.

The loss needs three numbers per token that span the vocabulary: the largest logit (for a stable
softmax), the sum of exponentials and the target's logit. Each rank computes them over its slice;
two all-reduces over the tokens (the max, then the two sums stacked) make them global. The
backward needs no communication: the gradient of the loss with respect to a rank's logits is its
slice of softmax - one_hot(target).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.parallel.tp_operators import TensorParallel

LOSS_TAG = "loss"


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (tokens) are split: this rank keeps rows `indices[index]`, a
    contiguous range, of the full nn.Embedding. A token another rank owns looks up zeros here,
    and g (or g_bar_seq) sums the ranks' lookups, so each token gets its one real row."""

    dim = 0

    def __init__(self, full: nn.Embedding, indices: list[torch.Tensor], tp: TensorParallel):
        super().__init__()
        self.tp, self.indices = tp, indices
        rows = indices[tp.index]
        self.vocab_start, self.num_rows = int(rows[0]), len(rows)
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq] -> [batch, seq, hidden], or [batch, seq / tp, hidden] under SP."""
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.num_rows)
        x = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        # Zeroing the borrowed row 0 also zeroes its gradient for tokens this rank does not own.
        return self.tp.leave(x.masked_fill(elsewhere.unsqueeze(-1), 0.0))

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        """The tied head: hidden states (entering through f, or all-gathered under SP) -> this
        rank's vocabulary slice of the logits."""
        return self.tp.enter(x) @ self.weight.t()


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from vocabulary-split logits; see the module docstring."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel
                ) -> torch.Tensor:
        """logits: [tokens, vocab / tp] fp32, this rank's slice; targets: [tokens]."""
        num_rows = logits.shape[-1]
        vocab_start = tp.index * num_rows
        largest = logits.max(dim=-1).values  # [tokens]
        tp.comm.all_reduce(largest, tp.group, LOSS_TAG, op="max")
        shifted = logits - largest.unsqueeze(-1)
        local_targets = targets - vocab_start
        mine = (local_targets >= 0) & (local_targets < num_rows)
        local_targets = local_targets.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
        exp = shifted.exp_()
        sums = torch.stack([exp.sum(dim=-1), target_logit.masked_fill(~mine, 0.0)])  # [2, tokens]
        tp.comm.all_reduce(sums, tp.group, LOSS_TAG)
        sum_exp, target_logit = sums
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # [tokens, vocab / tp]
        ctx.save_for_backward(softmax, local_targets, mine)
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local_targets, mine = ctx.saved_tensors
        scale = grad / softmax.shape[0]  # the mean over tokens
        grad_logits = softmax * scale
        tokens = torch.arange(softmax.shape[0], device=softmax.device)
        grad_logits[tokens, local_targets] -= mine.to(softmax.dtype) * scale
        return grad_logits, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 tp: TensorParallel) -> torch.Tensor:
    """F.cross_entropy(full_logits.flatten(0, -2), targets.flatten()) (mean over tokens), from
    this rank's logits [..., vocab / tp] (ranks hold consecutive slices in rank order) and the
    targets [...], the same on every rank. Computed in fp32; the result is equal on every rank."""
    return VocabParallelCrossEntropy.apply(logits.float().flatten(0, -2), targets.flatten(), tp)
