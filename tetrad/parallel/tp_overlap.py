"""Tensor- and sequence-parallel matmuls with their communication overlapped (ParallelConfig
`overlap`, on by default with NCCL): each collective is cut into row chunks and issued asynchronously, so
the collective of one chunk runs while the matmul of another computes (the chunked pipelining
Megatron-LM and TransformerEngine use; the "collective matmul" of Wang et al. 2023).

A layer's rows are this rank's tokens, flattened: [b * s / tp, h] under sequence parallelism,
[b * s, h] otherwise, cut into CHUNKS row ranges (fewer when there are fewer rows). Every rank
cuts alike, so chunk i of an all-gather brings chunk i of every rank's shard, [tp, rows, h]
(rank-major, the global sequence order up to a transpose done once per layer).

  column-parallel (f / g_seq)   forward: SP issues every chunk's all-gather, then waits for
                                chunk i and multiplies it while the later ones travel; without
                                SP nothing to send. Backward: the input gradient chunk by chunk,
                                each reduce-scattered (SP) or all-reduced as soon as it is
                                computed, the weight gradient while the last ones travel.
  row-parallel (g / g_bar_seq)  forward: the partial product chunk by chunk, each
                                reduce-scattered (SP) or all-reduced while the next computes.
                                Backward: SP issues every chunk's all-gather of the output
                                gradient, then computes chunk i's input and weight gradients
                                while the later ones travel; without SP nothing to send.

The same collectives on the same bytes as the unchunked operators of tetrad.parallel.tp_operators
(a collective's ring volume is linear in its size, so the chunks' counts add up to the whole), and
the same tensors saved for backward: the matmul input in the compute dtype (gathered under SP)
and, under autocast, the weight's copy in it. The autograd functions cast by hand as autocast
would (input and weight to the compute dtype, gradients back to their dtypes). One difference
in traffic: a custom function's saved tensors are packed when its forward returns, so full
recomputation, which stops at a block's last saved tensor, reruns the MLP's closing collective
too (F.linear's saved input stops it before; tetrad.planner.eager_comm counts both).
`ParallelConfig(overlap=False)` keeps the unchunked operators (the benchmark's baseline, and a
fallback).
"""

from __future__ import annotations

import torch

from tetrad.parallel.comm import Handle
from tetrad.parallel.tp_operators import ACTIVATION_TAG, TensorParallel
# The planner's overlap model (tetrad.planner.eager_overlap) prices the same number.
from tetrad.spec.runtime_rules import TP_OVERLAP_CHUNKS as CHUNKS


