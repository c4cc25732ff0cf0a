"""ZeRO-3 / FSDP: parameters sharded too. Each rank keeps 1/N of every unit (the embedding, each
transformer layer, the final norm + head) and materializes a whole unit only while it computes:

    forward:  all-gather unit k just before its forward (and start gathering unit k+1: prefetch),
              free it right after;
    backward: all-gather it again when the gradient reaches its output (prefetch unit k-1), and
              when the gradient has gone through it to its input, reduce-scatter its parameters'
              gradients into this rank's gradient shard and free the unit.

Every collective fires at a point of the graph that exists on every rank (a unit's output, a
unit's input, the end of backward), never on "all gradients of the unit arrived": with MoE an
expert may get no tokens on one rank, and collectives issued in a different order on different
ranks pair up wrong. A parameter without a gradient contributes zeros. Units whose input needs
no gradient (the embedding) reduce at the end of backward.

A unit's whole parameters live in one flat buffer whose storage is resized to zero when freed and
back when gathered; the parameters stay views of it, so autograd's saved references see the
refilled data in backward (FSDP2's technique). Per microbatch the traffic is two all-gathers and
one reduce-scatter of the model: 3(N-1)/N*Phi bytes, 1.5x DDP's all-reduce.

Under a pipeline (zero.Pipelined) the same happens per (stage, microbatch), with each stage's
units (`stage_units`) and prefetching within a stage only: every forward and backward of a stage
gathers its units one at a time, and the executor's `after_stage_backward(stage)` (after B, or
after W when zero bubble splits the backward) reduce-scatters the units no input gradient reached
and frees them all. Memory stays ZeRO-3's (4Phi/N of the rank's Phi for parameters and for
gradients, plus the live units); traffic is ZeRO-3's with M microbatches, 3(N-1)/N*Phi each.
Keeping a stage gathered for the step (torchtitan turns reshard_after_forward off under a
pipeline) would send M times less but hold the rank's whole parameters and gradients all step.
A split backward gathers once more per microbatch: B (input gradients only) frees each unit once
the gradient has gone through it and reduces nothing; W gathers the units again and computes the
stage's weight gradients in one autograd call, reduce-scattered after it unit by unit (so the
stage's whole weight gradient exists at the end of W). The first stage's B computes nothing (its
input is token ids), so it gathers twice per microbatch. A tied embedding is a unit of its own on
both of its ranks, its gradient shards summed over the two after the step's last backward.

`--zero-bucket-size` moves every gather and reduce-scatter through two buffers of constant size
instead (zero_buckets.py: ZeRO-R's constant-size buffers), a unit a piece at a time.

The optimizer side (fp32 master shards, host offload, loss scaling, clipping, checkpoints) is the
ShardedEngine of ZeRO-1/2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tetrad.parallel.comm import Comm, Handle
from tetrad.parallel.data_parallel import broadcast_parameters
from tetrad.parallel.mesh import Group
from tetrad.parallel.offload import Offload, ShardStaging
from tetrad.parallel.zero import Pipelined, ShardedEngine, named_decays
from tetrad.parallel.zero_buckets import ZeroBuckets
from tetrad.parallel.zero_optimizer import FlatShard, flat_buffers, nbytes
from tetrad.spec.runtime_rules import padded

SHARDED, GATHERING, GATHERED = "sharded", "gathering", "gathered"


def transformer_units(model: nn.Module) -> list[tuple[list[nn.Module], list[nn.Parameter]]]:
    """(modules, parameters) of each unit in forward order. With tied embeddings the embedding
    matrix is also the output projection, so embedding, final norm and head form one root unit
    around the whole forward (FSDP's root), gathered from the first layer to the last."""
    layers = [([layer], list(layer.parameters())) for layer in model.layers]
    embeds = [m for m in (model.embed, model.pos_embed) if m is not None]
    if model.lm_head is None:
        root = [p for m in (*embeds, model.norm) for p in m.parameters()]
        return [([model], root), *layers]
    return [(embeds, [p for m in embeds for p in m.parameters()]), *layers,
            ([model.norm, model.lm_head],
             [p for m in (model.norm, model.lm_head) for p in m.parameters()])]


def stage_units(stage: nn.Module) -> list[tuple[list[nn.Module], list[nn.Parameter]]]:
    """(modules, parameters) of each unit of a pipeline stage (PipelineStage) in forward order:
    its embedding, its layers, its final norm and head. A tied embedding is a unit of its own on
    both of its stages (the first and the last: its two copies then shard alike); on the last
    stage the head multiplies by it inside the stage's own forward, so that unit is gathered
    around the whole stage forward (FSDP's root)."""
    units = [([layer], list(layer.parameters())) for layer in stage.layers.values()]
    tied = stage.config.tie_embeddings
    if stage.is_first:
        embeds = [m for m in (stage.embed, stage.pos_embed) if m is not None]
        units[:0] = ([([m], list(m.parameters())) for m in embeds] if tied else
                     [(embeds, [p for m in embeds for p in m.parameters()])])
    if stage.is_last:
        head = [stage.norm] if tied else [stage.norm, stage.lm_head]
        units.append((head, [p for m in head for p in m.parameters()]))
        if tied:
            units.insert(0, ([stage], [stage.embed.weight]))
    return units


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs `callback` once the gradient has passed
    through the whole unit (its parameters' gradients are accumulated by then: autograd runs
    gradient accumulation as soon as it is ready, before the nodes further down the graph)."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


@dataclass
class Unit:
    index: int
    shard: FlatShard
    full: torch.Tensor  # compute dtype [numel]; parameters are views; storage 0 while sharded
    param_shard: torch.Tensor  # [numel / N]
    grad_shard: torch.Tensor  # [numel / N], accumulated over microbatches
    state: str = SHARDED
    handle: Handle | None = None
    reduced: bool = False  # this microbatch's gradients are on their way to the shard
    stage: int = 0  # the pipeline stage it belongs to (0 without a pipeline)
    hooks: list = field(default_factory=list)


class FullyShardedDataParallel(ShardedEngine):
    """ZeRO stage 3 of `model`, in place: its parameters become views of per-unit buffers."""

    def __init__(self, model: nn.Module, group: Group, comm: Comm, param_groups: list[dict],
                 betas: tuple[float, float], eps: float,
                 compute_dtype: torch.dtype = torch.float32, offload: Offload | bool = False,
                 units: list[tuple[list[nn.Module], list[nn.Parameter]]] | None = None,
                 pipelined: Pipelined | None = None, bucket_elements: int = 0,
                 contiguous: bool = False):
        super().__init__(group, comm, compute_dtype, offload, betas, eps, pipelined)
        names = named_decays(model, param_groups)
        self.units: list[Unit] = []
        self.live_bytes = self.peak_live_bytes = 0
        self.pending: tuple[Unit, torch.Tensor, Handle] | None = None
        self.split_backward = pipelined is not None and pipelined.split_backward
        if pipelined is None:
            staged = [(0, modules, params)
                      for modules, params in units or transformer_units(model)]
        else:  # without the parameters the engine does not shard (experts)
            held = {id(p) for p in model.parameters()}
            staged = [(index, modules, [p for p in params if id(p) in held])
                      for index, stage in pipelined.stages.items()
                      for modules, params in stage_units(stage)]
        # Each rank needs only its shard of rank 0's sharded parameters: scattered below.
        broadcast_parameters(model, comm, group, frozenset(
            id(p) for _, _, params in staged for p in params if p.requires_grad))
        shard_numels = [padded(sum(p.numel() for p in params if p.requires_grad), group.size)
                        // group.size for _, _, params in staged]
        device = next(p.device for _, _, params in staged for p in params)
        # --contiguous-buffers: every unit's gradient shard a slice of one block.
        grad_shards = iter(flat_buffers(shard_numels, compute_dtype,
                                        None if self.offload.params else device, contiguous))
        # --zero-bucket-size: gathers and reduce-scatters through two buffers of that size.
        self.bucketed = (ZeroBuckets(comm, group, bucket_elements, shard_numels, compute_dtype,
                                    device) if bucket_elements else None)
        # --offload params without buckets: each shard crosses through one reused buffer a side.
        self.staging = (ShardStaging(max(shard_numels), compute_dtype, device)
                        if self.offload.params and self.bucketed is None else None)
        shard32s = []
        with torch.no_grad():
            for stage, modules, params in staged:
                shard = FlatShard.build([(*names[id(p)], p) for p in params if p.requires_grad],
                                        group)
                lo, hi = shard.shard_range
                flat32 = shard.flatten([p.detach() for p in shard.params], torch.float32)
                own = torch.empty(hi - lo, dtype=torch.float32, device=flat32.device)
                comm.scatter(own, flat32 if group.index == 0 else None, 0, group, "setup")
                flat32[lo:hi] = own  # the rest of this rank's copy is freed unread below
                shard32s.append(flat32[lo:hi].clone())
                full = flat32.to(compute_dtype, copy=True)
                index = len(self.units)
                param_shard = (self.offload.keep(f"unit{index}.params", full[lo:hi])
                               if self.offload.params else full[lo:hi].clone())
                unit = Unit(index, shard, full, param_shard, next(grad_shards), stage=stage)
                for param, view in zip(shard.params, shard.views(full)):
                    param.data = view
                self._hook_modules(unit, modules)
                full.untyped_storage().resize_(0)
                self.units.append(unit)
                self.shards.append(shard)
        self._init_optimizer(shard32s)

    def _param_shards(self) -> list[torch.Tensor]:
        return [unit.param_shard for unit in self.units]

    def _grad_shards(self) -> list[torch.Tensor]:
        return [unit.grad_shard for unit in self.units]

    # Gathering and freeing.
    def _start_gather(self, unit: Unit) -> None:
        if unit.state != SHARDED:
            return
        unit.full.untyped_storage().resize_(nbytes(unit.full))
        source = unit.param_shard
        if self.offload.files is not None:  # the unit after it, in this pass's direction
            following = self._neighbour(unit, -1 if in_backward() else 1)
            self.offload.files.read_ahead([following.param_shard] if following else [])
        if self.bucketed is not None:
            unit.handle = self.bucketed.gather(unit.shard, unit.full, source, unit)
        else:
            if self.staging is not None:  # host -> device, held until the gather is done
                holder = self.staging.holder
                if holder is not None and holder.state == GATHERING:
                    self._gathered(holder)  # its gather still reads the staging buffer
                source = self.staging.to_device(unit.param_shard, unit)
            # The collective writes into storage autograd saved for backward; that is intended
            # (the data is the same weights), so keep the version counter from flagging it.
            with torch.autograd._unsafe_preserve_version_counter(unit.full):
                unit.handle = self.comm.all_gather(unit.full, source, self.group, "params",
                                                   async_op=True)
        unit.state = GATHERING
        self.live_bytes += nbytes(unit.full)
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def _gathered(self, unit: Unit) -> None:
        self._start_gather(unit)
        if unit.state == GATHERING:
            unit.handle.wait()
            unit.handle, unit.state = None, GATHERED

    def _free(self, unit: Unit) -> None:
        if unit.state == SHARDED:
            return
        if unit.state == GATHERING:
            unit.handle.wait()
            unit.handle = None
        unit.full.untyped_storage().resize_(0)
        unit.state = SHARDED
        self.live_bytes -= nbytes(unit.full)

    def _neighbour(self, unit: Unit, offset: int) -> Unit | None:
        """The unit `offset` places away in forward order, if in the same stage (prefetching
        another stage's unit would hold it gathered until that stage runs)."""
        index = unit.index + offset
        if 0 <= index < len(self.units) and self.units[index].stage == unit.stage:
            return self.units[index]
        return None

    # Hooks.
    def _hook_modules(self, unit: Unit, modules: list[nn.Module]) -> None:
        # A forward that runs inside backward (activation recomputation) must neither prefetch
        # units backward is done with nor free a unit whose backward is about to run.
        def before_forward(module, args):
            self._gathered(unit)
            if in_backward():
                return None
            following = self._neighbour(unit, 1)
            if following is not None:
                self._start_gather(following)
            if module is modules[0] and torch.is_grad_enabled():
                needs_grad = [i for i, a in enumerate(args)
                              if isinstance(a, torch.Tensor) and a.requires_grad]
                if needs_grad:
                    wrapped = PostBackward.apply(lambda: self._through_unit(unit),
                                                 *(args[i] for i in needs_grad))
                    args = list(args)
                    for i, tensor in zip(needs_grad, wrapped):
                        args[i] = tensor
                    return tuple(args)
            return None

        def after_forward(module, args, output):
            if torch.is_grad_enabled():
                for tensor in (output if isinstance(output, tuple) else (output,)):
                    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                        tensor.register_hook(lambda grad: self._before_backward(unit))
            if module is modules[-1] and not in_backward():
                self._free(unit)

        for module in modules:
            unit.hooks.append(module.register_forward_pre_hook(before_forward))
            unit.hooks.append(module.register_forward_hook(after_forward))

    def _before_backward(self, unit: Unit) -> None:
        self._gathered(unit)
        previous = self._neighbour(unit, -1)
        if previous is not None:
            self._start_gather(previous)

    def _through_unit(self, unit: Unit) -> None:
        """The gradient has gone through the unit to its input. In a whole backward its
        parameters' gradients are complete then; a split backward's B computes none of them, so
        the unit is only freed (W gathers it again) and W's gradients are reduced after it."""
        if self.split_backward:
            self._free(unit)
        else:
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        """The unit's backward is done: flatten its gradients, free it, reduce-scatter."""
        if unit.reduced:
            return
        unit.reduced = True
        shard = unit.shard
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in shard.params]
        for param in shard.params:
            param.grad = None
        self._free(unit)
        if self.bucketed is not None:
            if self.before_reduce is not None:
                self.before_reduce(dict(zip(map(id, shard.params), grads)))
            self.bucketed.reduce_scatter(shard, grads, unit.grad_shard)
            return
        grads = shard.flatten(grads, self.compute_dtype)
        self._retire()  # at most one unit's full gradient in flight
        self._prepare_reduce(shard, grads)
        grads.div_(self.group.size)
        lo, hi = shard.shard_range
        handle = self.comm.reduce_scatter(grads[lo:hi], grads, self.group, "grads",
                                          async_op=True)
        self.pending = (unit, grads, handle)

    def _retire(self) -> None:
        if self.bucketed is not None:
            self.bucketed.finish()
        if self.pending is not None:
            unit, grads, handle = self.pending
            handle.wait()
            lo, hi = unit.shard.shard_range
            reduced = grads[lo:hi]
            if self.staging is not None:  # device -> host (a copy on a CPU too, as on a GPU)
                reduced = self.staging.to_host(reduced)
            unit.grad_shard.add_(reduced)
            self.pending = None

    # ShardedEngine.
    def _prepare_backward(self, is_last_microbatch: bool) -> None:
        pass  # every microbatch reduce-scatters: unsharded gradients are never kept

    def _after_backward(self) -> None:
        self.after_stage_backward(0)

    def after_stage_backward(self, stage: int) -> None:
        """One microbatch's gradients of `stage` (the whole model without a pipeline) are
        complete: reduce-scatter the units no input gradient reached, in order, and free all."""
        units = [unit for unit in self.units if unit.stage == stage]
        for unit in reversed(units):
            self._reduce(unit)
        self._retire()
        for unit in units:
            unit.reduced = False
            self._free(unit)

    def _finish_reduction(self) -> None:
        self._sum_tied_gradient()  # the rest was done after each backward

    def _publish_params(self) -> None:
        pass  # the next forward gathers the updated shards

    def _zero_grads(self) -> None:
        for unit in self.units:
            unit.grad_shard.zero_()
        self.peak_live_bytes = self.live_bytes

    def _device_bytes(self) -> dict[str, int]:
        params = sum(nbytes(u.param_shard) for u in self.units)
        grads = sum(nbytes(u.grad_shard) for u in self.units)
        held = {"params": self.live_bytes, "grads": 0, "params_gathered_peak": self.peak_live_bytes}
        if self.bucketed is not None:
            held["zero_buffers"] = self.bucketed.bytes_held()
        if self.staging is not None:
            held["zero_buffers"] = self.staging.device_bytes()
            grads += self.staging.host_bytes()
        if not self.offload.params:
            return held | {"params": params + self.live_bytes, "grads": grads}
        # An fp32 shard is its own master copy: counted here (optimizer_bytes leaves it out).
        where = "disk_params" if self.offload.files is not None else "host_params"
        return held | {where: params, "host_grads": grads}
