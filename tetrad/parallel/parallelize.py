"""A parallel layout applied to a model, in one fixed order: the only place that knows it.

Every rank builds the full model with the same seed, so every piece starts as the single-process
model's; then, on each rank:

  1. expert parallelism   this ep rank's experts of every MoE layer it runs; tokens travel to
                          their experts by all-to-all (ep is folded over dp x cp)
  2. context parallelism  ring attention over the cp ranks, each holding 2 of 2*cp sequence chunks
  3. tensor parallelism   heads, MLP units and the vocabulary split over tp (+ sequence
                          parallelism between the layers)
  4. compilation          (--compile) torch.compile of each block's forward as it now is
     recomputation        none | selective | full, on the blocks as they now are
  5. pipeline             this rank's stages of the model so far, and the executor of the schedule
  6. data parallelism     gradients of the replicated parameters averaged over dp x cp (DDP), or
                          sharded there with the optimizer state (ZeRO 1-3; under a pipeline
                          ZeRO-2/3 reduce after each backward of each stage, which the executor
                          signals); expert gradients summed over their edp replicas instead

Why this order: EP swaps a block's MoE layer and CP its attention core, both on the single-device
blocks; TP then splits the matmuls around them (it keeps MoE layers whole and leaves the core
alone); compilation sees each block as it will run, and recomputation wraps each block (its
compiled forward) once everything is inside it; the pipeline cuts the
finished model, so a stage computes exactly what the model computes; the data-parallel engine
comes last because it buckets, shards or broadcasts exactly the parameters this rank ends up with.
Tensor-parallel gradients that ranks hold only in part (SP's replicated norms, replicated kv rows)
are summed over tp inside the engine, bucket by bucket, just before the data-parallel reduction
(the sums commute), so this works for ZeRO's sharded gradients too.

Finally every parameter of the full model that this rank does not hold (other stages, other ranks'
experts, weights TP replaced by their shards) is released: memory is what the layout says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, ContextManager, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.spec.model import ModelConfig, ParallelConfig
from tetrad.models.moe import Router
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm
from tetrad.parallel.compile import apply_compile
from tetrad.parallel.context_parallel import (ROUTING_TAG, ContextParallel,
                                              apply_context_parallel)
from tetrad.parallel.data_parallel import DataParallel
from tetrad.parallel.engine import (DataParallelEngine, DataParallelOptions, ParameterView,
                                    WholeAdamW)
from tetrad.parallel.expert_parallel import ExpertParallel, apply_expert_parallel
from tetrad.parallel.fsdp import FullyShardedDataParallel, transformer_units
from tetrad.parallel.kept_inputs import kept_inputs_of
from tetrad.parallel.mesh import Group, Mesh
from tetrad.parallel.offload import Offload
from tetrad.parallel.pipeline import PipelineExecutor, partition
from tetrad.parallel.pipeline.executor import whole_sequences
from tetrad.parallel.recompute import apply_recompute
from tetrad.parallel.tensor_parallel import TensorParallelSplit, apply_tensor_parallel
from tetrad.parallel.zero import NORM_TAG, Pipelined, ZeroDataParallel
from tetrad.schedules.generate import SPLIT_BACKWARD, V_SHAPED
from tetrad.sharded_tensors import CHECKPOINT_KINDS, LazyMapping, Piece, assemble
from tetrad.spec.runtime_rules import rank_stages, reduces_per_stage





def parallelize(model: Transformer, mesh: Mesh, comm: Comm, parallel: ParallelConfig,
                seq_len: int, options: DataParallelOptions,
                autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                compile: bool = False) -> "ParallelModel":
    """Apply `parallel` to `model` (the full model, built with the same seed on every rank) on
    this rank, in the order of the module docstring. Collective: every rank calls it. `parallel`
    is a run's resolved layout (tetrad.planner.rules.resolve_layout: checked for this model,
    stage_layers its pipeline cut), which parallelize trusts. `compile`: regional compilation
    (tetrad.parallel.compile)."""
    config = model.config
    stages = [range(config.num_layers)]
    cut = None
    if parallel.pp > 1:  # the blocks of this rank's stages (stage s lives on rank s % pp)
        cut = partition(config, parallel.pp * parallel.vpp, seq_len, parallel.stage_layers or None)
        stages = [cut.layers(stage) for stage in rank_stages(
            mesh.coords["pp"], cut.num_stages, parallel.pp, parallel.schedule in V_SHAPED)]
    runs = [layer for layers in stages for layer in layers]
    overlap = bool(parallel.overlap)  # None (not decided by a launcher) counts as off
    experts = (apply_expert_parallel(model, mesh, comm, layers=runs, overlap=overlap)
               if parallel.ep > 1 else None)
    context = apply_context_parallel(model, mesh["cp"], comm) if parallel.cp > 1 else None
    tensor = (apply_tensor_parallel(model, mesh, comm, parallel.sequence_parallel,
                                    seq_len // parallel.cp, overlap)
              if parallel.tp > 1 else None)
    if compile:
        apply_compile(model, parallel.pp > 1 and parallel.schedule in SPLIT_BACKWARD)
    apply_recompute(model, parallel.recompute, stages,
                    kept_inputs_of(parallel, comm, mesh["tp"] if parallel.tp > 1 else None,
                                   mesh.coords["pp"]))
    pipeline = None
    if parallel.pp > 1:
        pipeline = PipelineExecutor.from_model(
            model, mesh, comm, parallel.schedule, parallel.microbatches, parallel.vpp,
            parallel.stage_layers or None, seq_len, autocast,
            context.shard if context else whole_sequences, cut)
    params = pipeline.named_parameters() if pipeline else dict(model.named_parameters())
    expert_ids = {id(p) for p in experts.expert_parameters()} if experts else set()
    replicated = {name: p for name, p in params.items()
                  if id(p) not in expert_ids and p.requires_grad}
    engine = _data_parallel(model, replicated, mesh, comm, parallel, options, pipeline)
    expert_names = {n for n, p in params.items() if id(p) in expert_ids}
    # Experts are not sharded: each keeps a whole AdamW of its own, written by its first replica.
    expert_optimizer = (WholeAdamW({n: params[n] for n in expert_names}, options, mesh["edp"])
                        if expert_names else None)
    if tensor is not None:
        engine.before_reduce = tensor.sum_partial_gradients
    # Free what this rank does not hold (other stages, other ranks' experts, the whole weights TP
    # copied its shards from): memory is then what the layout says, and a stray use fails loudly.
    held = {id(p) for p in params.values()}
    with torch.no_grad():
        for param in model.parameters():
            if id(param) not in held:
                param.data = param.data.new_empty(0)
    return ParallelModel(config, mesh, comm, parallel, pipeline.module if pipeline else model,
                         params, expert_names, engine, expert_optimizer, experts, context, tensor,
                         pipeline)


def summed_router_loads(module: nn.Module, comm: Comm, group: Group) -> None:
    """Aux-loss-free balancing after a step, as on one device: each router's expert loads summed
    over `group` (the ranks that routed different tokens: dp x cp, over which ep is folded; tp
    ranks route the same ones), then every rank moves its copy of the bias alike. Every rank of
    the group holds the same routers (the same pipeline stages), so the sums pair up."""
    routers = [m for m in module.modules() if isinstance(m, Router) and m.load is not None]
    if routers and group.size > 1:
        loads = torch.cat([router.load for router in routers])
        comm.all_reduce(loads, group, ROUTING_TAG)
        for router, load in zip(routers, loads.split([r.load.numel() for r in routers])):
            router.load = load
    for router in routers:
        router.update_bias()


def _data_parallel(model: Transformer, replicated: dict[str, nn.Parameter], mesh: Mesh,
                   comm: Comm, parallel: ParallelConfig, options: DataParallelOptions,
                   pipeline: PipelineExecutor | None):
    view = ParameterView(replicated)
    group = mesh["dp_cp"]  # context-parallel ranks hold the same weights as data-parallel ones
    if parallel.zero == 0:
        return DataParallel(replicated, group, comm, options)
    sharded = dict(param_groups=options.group_parameters(view), betas=options.betas,
                   eps=options.eps, compute_dtype=options.compute_dtype,
                   offload=Offload.of(parallel), contiguous=parallel.contiguous_buffers)
    # ZeRO-2/3 reduce every microbatch: under a pipeline, stage by stage, after each backward of
    # a stage the executor runs (ZeRO-1 just reduces after the step's last backward).
    pipelined = None
    if reduces_per_stage(parallel.zero, parallel.pp):
        pipelined = Pipelined(pipeline.stages, pipeline.schedule.split_backward,
                              pipeline.tied_weight, pipeline.embedding_group)
    if parallel.zero < 3:
        engine = ZeroDataParallel(view, group, comm, parallel.zero,
                                  bucket_bytes=options.bucket_bytes, pipelined=pipelined,
                                  **sharded)
    else:
        ids = {id(p) for p in replicated.values()}  # ZeRO-3 units without the experts
        units = None if pipelined else [(modules, [p for p in params if id(p) in ids])
                                        for modules, params in transformer_units(model)]
        engine = FullyShardedDataParallel(view, group, comm, units=units, pipelined=pipelined,
                                          bucket_elements=parallel.zero_bucket_size, **sharded)
    if pipelined is not None:
        pipeline.after_stage_backward = engine.after_stage_backward
        pipeline.sum_tied_gradient = False  # the engine sums its shards of it
    return engine


@dataclass
class ParallelModel:
    """One rank's share of a model under a layout, and what a training strategy needs of it: how
    a microbatch is cut and scored, backward, the gradient reduction, the global gradient norm,
    clipping and the optimizer step, and this rank's pieces of the single-process tensors
    (checkpoints, the whole model on one rank)."""

    config: ModelConfig
    mesh: Mesh
    comm: Comm
    parallel: ParallelConfig
    module: nn.Module  # runs forward without a pipeline; with one, the rank's stages
    params: dict[str, nn.Parameter]  # what this rank holds, by the single-process names
    expert_names: set[str]  # of `params`: reduced over edp, not by the engine
    engine: DataParallelEngine  # the replicated parameters' reduction and optimizer
    expert_optimizer: WholeAdamW | None = None
    experts: ExpertParallel | None = None
    context: ContextParallel | None = None
    tensor: TensorParallelSplit | None = None
    pipeline: PipelineExecutor | None = None

    def __post_init__(self) -> None:
        # Parameters without a gradient (the routing bias of aux-loss-free balancing): no engine
        # holds them; they are replicated, written by the first dp x cp replica, loaded here.
        self.frozen = {name: p for name, p in self.params.items() if not p.requires_grad}
        tied = self.pipeline.tied_weight if self.pipeline else None
        # The last pipeline rank's copy of a tied embedding is the first rank's parameter again.
        self.duplicate = {id(tied)} if tied is not None and \
            self.pipeline.embedding_group.index != 0 else set()
        self.scaler = self.engine.scaler  # fp16 loss scaling (None otherwise)

    def split(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A microbatch window [batch, seq + 1] -> inputs, targets and their positions."""
        if self.context is not None:
            return self.context.shard(window)
        return window[:, :-1], window[:, 1:], torch.arange(window.shape[1] - 1,
                                                           device=window.device)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor.loss(logits, targets)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        self.engine.backward(loss, is_last_microbatch)

    def reduce_gradients(self) -> None:
        """After the step's last backward: replicated gradients averaged over dp x cp by the
        engine (ZeRO: into this rank's shards), expert gradients over their replicas; all of
        them unscaled (fp16)."""
        self.engine.reduce_gradients()
        if self.experts is not None:
            self.experts.reduce_expert_gradients()
            if self.scaler:
                self.expert_optimizer.unscale(self.scaler.scale)

    def grad_norm(self) -> float:
        """The whole model's gradient norm, as torch.nn.utils.clip_grad_norm_ computes it on one
        device: every element once, wherever it lives (tp shards, rows or copies replicated over
        tp, pipeline stages and the tied embedding's two copies, ep's experts, ZeRO's shards).
        Call after reduce_gradients. Sums only over the groups whose ranks hold different
        numbers, so plain data parallelism sends nothing."""
        total = self.engine.grad_square(self.counted)
        if self.expert_optimizer is not None:  # equal over edp once reduced, different over ep
            experts = self.expert_optimizer.grad_square(self.counted, total.device)
            self.comm.all_reduce(experts, self.mesh["ep"], NORM_TAG)
            total = total + experts
        for axis in ("tp", "pp"):
            if getattr(self.mesh.dims, axis) > 1:  # a mesh may leave out groups of one rank
                self.comm.all_reduce(total, self.mesh[axis], NORM_TAG)
        return total.sqrt().item()

    def clip(self, grad_norm: float, max_norm: float) -> None:
        """Scale every gradient as torch.nn.utils.clip_grad_norm_ does on one device."""
        if max_norm <= 0 or not math.isfinite(grad_norm):
            return
        coefficient = min(max_norm / (grad_norm + 1e-6), 1.0)
        self.engine.clip(coefficient)
        if self.expert_optimizer is not None:
            self.expert_optimizer.clip(coefficient)

    def step(self, lr: float, grad_norm: float) -> bool:
        """The optimizer step of every parameter this rank holds; False when an fp16 overflow (a
        non-finite global norm, alike on every rank) skipped it."""
        applied = self.engine.step(lr, grad_norm)
        if self.expert_optimizer is not None:
            if applied:
                self.expert_optimizer.step(lr)
            self.expert_optimizer.optimizer.zero_grad(set_to_none=True)
        summed_router_loads(self.module, self.comm, self.mesh["dp_cp"])
        return applied

    def counted(self, name: str, param: nn.Parameter, tensor: torch.Tensor
                ) -> torch.Tensor | None:
        """The part of `tensor` (shaped like `param`) this rank counts in a sum over the whole
        model, within its tp group and pipeline (None: nothing)."""
        if id(param) in self.duplicate:
            return None
        return tensor if self.tensor is None else self.tensor.counted_part(name, tensor)

    def placement(self, name: str, param: nn.Parameter) -> tuple | None:
        """(global shape, split dim, this rank's rows) of what this rank writes of `param` in a
        checkpoint, as far as tp and the pipeline go: its tp shard of a split tensor, an unsplit
        one on the first tp rank, the tied embedding on its first pipeline rank (None: a peer
        writes it). The replicas over dp x cp (edp for experts) are the optimizers' to skip."""
        if id(param) in self.duplicate:
            return None
        split = self._tp_split(name)
        if split is None and self.mesh.dims.coords(self.mesh.rank)["tp"]:
            return None
        return split or (tuple(param.shape), None, None)

    def checkpoint_pieces(self, kinds: tuple[str, ...] = CHECKPOINT_KINDS) -> list[Piece]:
        """This rank's pieces of `kinds` (parameters, AdamW moments): what it alone writes in a
        sharded checkpoint, each in the single-process tensors' coordinates."""
        experts = (self.expert_optimizer.pieces(kinds, self.placement)
                   if self.expert_optimizer is not None else [])
        return self.engine.pieces(kinds, self.placement) + experts + self._frozen_pieces(kinds)

    def _frozen_pieces(self, kinds: tuple[str, ...]) -> list[Piece]:
        """The frozen parameters, and AdamW moments of zeros as one process writes for them."""
        if self.mesh["dp_cp"].index != 0:
            return []
        return [Piece(kind, name, param.detach() if kind == "model" else torch.zeros_like(param),
                      *place)
                for name, param in self.frozen.items()
                if (place := self.placement(name, param)) is not None for kind in kinds]

    def optimizer_step(self) -> int:
        return self.engine.optimizer_step()

    def whole_state(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by the single-process names: every rank's pieces exchanged and
        assembled, on each rank (collective over the world, tag "checkpoint")."""
        by_name: dict[str, list[Piece]] = {}
        # As CPU tensors: a pickled CUDA tensor unpickles onto the sender's GPU index, and pieces
        # on several GPUs could not be assembled into one tensor.
        pieces = [dataclasses.replace(piece, data=piece.data.detach().cpu())
                  for piece in self.checkpoint_pieces(("model",))]
        for rank_pieces in self.comm.all_gather_object(pieces, self.mesh["world"], "checkpoint"):
            for piece in rank_pieces:
                by_name.setdefault(piece.name, []).append(piece)
        return {name: assemble(parts) for name, parts in by_name.items()}

    def load(self, whole: dict) -> None:
        """A checkpoint's whole tensors (any layout's; tetrad.sharded_tensors) into this rank's
        parameters and optimizer state, each cut when looked up."""
        params = self.local_named(whole["model"], self.params)
        optimizer = whole.get("optimizer")
        moments = optimizer and {"step": optimizer["step"],
                                 "exp_avg": self.local_named(optimizer["exp_avg"], self.params),
                                 "exp_avg_sq": self.local_named(optimizer["exp_avg_sq"],
                                                                self.params)}
        self.engine.load(params, moments, loss_scaler_state(whole.get("scaler")))
        with torch.no_grad():
            for name, param in self.frozen.items():
                param.copy_(params[name])
        if self.expert_optimizer is not None:
            self.expert_optimizer.load(params, moments)

    def bytes_held(self) -> dict[str, int]:
        """Bytes of the tensors this rank holds, by kind (counted from the tensors)."""
        held = self.engine.bytes_held()
        held["params"] += sum(p.numel() * p.element_size() for p in self.frozen.values())
        if self.expert_optimizer is not None:
            for kind, count in self.expert_optimizer.bytes_held().items():
                held[kind] += count
        return held

    def _tp_split(self, name: str) -> tuple[tuple[int, ...], int, torch.Tensor] | None:
        """(global shape, dim, this rank's rows) of a tensor split over tp; None if unsplit."""
        if self.tensor is None or name not in self.tensor.shards:
            return None
        dim, indices = self.tensor.shards[name]
        return (self.tensor.whole_shape(name, self.params[name].shape), dim,
                indices[self.tensor.tp.index].cpu())

    def local_named(self, whole: Mapping[str, torch.Tensor], names) -> LazyMapping:
        """This rank's pieces of whole tensors (as `pieces` cut them, without communication),
        each cut when looked up."""
        if self.tensor is None:
            return LazyMapping(names, whole.__getitem__)
        return LazyMapping(names, lambda name: self.tensor.local_part(name, whole[name]))


def loss_scaler_state(state: dict | None) -> dict | None:
    """A loss scaler's state from any checkpoint (torch's GradScaler counts "_growth_tracker")."""
    return state and {"scale": state["scale"],
                      "clean_steps": state.get("clean_steps", state.get("_growth_tracker", 0))}
