"""ZeRO stages 1 and 2 (Rajbhandari et al., 2020), and the engine all sharded stages share.

Parameters sit in flat buckets (data_parallel.bucket_params); each rank owns 1/N of every bucket
and keeps fp32 master weights and AdamW moments for that slice only.

- ZeRO-1 shards the optimizer state. Gradients are full-size bucket buffers (.grad views, as in
  DDP); on the last microbatch each complete bucket is reduce-scattered in place, so this rank's
  slice holds the averaged gradient it needs (the rest of the buffer is scratch).
- ZeRO-2 shards the gradients too: a bucket's full gradient exists only while it is being filled
  and reduce-scattered, every microbatch (as DeepSpeed does: keeping full gradients across
  accumulation would undo the saving); the slices accumulate in a buffer of numel/N.

After the step each rank all-gathers the updated slices of every bucket. A reduce-scatter plus an
all-gather moves what one all-reduce moves, so ZeRO-1/2 cost DDP's 2(N-1)/N*Phi bytes per step.

Under a pipeline (`Pipelined`, ZeRO-2 only: ZeRO-1 just reduces after the step's last backward)
the backwards of the stages and microbatches interleave, so a bucket holds one stage's parameters
and the executor calls `after_stage_backward(stage)` once a stage's weight gradients of one
microbatch are complete (after B, or after W when zero bubble splits the backward); that stage's
buckets are then reduce-scattered into the accumulators. The memory stays ZeRO-2's (4Phi/N of the
rank's Phi, plus a bucket in flight) for one reduce-scatter of Phi per microbatch, as with
gradient accumulation. (torch.distributed.pipelining keeps FSDP's gradients whole for the step
and reduces once: M times less traffic, but the rank's whole gradient held all step.) A tied
embedding's two copies, on the first and the last pipeline rank, sit alone in a bucket each, laid
out alike, and their gradient shards are summed over the two ranks after the step's last
backward (on the last stage its gradient waits whole until the stage's backward ends, as its
bucket goes last).

Mixed precision: bf16/fp16 parameters and gradients, fp32 master weights; fp16 scales the loss
and skips a step whose gradients overflow. --contiguous-buffers: gradient buffers in one block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from tetrad.parallel.comm import Comm, Handle
from tetrad.parallel.data_parallel import (LaunchInOrder, bucket_params, broadcast_parameters,
                                           param_bytes)
from tetrad.parallel.engine import DEFAULT_BUCKET_BYTES, Counted, LossScaler, Placement
from tetrad.parallel.mesh import Group
from tetrad.parallel.offload import Offload
from tetrad.parallel.zero_optimizer import (FlatShard, ShardedAdamW, counted_segments,
                                            flat_buffers, nbytes, scatter_state, shard_pieces)
from tetrad.sharded_tensors import Piece
from tetrad.spec.runtime_rules import padded, stage_buckets

NORM_TAG = "grad_norm"


@dataclass(frozen=True)
class Pipelined:
    """The pipeline stages a ZeRO-2/3 engine serves: this rank's, by stage index
    (tetrad.parallel.pipeline.PipelineStage), and what it must know of their schedule."""

    stages: dict[int, nn.Module]
    split_backward: bool  # zero bubble: B computes only input gradients, W the weights'
    tied: nn.Parameter | None = None  # this rank's copy of a tied embedding
    embedding_group: Group | None = None  # the two ranks holding its copies

    def stage_params(self, held: list[nn.Parameter]) -> dict[int, list[nn.Parameter]]:
        """Each stage's parameters among `held` (those the engine shards: no experts)."""
        ids = {id(p) for p in held}
        return {index: [p for p in stage.parameters() if id(p) in ids]
                for index, stage in self.stages.items()}


