"""The communication operators of tensor and sequence parallelism, as autograd functions named
after the papers (Megatron-LM, Shoeybi et al. 2019; sequence parallelism, Korthikanti et al.
2022). [b, s, h] = [batch, seq, hidden]; the sequence is split along dim 1.

  f          identity forward, all-reduce backward: into a column-parallel layer
  g          all-reduce forward, identity backward: out of a row-parallel layer
  g_seq      all-gather forward, reduce-scatter backward (along the sequence): replaces f under SP
  g_bar_seq  reduce-scatter forward, all-gather backward: replaces g under SP

An MoE layer kept whole under SP uses the replicated-consumer pair: GatherFromSequence without
reducing the gradient (all-gather forward, keep the shard backward) and ScatterToSequence (keep the
shard forward, all-gather backward). Every collective goes through Comm, so its bytes are counted
(tag "activations").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tetrad.models.moe import MoE
from tetrad.parallel.comm import Comm
from tetrad.parallel.mesh import Group

ACTIVATION_TAG = "activations"  # the operators' traffic; the loss uses "loss", finish "grads"


@dataclass(frozen=True)
class TensorParallel:
    """The tp group one rank works in, the Comm that counts its traffic, whether the space
    between the parallel layers is sequence-parallel, and whether the parallel layers overlap
    their collectives with their matmuls (tetrad.parallel.tp_overlap)."""

    group: Group
    comm: Comm
    sequence_parallel: bool = False
    overlap: bool = False

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def index(self) -> int:
        return self.group.index

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a column-parallel layer: f, or g_seq ([b, s/tp, h] -> [b, s, h])."""
        return g_seq(x, self) if self.sequence_parallel else f(x, self)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Out of a row-parallel layer (partial sums): g, or g_bar_seq ([b, s, h] ->
        [b, s/tp, h])."""
        return g_bar_seq(x, self) if self.sequence_parallel else g(x, self)

    def sequence_shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous piece of the sequence (no communication)."""
        return x.chunk(self.size, dim=dim)[self.index]


# The operators. Collectives write into fresh buffers: the tensors handed in may be saved for
# backward by someone else. Activations are batch-first, so a sequence chunk is not contiguous in
# memory: gather and scatter go through a [tp, b, s/tp, h] buffer and a copy (Megatron keeps
# [s, b, h] activations to avoid it).

def _all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    tp.comm.all_reduce(out, tp.group, ACTIVATION_TAG)
    return out


def _all_gather_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    x = x.contiguous()
    pieces = x.new_empty((tp.size, *x.shape))  # [tp, b, s/tp, h]: rank r's shard at r
    tp.comm.all_gather(pieces.view(-1), x.view(-1), tp.group, ACTIVATION_TAG)
    return torch.cat(pieces.unbind(0), dim=1)  # [b, s, h]


def _reduce_scatter_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    chunks = torch.stack(x.chunk(tp.size, dim=1))  # [tp, b, s/tp, h]: rank r's chunk at r
    out = x.new_empty(chunks.shape[1:])
    tp.comm.reduce_scatter(out.view(-1), chunks.view(-1), tp.group, ACTIVATION_TAG)
    return out


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: each rank's layer reads the same input, so the input's gradient is the sum
    of every rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.tp), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: sums the partial products of a row-parallel layer; every rank then holds the
    same output, whose gradient each rank already has whole."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class GatherFromSequence(torch.autograd.Function):
    """The SP paper's g: all-gather the sequence shards. With `reduce_grad` the gradient is
    reduce-scattered (ranks consume the gathered tensor in different parts, as a column-parallel
    layer does); without, each rank keeps its shard of a gradient that is already whole on every
    rank (the consumer computed the same thing everywhere: a whole MoE layer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel, reduce_grad: bool) -> torch.Tensor:
        ctx.tp, ctx.reduce_grad = tp, reduce_grad
        return _all_gather_sequence(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce_grad:
            return _reduce_scatter_sequence(grad, ctx.tp), None, None
        return ctx.tp.sequence_shard(grad).contiguous(), None, None


class ReduceScatterToSequence(torch.autograd.Function):
    """The SP paper's g-bar: sum the partial products and keep this rank's sequence shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return _reduce_scatter_sequence(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_sequence(grad, ctx.tp), None


class ScatterToSequence(torch.autograd.Function):
    """Keep this rank's shard of a tensor every rank holds whole; the gradient is gathered so that
    whatever made the tensor gets the whole gradient on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return tp.sequence_shard(x).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_sequence(grad, ctx.tp), None


# The papers' names for the four operators of the layers.

def f(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return CopyToTensorParallel.apply(x, tp)


def g(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return ReduceFromTensorParallel.apply(x, tp)


def g_seq(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return GatherFromSequence.apply(x, tp, True)


def g_bar_seq(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return ReduceScatterToSequence.apply(x, tp)


def keep_moe_whole(moe: MoE, tp: TensorParallel) -> None:
    """An MoE layer under sequence parallelism, its experts kept whole: hooks around its forward
    gather the sequence first (every tp rank routes every token through whole experts, the same
    computation everywhere) and keep this rank's shard of the output. Backward gathers the output
    gradient, so the router's and experts' gradients are whole and equal on every rank, and keeps
    the shard of the input gradient. Hooks leave the module (and whatever else wraps it) as it is.
    Without SP nothing is needed: the input is already the same on every rank."""

    def gather(module: nn.Module, args: tuple) -> tuple:
        return (GatherFromSequence.apply(args[0], tp, False), *args[1:])

    def keep_shard(module: nn.Module, args: tuple, output: tuple) -> tuple:
        out, aux_loss = output
        return ScatterToSequence.apply(out, tp), aux_loss

    moe.register_forward_pre_hook(gather)
    moe.register_forward_hook(keep_shard)
