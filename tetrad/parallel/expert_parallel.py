"""Expert parallelism: each MoE layer's experts divided over the ep ranks, tokens sent to their
experts and back by all-to-all (GShard; Megatron's all-to-all token dispatcher).

Placement. ep is folded over the dp*cp ranks (tetrad.parallel.mesh): ep rank j owns experts
j*E/ep .. (j+1)*E/ep - 1 of every MoE layer; each expert shard is replicated over the edp =
dp*cp/ep ranks of its expert-data-parallel group. The router and the shared experts are
replicated like every non-expert weight.

One MoE layer on one rank, for its own tokens:
  route     the replicated router picks k experts per token, exactly as on one device (the
            load-balance loss included: it is computed from this rank's tokens, as the
            single-process model computes it for the same tokens)
  capacity  optional (capacity_factor): each expert takes at most
            ceil(capacity_factor * tokens * k / E) of this rank's (token, expert) slots, the
            earliest tokens first (Switch Transformer's per-group capacity, applied at the source
            before dispatch as in Megatron); a dropped slot contributes nothing, its token goes on
            through the residual (and the shared experts). Without it routing is dropless.
  splits    the slots, sorted by expert (hence by owner rank), give how many rows go to each
            rank; one all-to-all of the per-expert counts tells every owner what it receives
  dispatch  all-to-all of the slot rows [slots, hidden] with those uneven splits; with
            `overlap` and shared experts it is issued async and the shared experts compute
            while it travels (and in backward, while its reverse travels)
  experts   each local expert runs on its rows from every source
  combine   the reverse all-to-all brings each row home; it is weighted by its routing weight and
            added to its token's output
Backward runs the two all-to-alls in reverse (the autograd function below). A slot is sent once
per chosen expert, so the bytes a rank sends per layer and step are
2 * (slots it sends to other ranks + slots it receives from other ranks) * hidden * bytes
(dispatch and combine, forward and backward), plus the count exchange.

Gradients. An owner's expert gradient already holds every ep rank's contribution (the tokens
of all of them passed through it), so it is not averaged over the ep group; it is summed over
the edp group (the expert's replicas) and divided by dp*cp, the mean the trainer takes of every
replicated gradient: both then equal the single-process gradient of the mean loss.

The trainer's side (docs/context_expert_parallel.md): tetrad.parallel.parallelize applies it to
the full model built with the same seed on every rank, feeds each rank its own data-parallel rows,
averages the other gradients over dp*cp as usual and calls `reduce_expert_gradients()` after
backward; ParallelModel takes the global norm and cuts the checkpoint pieces.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.models.moe import MoE
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm
from tetrad.parallel.mesh import Group, Mesh
from tetrad.planner.rules import check_expert_parallel

TOKENS_TAG = "experts"  # dispatch and combine
SPLITS_TAG = "expert_splits"  # the per-expert counts exchanged before each dispatch


def expert_capacity(num_tokens: int, top_k: int, num_experts: int,
                    capacity_factor: float) -> int:
    """Slots one expert takes from one rank's `num_tokens` tokens."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def within_capacity(slot_expert: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """slot_expert [slots] (slot t*k + j is token t's j-th choice) -> bool [slots]: whether the
    slot is among the first `capacity` of its expert, in slot order."""
    one_hot = F.one_hot(slot_expert, num_experts)  # [slots, experts]
    place = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # the slot's place in its expert's queue
    return place < capacity


class _AllToAll(torch.autograd.Function):
    """All-to-all with uneven splits; its gradient goes back by the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, exchange, output_splits: list[int], input_splits: list[int]):
        ctx.exchange, ctx.splits = exchange, (output_splits, input_splits)
        return exchange(x, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return ctx.exchange(grad.contiguous(), input_splits, output_splits), None, None, None


class _Pending:
    """An all-to-all on its way: its handle and the buffer it fills."""

    def __init__(self) -> None:
        self.handle, self.buffer = None, None

    def take(self) -> torch.Tensor:
        self.handle.wait()
        buffer, self.handle, self.buffer = self.buffer, None, None
        return buffer


class _DispatchIssue(torch.autograd.Function):
    """The dispatch all-to-all, issued: returns the buffer it is still filling (read it only
    after _DispatchWait). Backward waits for the reverse all-to-all _DispatchWait issued: it
    ignores the gradient handed to it, which is what went into that all-to-all."""

    @staticmethod
    def forward(ctx, x, pending: _Pending, exchange, output_splits: list[int],
                input_splits: list[int]):
        ctx.pending = pending
        pending.buffer, pending.handle = exchange(x, output_splits, input_splits, True)
        return pending.buffer

    @staticmethod
    def backward(ctx, grad):
        return ctx.pending.take(), None, None, None, None


class _DispatchWait(torch.autograd.Function):
    """Where the forward waits for the dispatch. Backward issues the reverse all-to-all of the
    gradient and returns at once: autograd runs nodes made later first, so what was computed
    between _DispatchIssue and this wait in forward (the shared experts) runs its backward while
    the gradient travels, and _DispatchIssue's backward waits for it."""

    @staticmethod
    def forward(ctx, received, pending: _Pending, exchange, output_splits: list[int],
                input_splits: list[int]):
        ctx.pending, ctx.exchange = pending, exchange
        ctx.splits = (output_splits, input_splits)
        pending.take()
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        ctx.pending.buffer, ctx.pending.handle = ctx.exchange(grad.contiguous(), input_splits,
                                                              output_splits, True)
        return grad, None, None, None, None


class ExpertParallelMoE(nn.Module):
    """A MoE layer holding only this ep rank's experts. Parameter names stay the single-process
    ones (router.gate.weight, experts.{global index}.*, shared.*)."""

    def __init__(self, moe: MoE, group: Group, comm: Comm, capacity_factor: float | None = None,
                 overlap: bool = False):
        super().__init__()
        self.group, self.comm, self.capacity_factor = group, comm, capacity_factor
        self.overlap = overlap and moe.shared is not None  # the compute that hides the dispatch
        self.router, self.shared = moe.router, moe.shared
        self.num_experts = len(moe.experts)
        self.num_local = self.num_experts // group.size
        first = group.index * self.num_local
        self.experts = nn.ModuleDict({str(e): moe.experts[e]
                                      for e in range(first, first + self.num_local)})

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [tokens, hidden]
        weights, experts, aux_loss = self.router(tokens)  # [tokens, k] each
        top_k = experts.shape[1]
        slot_expert = experts.reshape(-1)  # [tokens * k]
        kept = torch.arange(slot_expert.numel(), device=x.device)
        if self.capacity_factor is not None:
            capacity = expert_capacity(tokens.shape[0], top_k, self.num_experts,
                                       self.capacity_factor)
            kept = kept[within_capacity(slot_expert, self.num_experts, capacity)]
        # Sorted by expert, the slots are sorted by owner: rank j's experts are contiguous.
        order = kept[torch.argsort(slot_expert[kept], stable=True)]  # [sent slots]
        send_counts = torch.bincount(slot_expert[order], minlength=self.num_experts)
        send_counts = send_counts.view(self.group.size, self.num_local)  # [owner, its expert]
        recv_counts = torch.empty_like(send_counts)  # [source, local expert]
        self.comm.all_to_all(recv_counts, send_counts, self.group, SPLITS_TAG)
        input_splits = send_counts.sum(1).tolist()
        output_splits = recv_counts.sum(1).tolist()
        rows = tokens[order // top_k]
        shared = None
        if self.overlap:  # the shared experts compute while the dispatch travels
            pending = _Pending()
            splits = (self._exchange, output_splits, input_splits)
            received = _DispatchIssue.apply(rows, pending, *splits)
            shared = self.shared(tokens)
            received = _DispatchWait.apply(received, pending, *splits)
        else:
            received = _AllToAll.apply(rows, self._exchange, output_splits, input_splits)
        # received: [received slots, hidden], by source, then expert
        outputs = self._run_experts(received, recv_counts)
        returned = _AllToAll.apply(outputs, self._exchange, input_splits, output_splits)
        contribution = returned * weights.reshape(-1)[order].unsqueeze(-1)  # [sent, hidden]
        out = torch.zeros_like(tokens).index_add(0, order // top_k, contribution)
        if self.shared is not None:
            out = out + (shared if shared is not None else self.shared(tokens))
        return out.view(shape), aux_loss

    def _run_experts(self, received: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Each source's rows come grouped by expert; gather every expert's rows from all
        sources, run the expert once, and put the outputs back in the received order."""
        local = torch.arange(self.num_local, device=received.device)
        row_expert = local.repeat(self.group.size).repeat_interleave(recv_counts.flatten())
        by_expert = torch.argsort(row_expert, stable=True)
        pieces = received[by_expert].split(recv_counts.sum(0).tolist())
        # An expert no row reached is skipped, as on one device: its gradient stays None. Its
        # empty piece takes the dtype the experts compute in (bf16 under autocast): an fp32 piece
        # would promote the rank's whole output, and the all-to-all sizes would disagree.
        device_type = received.device.type
        dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                 else received.dtype)
        outputs = torch.cat([expert(piece) if piece.shape[0] else piece.to(dtype)
                             for expert, piece in zip(self.experts.values(), pieces)])
        return outputs[torch.argsort(by_expert)]

    def _exchange(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                  async_op: bool = False):
        """The all-to-all of rows `x`; with `async_op` (output, Handle) without waiting."""
        out = x.new_empty((sum(output_splits), x.shape[1]))
        handle = self.comm.all_to_all(out, x.contiguous(), self.group, TOKENS_TAG,
                                      output_splits, input_splits, async_op)
        return (out, handle) if async_op else out


class ExpertParallel:
    """What expert parallelism did to a model, and the gradient handling the trainer calls."""

    def __init__(self, model: Transformer, mesh: Mesh, comm: Comm,
                 capacity_factor: float | None = None, layers: Iterable[int] | None = None,
                 overlap: bool = False):
        self.model, self.mesh, self.comm = model, mesh, comm
        self.layers: dict[int, ExpertParallelMoE] = {}
        kept = range(len(model.layers)) if layers is None else set(layers)
        for index, block in enumerate(model.layers):
            if block.is_moe and index in kept:
                block.mlp = ExpertParallelMoE(block.mlp, mesh["ep"], comm, capacity_factor,
                                              overlap)
                self.layers[index] = block.mlp

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's experts' parameters: reduced over edp by reduce_expert_gradients."""
        return [p for layer in self.layers.values() for p in layer.experts.parameters()]

    def reduce_expert_gradients(self) -> None:
        """After the last backward of a step: sum each expert gradient over its edp replicas,
        divide by dp*cp. A replica no token reached has a zero gradient here, not None."""
        size = self.mesh["dp_cp"].size
        for param in self.expert_parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self.comm.all_reduce(param.grad, self.mesh["edp"], "grads")
            param.grad /= size


def apply_expert_parallel(model: Transformer, mesh: Mesh, comm: Comm,
                          capacity_factor: float | None = None,
                          layers: Iterable[int] | None = None,
                          overlap: bool = False) -> ExpertParallel:
    """Keep this rank's experts of `model` (the full model, built with the same seed on every
    rank) and dispatch tokens to the others' over mesh["ep"]. capacity_factor None: dropless.
    `layers`: only these blocks (the ones a pipeline rank runs; None: all of them). `overlap`:
    the dispatch travels while the shared experts compute (forward and backward)."""
    check_expert_parallel(model.config, mesh.dims.ep, capacity_factor)
    return ExpertParallel(model, mesh, comm, capacity_factor, layers, overlap)
