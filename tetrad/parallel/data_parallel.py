"""Data parallelism, ZeRO stage 0 (DDP): every rank holds the whole model and optimizer, and the
gradients are averaged over the data-parallel group before the step.

Gradients live in a few flat buckets (parameters in reverse registration order, the order
backward tends to produce them), and each parameter's .grad is a view into its bucket, so autograd
accumulates straight into the buffer that gets all-reduced (torch DDP's gradient_as_bucket_view).
A post-accumulate-grad hook counts the parameters of a bucket whose gradient is final; when the
last one arrives the bucket's all-reduce starts asynchronously while backward goes on with the
earlier layers. Only the last microbatch of a step communicates: the others just accumulate
locally (DDP's no_sync). The optimizer is torch's AdamW over the whole parameters
(engine.WholeAdamW); with fp16 the loss is scaled, and a step whose global gradient norm is
inf/nan is skipped on every rank.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch
from torch import nn
from torch.autograd import Variable

from tetrad.parallel.comm import Comm, Handle
from tetrad.parallel.engine import (Counted, DataParallelOptions, LossScaler, ParameterView,
                                    Placement, WholeAdamW)
from tetrad.parallel.mesh import Group
from tetrad.sharded_tensors import Piece
from tetrad.spec.runtime_rules import ddp_buckets, fill_buckets


def bucket_params(params: list[nn.Parameter], bucket_bytes: int,
                  first_bucket_bytes: int | None = None) -> list[list[nn.Parameter]]:
    """The parameters' gradient buckets by the runtime rule the planner prices
    (tetrad.spec.runtime_rules.fill_buckets), sized by the parameters' own bytes."""
    return fill_buckets(params, param_bytes, bucket_bytes, first_bucket_bytes)


def param_bytes(param: nn.Parameter) -> int:
    return param.numel() * param.element_size()


class LaunchInOrder:
    """Counts the gradients that arrive for each bucket and starts a bucket's collective once it
    is complete *and* every earlier bucket has started. Ranks must issue collectives in the same
    order; arrival order can differ between ranks (a parameter unused on one rank never
    arrives), bucket order cannot. `flush()` starts whatever is left, in order (`finish()` also
    starts counting the next backward afresh)."""

    def __init__(self, sizes: list[int], launch: Callable[[int], None]):
        self.sizes, self.launch = sizes, launch
        self.counts = [0] * len(sizes)
        self.next = 0

    def arrived(self, bucket: int) -> None:
        self.counts[bucket] += 1
        while self.next < len(self.sizes) and self.counts[self.next] == self.sizes[self.next]:
            self.next += 1
            self.launch(self.next - 1)

    def flush(self) -> None:
        while self.next < len(self.sizes):
            self.next += 1
            self.launch(self.next - 1)

    def finish(self) -> None:
        """Start whatever is left, in order, and begin counting the next backward."""
        self.flush()
        self.counts = [0] * len(self.sizes)
        self.next = 0