def row_chunks(rows: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of `rows` (as even as can be; none empty)."""
    count = max(1, min(CHUNKS, rows))
    bounds = [rows * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute `x` in: autocast's, else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _start_gathers(local: torch.Tensor, tp: TensorParallel):
    """Issue the all-gather of every chunk of this rank's rows `local` [n, d] at once: (the
    chunks, their [tp, rows, d] buffers, the handles to wait for before reading each)."""
    chunks = row_chunks(local.shape[0])
    gathered = [local.new_empty((tp.size, stop - start, local.shape[1])) for start, stop in chunks]
    handles = [tp.comm.all_gather(buffer.view(-1), local[start:stop].view(-1), tp.group,
                                  ACTIVATION_TAG, async_op=True)
               for buffer, (start, stop) in zip(gathered, chunks)]
    return chunks, gathered, handles


def _sum_rows(part: torch.Tensor, out: torch.Tensor, tp: TensorParallel) -> Handle:
    """Start summing partial rows over the tp group into `out` (contiguous): under SP `part` is
    [tp, rows, d] and this rank keeps its rows (reduce-scatter), else [rows, d], all kept."""
    if tp.sequence_parallel:
        return tp.comm.reduce_scatter(out.view(-1), part.view(-1), tp.group, ACTIVATION_TAG,
                                      async_op=True)
    return tp.comm.all_reduce(out.copy_(part), tp.group, ACTIVATION_TAG, async_op=True)


def _wait(handles: list[Handle]) -> None:
    for handle in handles:
        handle.wait()


def rank_major(x: torch.Tensor, tp: int) -> torch.Tensor:
    """[b, s, d] in sequence order -> [tp, b * s / tp, d]: rank r's rows at r (a copy)."""
    b, s, d = x.shape
    return x.reshape(b, tp, s // tp, d).transpose(0, 1).reshape(tp, b * s // tp, d)


def sequence_order(x: torch.Tensor, batch: int) -> torch.Tensor:
    """rank_major's inverse: [tp, b * s / tp, d] -> [b, s, d]."""
    tp, rows, d = x.shape
    return x.view(tp, batch, rows // batch, d).transpose(0, 1).reshape(batch, -1, d)


class OverlappedColumnLinear(torch.autograd.Function):
    """F.linear(enter(x), weight, bias) with enter's collectives chunked and overlapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tp: TensorParallel) -> torch.Tensor:
        dtype = compute_dtype(x)
        ctx.tp, ctx.x_shape, ctx.x_dtype, ctx.has_bias = tp, x.shape, x.dtype, bias is not None
        ctx.weight_dtype = weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            if not tp.sequence_parallel:
                inputs = x.to(dtype)
                ctx.save_for_backward(w, inputs)
                return torch.nn.functional.linear(inputs, w, b)
            local = x.contiguous().view(-1, x.shape[-1])  # this rank's rows [n, h]
            chunks, gathered, handles = _start_gathers(local, tp)
            out = local.new_empty((tp.size, local.shape[0], weight.shape[0]), dtype=dtype)
            inputs = []
            for buffer, handle, (start, stop) in zip(gathered, handles, chunks):
                handle.wait()  # the later chunks are still on their way
                inputs.append(buffer.to(dtype))
                out[:, start:stop] = torch.nn.functional.linear(inputs[-1], w, b)
            ctx.save_for_backward(w, *inputs)
            return sequence_order(out, x.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tp = ctx.tp
        w, *inputs = ctx.saved_tensors
        h = w.shape[1]
        with torch.autocast(grad.device.type, enabled=False):
            grad = grad.to(w.dtype)
            if tp.sequence_parallel:
                grad_rows = rank_major(grad, tp.size)  # [tp, n, o]
                inputs_rows = torch.cat(inputs, dim=1)  # [tp, n, h]
            else:
                grad_rows = grad.reshape(-1, grad.shape[-1])  # [n, o]
                inputs_rows = inputs[0].reshape(-1, h)
            rows = grad_rows.shape[-2]
            grad_x, handles, parts = None, [], []
            if ctx.needs_input_grad[0]:
                grad_x = grad.new_empty((rows, h), dtype=ctx.x_dtype)
                for start, stop in row_chunks(rows):
                    parts.append((grad_rows[..., start:stop, :] @ w).to(ctx.x_dtype)
                                 .contiguous())
                    handles.append(_sum_rows(parts[-1], grad_x[start:stop], tp))
            # While the last chunks travel: the weight's and the bias's gradients.
            flat_grad = grad_rows.reshape(-1, grad_rows.shape[-1])
            grad_w = (flat_grad.t() @ inputs_rows.reshape(-1, h)).to(ctx.weight_dtype)
            grad_b = flat_grad.sum(0).to(ctx.weight_dtype) if ctx.has_bias else None
            _wait(handles)
        return (None if grad_x is None else grad_x.view(ctx.x_shape)), grad_w, grad_b, None


class OverlappedRowLinear(torch.autograd.Function):
    """leave(F.linear(x, weight)) with leave's collectives chunked and overlapped (the bias is
    added by the caller, after the sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        dtype = compute_dtype(x)
        ctx.tp, ctx.x_dtype, ctx.weight_dtype = tp, x.dtype, weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            inputs, w = x.to(dtype), weight.to(dtype)
            ctx.save_for_backward(w, inputs)
            batch, out_features = x.shape[0], weight.shape[0]
            if tp.sequence_parallel:
                rows = rank_major(inputs, tp.size)  # [tp, n, f]
                out = inputs.new_empty((rows.shape[1], out_features))
            else:
                rows = inputs.reshape(-1, inputs.shape[-1])  # [n, f]
                out = inputs.new_empty((rows.shape[0], out_features))
            handles, parts = [], []  # parts stay alive until their collectives are done
            for start, stop in row_chunks(out.shape[0]):
                parts.append(rows[..., start:stop, :] @ w.t())
                handles.append(_sum_rows(parts[-1], out[start:stop], tp))
            _wait(handles)
            return out.view(batch, -1, out_features)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tp = ctx.tp
        w, inputs = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            grad = grad.to(w.dtype)
            if not tp.sequence_parallel:
                grad_rows = grad.reshape(-1, grad.shape[-1])
                grad_x = (grad @ w).to(ctx.x_dtype)
                grad_w = grad_rows.t() @ inputs.reshape(-1, inputs.shape[-1])
                return grad_x, grad_w.to(ctx.weight_dtype), None
            local = grad.contiguous().view(-1, grad.shape[-1])  # this rank's rows [n, o]
            chunks, gathered, handles = _start_gathers(local, tp)
            rows = rank_major(inputs, tp.size)  # [tp, n, f], while the gathers travel
            grad_rows = torch.empty_like(rows)
            grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            for buffer, handle, (start, stop) in zip(gathered, handles, chunks):
                handle.wait()
                grad_rows[:, start:stop] = buffer @ w
                grad_w += (buffer.reshape(-1, buffer.shape[-1]).t()
                           @ rows[:, start:stop].reshape(-1, rows.shape[-1])).float()
            grad_x = sequence_order(grad_rows, inputs.shape[0]).to(ctx.x_dtype)
        return grad_x, grad_w.to(ctx.weight_dtype), None