class ShardedEngine:
    """The optimizer side of every ZeRO stage (tetrad.parallel.engine.DataParallelEngine): loss
    scaling, fp32 gradients of the shard, their part of the global norm and clipping, the sharded
    AdamW step, checkpoints, bytes held. A stage provides the shards, how gradients reach them,
    and what happens to parameters after the step."""

    def __init__(self, group: Group, comm: Comm, compute_dtype: torch.dtype,
                 offload: Offload | bool, betas: tuple[float, float], eps: float,
                 pipelined: Pipelined | None = None):
        self.group, self.comm = group, comm
        self.compute_dtype, self.offload = compute_dtype, Offload.coerce(offload)
        self.betas, self.eps = betas, eps
        self.pipelined = pipelined
        self.scaler = LossScaler() if compute_dtype == torch.float16 else None
        self.shards: list[FlatShard] = []
        self.optimizer: ShardedAdamW | None = None
        self._segments = None  # what of each flat shard this rank counts in the norm
        # Called with {id(param): grad} of a flat buffer just before it is reduce-scattered: tensor
        # parallelism sums there the gradients its ranks hold only part of (the sums commute).
        self.before_reduce: Callable[[dict[int, torch.Tensor]], None] | None = None

    # What a stage implements.
    def _grad_shards(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _param_shards(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _prepare_backward(self, is_last_microbatch: bool) -> None:
        raise NotImplementedError

    def _after_backward(self) -> None:
        raise NotImplementedError

    def _finish_reduction(self) -> None:
        raise NotImplementedError

    def _publish_params(self) -> None:
        raise NotImplementedError

    def _zero_grads(self) -> None:
        raise NotImplementedError

    def _device_bytes(self) -> dict[str, int]:
        raise NotImplementedError

    # Shared.
    def _init_optimizer(self, shard32s: list[torch.Tensor]) -> None:
        for index, (shard, shard32, param_shard) in enumerate(
                zip(self.shards, shard32s, self._param_shards())):
            shard.init_optimizer(shard32, param_shard, self.offload, f"shard{index}")
        self.optimizer = ShardedAdamW(self.shards, self.betas, self.eps, self.offload)

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        self._prepare_backward(is_last_microbatch)
        (loss * self.scaler.scale if self.scaler else loss).backward()
        self._after_backward()

    def reduce_gradients(self) -> None:
        """Averaged, unscaled fp32 gradients of this rank's shards."""
        self._finish_reduction()
        inv_scale = 1.0 / self.scaler.scale if self.scaler else None
        for shard, grad in zip(self.shards, self._grad_shards()):
            shard.set_main_grad(grad, inv_scale)

    def _prepare_reduce(self, shard: FlatShard, flat_grads: torch.Tensor) -> None:
        if self.before_reduce is not None:
            self.before_reduce(dict(zip(map(id, shard.params), shard.views(flat_grads))))

    def _sum_tied_gradient(self) -> None:
        """Pipelined, after the step's last backward: the gradient shards of the two copies of a
        tied embedding summed over their two ranks (each copy alone in a shard, laid out alike),
        what the executor does with the whole gradients when they are not sharded."""
        tied = self.pipelined and self.pipelined.tied
        if tied is None:
            return
        for shard, grad in zip(self.shards, self._grad_shards()):
            if len(shard.params) == 1 and shard.params[0] is tied:
                on_device = grad.to(tied.device)  # an offloaded shard: NCCL reduces on the GPU
                self.comm.all_reduce(on_device, self.pipelined.embedding_group, "grads")
                grad.copy_(on_device)

    def grad_square(self, counted: Counted) -> torch.Tensor:
        """Each dp x cp rank holds its own shard of the gradients: the squares of what this rank
        counts of them, summed over the group."""
        square = torch.zeros((), dtype=torch.float64, device=self._grad_shards()[0].device)
        if self._segments is None:
            self._segments = counted_segments(self.shards, counted)
        for shard, pieces in zip(self.shards, self._segments):
            for start, end, mask in pieces:
                grad = shard.main_grad[start:end]
                square += (grad if mask is None else grad[mask.to(grad.device)]
                           ).double().square().sum()
        square = square.to(self.shards[0].params[0].device)  # offloaded shards: from the host
        self.comm.all_reduce(square, self.group, NORM_TAG)
        return square

    def clip(self, coefficient: float) -> None:
        for shard in self.shards:
            shard.main_grad.mul_(coefficient)

    @torch.no_grad()
    def step(self, lr: float, grad_norm: float) -> bool:
        """Update the shards and republish the parameters. With fp16, a step whose gradients
        overflowed (a non-finite global norm) is skipped (False) and the loss scale backs off."""
        found_inf = not math.isfinite(grad_norm)
        if self.scaler is not None:
            self.scaler.update(found_inf)
            if found_inf:
                for shard in self.shards:
                    shard.main_grad = None
                self._zero_grads()
                return False
        self.optimizer.step(lr)
        for shard, param_shard in zip(self.shards, self._param_shards()):
            if shard.master is not param_shard:  # fp32 master -> compute dtype (host -> device)
                param_shard.copy_(shard.master)
        if self.offload.files is not None:
            self.offload.files.wait_written()  # the files hold this step before the next reads
        self._publish_params()
        self._zero_grads()
        return True

    def bytes_held(self) -> dict[str, int]:
        """Bytes of this rank's tensors by kind and place (Offload.place)."""
        optimizer = sum(s.optimizer_bytes(p) for s, p in zip(self.shards, self._param_shards()))
        fp32_grads = sum(nbytes(s.main_grad) for s, g in zip(self.shards, self._grad_shards())
                         if s.main_grad is not None and s.main_grad is not g
                         and s.host_grad is None)
        return self.offload.place(self._device_bytes(), optimizer, fp32_grads,
                                  sum(nbytes(s.host_grad) for s in self.shards))

    def pieces(self, kinds: tuple[str, ...], placement: Placement) -> list[Piece]:
        return shard_pieces(self.shards, kinds, placement)

    def optimizer_step(self) -> int:
        return self.optimizer.step_count

    @torch.no_grad()
    def load(self, params: Mapping[str, torch.Tensor], moments: dict | None,
             scaler: dict | None) -> None:
        """Whole tensors by parameter name (a checkpoint of any layout; see `pieces` for what a
        rank writes) into this rank's shards, looking up only what its ranges hold."""
        for shard, param_shard in zip(self.shards, self._param_shards()):
            scatter_state(shard, params, shard.master)
            if shard.master is not param_shard:
                param_shard.copy_(shard.master)
            if moments:
                scatter_state(shard, moments["exp_avg"], shard.exp_avg)
                scatter_state(shard, moments["exp_avg_sq"], shard.exp_avg_sq)
        if moments:
            self.optimizer.step_count = moments["step"]
        if self.scaler and scaler:
            self.scaler.load_state_dict(scaler)
        self._publish_params()


def named_decays(model: nn.Module, param_groups: list[dict]) -> dict[int, tuple[str, float]]:
    """id(parameter) -> (name, weight decay of its optimizer group)."""
    decay = {id(p): group["weight_decay"] for group in param_groups for p in group["params"]}
    return {id(p): (name, decay[id(p)]) for name, p in model.named_parameters()
            if p.requires_grad}


def stage_buckets_of(pipelined: Pipelined, params: list[nn.Parameter], bucket_bytes: int
                     ) -> dict[int, list[list[nn.Parameter]]]:
    """Per pipeline stage, the buckets of its parameters among `params`, a tied embedding in a
    bucket of its own, last (tetrad.spec.runtime_rules.stage_buckets, which the planner prices)."""
    return stage_buckets(pipelined.stage_params(params), lambda param: param is pipelined.tied,
                         param_bytes, bucket_bytes)


class ZeroDataParallel(ShardedEngine):
    """ZeRO stage 1 or 2 on a replicated model, or on a rank's pipeline stages (stage 2)."""

    def __init__(self, model: nn.Module, group: Group, comm: Comm, stage: int,
                 param_groups: list[dict], betas: tuple[float, float], eps: float,
                 compute_dtype: torch.dtype = torch.float32, offload: Offload | bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, pipelined: Pipelined | None = None,
                 contiguous: bool = False):
        assert stage in (1, 2) and (pipelined is None or stage == 2), (stage, pipelined)
        super().__init__(group, comm, compute_dtype, offload, betas, eps, pipelined)
        self.stage = stage
        broadcast_parameters(model, comm, group)
        names = named_decays(model, param_groups)
        params = [p for p in model.parameters() if p.requires_grad]
        stage_buckets = (stage_buckets_of(pipelined, params, bucket_bytes) if pipelined
                         else {0: bucket_params(params, bucket_bytes)})
        buckets = [bucket for per_stage in stage_buckets.values() for bucket in per_stage]
        self.flat_params: list[torch.Tensor] = []  # compute dtype [numel]; params are views
        self.param_shards: list[torch.Tensor] = []  # this rank's slice of each
        self.flat_grads: list[torch.Tensor | None] = []  # stage 1: always; stage 2: while filling
        self.grad_shards: list[torch.Tensor] = []
        self.handles: list[Handle] = []
        self.pending: list[int] = []  # stage 2: buckets whose reduce-scatter is in flight
        # ZeRO-1's whole gradient buckets, ZeRO-2's shards (--contiguous-buffers: one block).
        grad_buffers = iter(flat_buffers([padded(sum(p.numel() for p in b), group.size) // (
            1 if stage == 1 else group.size) for b in buckets], compute_dtype, params[0].device,
            contiguous))
        shard32s = []
        with torch.no_grad():
            for index, bucket in enumerate(buckets):
                shard = FlatShard.build([(*names[id(p)], p) for p in bucket], group)
                lo, hi = shard.shard_range
                flat32 = shard.flatten([p.detach() for p in bucket], torch.float32)
                shard32s.append(flat32[lo:hi].clone())
                flat = flat32.to(compute_dtype)
                for param, view, offset in zip(bucket, shard.views(flat), shard.offsets):
                    param.data = view
                    param.register_post_accumulate_grad_hook(self._hook(index, offset))
                self.shards.append(shard)
                self.flat_params.append(flat)
                self.param_shards.append(flat[lo:hi])
                grads = next(grad_buffers)
                if stage == 1:
                    for param, view in zip(bucket, shard.views(grads)):
                        param.grad = view
                self.flat_grads.append(grads if stage == 1 else None)
                self.grad_shards.append(grads[lo:hi] if stage == 1 else grads)
        self._init_optimizer(shard32s)
        # Buckets launch in order within each stage (one stage without a pipeline): per stage a
        # LaunchInOrder, and each bucket's place in it.
        self.orders: dict[int, LaunchInOrder] = {}
        self.places: list[tuple[LaunchInOrder, int]] = []
        first = 0
        for key, per_stage in stage_buckets.items():
            order = LaunchInOrder([len(b) for b in per_stage],
                                  lambda place, first=first: self._launch(first + place))
            self.orders[key] = order
            self.places += [(order, place) for place in range(len(per_stage))]
            first += len(per_stage)
        self._sync = pipelined is not None  # pipelined: every backward of a stage reduces

    def _param_shards(self) -> list[torch.Tensor]:
        return self.param_shards

    def _grad_shards(self) -> list[torch.Tensor]:
        return self.grad_shards

    def _hook(self, index: int, offset: int):
        def on_gradient_ready(param: nn.Parameter) -> None:
            if self.stage == 2:
                # Move the fresh gradient into the bucket being filled and drop it: a full-size
                # gradient must not outlive its bucket's reduce-scatter.
                shard = self.shards[index]
                if self.flat_grads[index] is None:
                    self.flat_grads[index] = torch.zeros(shard.numel, dtype=param.grad.dtype,
                                                         device=param.grad.device)
                self.flat_grads[index][offset:offset + param.numel()].copy_(param.grad.view(-1))
                param.grad = None
            if self._sync:
                order, place = self.places[index]
                order.arrived(place)
        return on_gradient_ready

    def _launch(self, index: int) -> None:
        if self.stage == 2:
            self._retire_pending()  # at most one bucket's full gradient in flight
            if self.flat_grads[index] is None:  # no parameter of it was used this microbatch
                self.flat_grads[index] = torch.zeros(self.shards[index].numel,
                                                     dtype=self.compute_dtype,
                                                     device=self.grad_shards[index].device)
            self.pending.append(index)
        grads = self.flat_grads[index]
        lo, hi = self.shards[index].shard_range
        self._prepare_reduce(self.shards[index], grads)
        grads.div_(self.group.size)
        self.handles.append(self.comm.reduce_scatter(grads[lo:hi], grads, self.group, "grads",
                                                     async_op=True))

    def _retire_pending(self) -> None:
        for handle in self.handles:
            handle.wait()
        self.handles = []
        for index in self.pending:
            lo, hi = self.shards[index].shard_range
            self.grad_shards[index].add_(self.flat_grads[index][lo:hi])
            self.flat_grads[index] = None
        self.pending = []

    def _prepare_backward(self, is_last_microbatch: bool) -> None:
        # ZeRO-2 reduces every microbatch; ZeRO-1 only the last (no_sync before it).
        self._sync = self.stage == 2 or is_last_microbatch

    def _after_backward(self) -> None:
        if self.stage == 2:
            self.after_stage_backward(0)
        elif self._sync:
            # ZeRO-1's last microbatch: a bucket holding a parameter this rank did not use (an
            # expert its tokens never chose) never completes. Start it now, before any other
            # collective (the loss mean), as the ranks that did complete it have.
            self.orders[0].flush()

    def after_stage_backward(self, stage: int) -> None:
        """ZeRO-2: one microbatch's gradients of `stage` (the whole model without a pipeline) are
        complete: reduce-scatter its buckets not yet launched (a parameter this microbatch did
        not use contributes zeros) and add every bucket's slice to the accumulators."""
        self.orders[stage].finish()
        self._retire_pending()

    def _finish_reduction(self) -> None:
        if self.stage == 2:
            # Every microbatch's reduce-scatter finished after its backward.
            self._sum_tied_gradient()
            return
        for order in self.orders.values():
            order.finish()
        for handle in self.handles:
            handle.wait()
        self.handles = []
        self._sync = False

    def _publish_params(self) -> None:
        handles = [self.comm.all_gather(flat, piece, self.group, "params", async_op=True)
                   for flat, piece in zip(self.flat_params, self._param_shards())]
        for handle in handles:
            handle.wait()

    def _zero_grads(self) -> None:
        for grads in (self.flat_grads if self.stage == 1 else self.grad_shards):
            grads.zero_()

    def _device_bytes(self) -> dict[str, int]:
        return {"params": sum(nbytes(f) for f in self.flat_params),
                "grads": sum(nbytes(g) for g in (self.flat_grads if self.stage == 1
                                                   else self.grad_shards))}