@torch.no_grad()
def broadcast_parameters(model: nn.Module, comm: Comm, group: Group,
                         scattered: frozenset[int] = frozenset()) -> None:
    """Start every replica from rank 0's weights (whatever each process's seed did); the
    parameters whose ids are in `scattered` reach their ranks as shards instead (ZeRO-3)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in scattered:
            comm.broadcast(tensor.data, 0, group, "setup")


class DataParallel:
    """Bucketed, overlapped gradient all-reduce for replicated parameters (ZeRO-0), and their
    whole AdamW: after `finish()` every .grad holds the average over the group."""

    def __init__(self, named: dict[str, nn.Parameter], group: Group, comm: Comm,
                 options: DataParallelOptions):
        self.group, self.comm = group, comm
        broadcast_parameters(ParameterView(named), comm, group)
        self.adamw = WholeAdamW(named, options, group)
        self.scaler = LossScaler() if options.compute_dtype == torch.float16 else None
        params = [p for p in named.values() if p.requires_grad]
        self.buckets = ddp_buckets(params, param_bytes, options.bucket_bytes)
        self.grads: list[torch.Tensor] = []
        self.handles: list[Handle] = []
        self.order = LaunchInOrder([len(b) for b in self.buckets], self._launch)
        self._sync = self._flush_queued = False
        # Called with {id(param): grad} of a bucket just before it is reduced: tensor parallelism
        # sums there the gradients its ranks hold only part of (the two sums commute).
        self.before_reduce: Callable[[dict[int, torch.Tensor]], None] | None = None
        for index, bucket in enumerate(self.buckets):
            grad = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype,
                               device=bucket[0].device)
            self.grads.append(grad)
            offset = 0
            for param in bucket:
                param.grad = grad[offset:offset + param.numel()].view_as(param)
                param.register_post_accumulate_grad_hook(self._hook(index))
                offset += param.numel()

    def _hook(self, index: int):
        def on_gradient_ready(param: nn.Parameter) -> None:
            if self._sync:  # otherwise not the last microbatch: keep accumulating locally
                if not self._flush_queued:
                    # A bucket holding a parameter this rank did not use (an expert no token
                    # chose) never completes: start it when backward ends, before any other
                    # collective (the loss mean), as the ranks that did complete it have.
                    Variable._execution_engine.queue_callback(self.order.flush)
                    self._flush_queued = True
                self.order.arrived(index)
        return on_gradient_ready

    def _launch(self, index: int) -> None:
        if self.before_reduce is not None:
            self.before_reduce({id(p): p.grad for p in self.buckets[index]})
        grad = self.grads[index]
        # Average = sum of (grad / N): dividing first keeps fp16 sums in range.
        grad.div_(self.group.size)
        self.handles.append(self.comm.all_reduce(grad, self.group, "grads", async_op=True))

    def prepare_backward(self, is_last_microbatch: bool) -> None:
        self._sync = is_last_microbatch

    def finish(self) -> None:
        """Wait for every bucket. One whose parameters got no gradient this step (unused) is
        reduced now, so every rank ends with the same averaged gradients."""
        self.order.finish()
        for handle in self.handles:
            handle.wait()
        self.handles = []
        self._sync = self._flush_queued = False

    def zero_grad(self) -> None:
        """In place: the .grad views must keep pointing into the buckets."""
        for grad in self.grads:
            grad.zero_()

    # The engine interface (tetrad.parallel.engine.DataParallelEngine).

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        self.prepare_backward(is_last_microbatch)
        (loss * self.scaler.scale if self.scaler else loss).backward()

    def reduce_gradients(self) -> None:
        self.finish()
        if self.scaler:
            self.adamw.unscale(self.scaler.scale)

    def grad_square(self, counted: Counted) -> torch.Tensor:
        """Every replica holds the same averaged gradients: nothing to send."""
        return self.adamw.grad_square(counted, self.grads[0].device)

    def clip(self, coefficient: float) -> None:
        self.adamw.clip(coefficient)

    def step(self, lr: float, grad_norm: float) -> bool:
        applied = math.isfinite(grad_norm)  # a global norm: every rank decides alike
        if self.scaler:
            self.scaler.update(found_inf=not applied)
        if applied:
            self.adamw.step(lr)
        self.zero_grad()
        return applied

    def pieces(self, kinds: tuple[str, ...], placement: Placement) -> list[Piece]:
        return self.adamw.pieces(kinds, placement)

    def load(self, params: Mapping[str, torch.Tensor], moments: dict | None,
             scaler: dict | None) -> None:
        self.adamw.load(params, moments)
        if self.scaler and scaler:
            self.scaler.load_state_dict(scaler)

    def optimizer_step(self) -> int:
        return self.adamw.optimizer_step()

    def bytes_held(self) -> dict[str, int]:
        return self.adamw.bytes_held()
