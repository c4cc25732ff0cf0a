"""A parallel layout applied to a model, in one fixed order: the only place that knows it.

Every rank builds the full model with the same seed, so every piece starts as the single-process
model's; then, on each rank:

  1. expert parallelism   this ep rank's experts of every MoE layer it runs; tokens travel to
                          their experts by all-to-all (ep is folded over dp x cp)
  2. context parallelism  ring attention over the cp ranks, each holding 2 of 2*cp sequence chunks
  3. tensor parallelism   heads, MLP units and the vocabulary split over tp (+ sequence
                          parallelism between the layers)
  4. recomputation        none | selective | full, on the blocks as they now are
  5. pipeline             this rank's stages of the model so far, and the executor of the schedule
  6. data parallelism     gradients of the replicated parameters averaged over dp x cp (DDP), or
                          sharded there with the optimizer state (ZeRO 1-3; under a pipeline
                          ZeRO-2/3 reduce after each backward of each stage, which the executor
                          signals); expert gradients summed over their edp replicas instead

Why this order: EP swaps a block's MoE layer and CP its attention core, both on the single-device
blocks; TP then splits the matmuls around them (it keeps MoE layers whole and leaves the core
alone); recomputation wraps each block once everything is inside it; the pipeline cuts the
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
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.config import ModelConfig, ParallelConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm
from tetrad.parallel.context_parallel import ContextParallel, apply_context_parallel
from tetrad.parallel.data_parallel import DEFAULT_BUCKET_BYTES, DataParallel
from tetrad.parallel.expert_parallel import ExpertParallel, apply_expert_parallel
from tetrad.parallel.fsdp import FullyShardedDataParallel, transformer_units
from tetrad.parallel.mesh import Mesh
from tetrad.parallel.pipeline import PipelineExecutor, partition
from tetrad.parallel.pipeline.executor import whole_sequences
from tetrad.parallel.recompute import apply_recompute
from tetrad.parallel.tensor_parallel import TensorParallelTransformer, parallelize_tensor
from tetrad.parallel.zero import Pipelined, ZeroDataParallel
from tetrad.sharded_tensors import CHECKPOINT_KINDS, LazyMapping, Piece

NORM_TAG = "grad_norm"


@dataclass(frozen=True)
class DataParallelOptions:
    """What the data-parallel engine takes from the training recipe."""

    group_parameters: Callable  # parameters -> AdamW's weight-decay groups
    betas: tuple[float, float]
    eps: float
    compute_dtype: torch.dtype = torch.float32
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


class ParameterView:
    """Named parameters that are not one module's (a rank's pipeline stages without its experts),
    shaped as the data-parallel engines and the optimizer read a model."""

    def __init__(self, named: dict[str, nn.Parameter]):
        self.named = named

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self.named.items())

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(self.named.values())

    def buffers(self) -> Iterator[torch.Tensor]:
        return iter(())


def parallelize(model: Transformer, mesh: Mesh, comm: Comm, parallel: ParallelConfig,
                seq_len: int, options: DataParallelOptions,
                autocast: Callable[[], ContextManager] = contextlib.nullcontext
                ) -> "ParallelModel":
    """Apply `parallel` to `model` (the full model, built with the same seed on every rank) on
    this rank, in the order of the module docstring. Collective: every rank calls it. `parallel`
    is a run's resolved layout (tetrad.planner.rules.resolve_layout: checked for this model,
    stage_layers its pipeline cut), which parallelize trusts."""
    config = model.config
    runs = range(config.num_layers)
    cut = None
    if parallel.pp > 1:  # the blocks of this rank's stages (stage s lives on rank s % pp)
        cut = partition(config, parallel.pp * parallel.vpp, seq_len, parallel.stage_layers or None)
        runs = [layer for stage in range(mesh.coords["pp"], cut.num_stages, parallel.pp)
                for layer in cut.layers(stage)]
    experts = (apply_expert_parallel(model, mesh, comm, layers=runs) if parallel.ep > 1
               else None)
    context = apply_context_parallel(model, mesh["cp"], comm) if parallel.cp > 1 else None
    tensor = (parallelize_tensor(model, mesh, comm, parallel.sequence_parallel,
                                 seq_len // parallel.cp) if parallel.tp > 1 else None)
    module = tensor or model
    apply_recompute(module, parallel.recompute)
    pipeline = None
    if parallel.pp > 1:
        pipeline = PipelineExecutor.from_model(
            module, mesh, comm, parallel.schedule, parallel.microbatches, parallel.vpp,
            parallel.stage_layers or None, seq_len, autocast,
            context.shard if context else whole_sequences, cut)
    params = pipeline.named_parameters() if pipeline else dict(module.named_parameters())
    expert_ids = {id(p) for p in experts.expert_parameters()} if experts else set()
    replicated = {name: p for name, p in params.items() if id(p) not in expert_ids}
    engine = _data_parallel(module, replicated, mesh, comm, parallel, options, pipeline)
    if tensor is not None:
        engine.before_reduce = tensor.sum_partial_gradients
    # Free what this rank does not hold (other stages, other ranks' experts, the whole weights TP
    # copied its shards from): memory is then what the layout says, and a stray use fails loudly.
    held = {id(p) for p in params.values()}
    with torch.no_grad():
        for param in model.parameters():
            if id(param) not in held:
                param.data = param.data.new_empty(0)
    return ParallelModel(config, mesh, comm, parallel, pipeline.module if pipeline else module,
                         params, {n for n, p in params.items() if id(p) in expert_ids}, engine,
                         experts, context, tensor, pipeline)


def _data_parallel(module: nn.Module, replicated: dict[str, nn.Parameter], mesh: Mesh,
                   comm: Comm, parallel: ParallelConfig, options: DataParallelOptions,
                   pipeline: PipelineExecutor | None):
    view = ParameterView(replicated)
    group = mesh["dp_cp"]  # context-parallel ranks hold the same weights as data-parallel ones
    if parallel.zero == 0:
        return DataParallel(view, group, comm, options.bucket_bytes)
    sharded = dict(param_groups=options.group_parameters(view), betas=options.betas,
                   eps=options.eps, compute_dtype=options.compute_dtype,
                   offload=parallel.offload)
    # ZeRO-2/3 reduce every microbatch: under a pipeline, stage by stage, after each backward of
    # a stage the executor runs (ZeRO-1 just reduces after the step's last backward).
    pipelined = None
    if pipeline is not None and parallel.zero > 1:
        pipelined = Pipelined(pipeline.stages, pipeline.schedule.split_backward,
                              pipeline.tied_weight, pipeline.embedding_group)
    if parallel.zero < 3:
        engine = ZeroDataParallel(view, group, comm, parallel.zero,
                                  bucket_bytes=options.bucket_bytes, pipelined=pipelined,
                                  **sharded)
    else:
        ids = {id(p) for p in replicated.values()}  # ZeRO-3 units without the experts
        units = None if pipelined else [(modules, [p for p in params if id(p) in ids])
                                        for modules, params in transformer_units(module)]
        engine = FullyShardedDataParallel(view, group, comm, units=units, pipelined=pipelined,
                                          **sharded)
    if pipelined is not None:
        pipeline.after_stage_backward = engine.after_stage_backward
        pipeline.sum_tied_gradient = False  # the engine sums its shards of it
    return engine


@dataclass
class ParallelModel:
    """One rank's share of a model under a layout, and what a training strategy needs of it: how
    a microbatch is cut and scored, the gradient reduction, the global gradient norm, and this
    rank's pieces of the single-process tensors (checkpoints, the whole model on one rank)."""

    config: ModelConfig
    mesh: Mesh
    comm: Comm
    parallel: ParallelConfig
    module: nn.Module  # runs forward without a pipeline; with one, the rank's stages
    params: dict[str, nn.Parameter]  # what this rank holds, by the single-process names
    expert_names: set[str]  # of `params`: reduced over edp, not by the engine
    engine: DataParallel | ZeroDataParallel | FullyShardedDataParallel
    experts: ExpertParallel | None = None
    context: ContextParallel | None = None
    tensor: TensorParallelTransformer | None = None
    pipeline: PipelineExecutor | None = None

    def __post_init__(self) -> None:
        tied = self.pipeline.tied_weight if self.pipeline else None
        # The last pipeline rank's copy of a tied embedding is the first rank's parameter again.
        self.duplicate = {id(tied)} if tied is not None and \
            self.pipeline.embedding_group.index != 0 else set()
        self._segments = None  # ZeRO: what of each flat shard this rank counts in the norm

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

    def reduce_gradients(self) -> None:
        """After the step's last backward: replicated gradients averaged over dp x cp by the
        engine (ZeRO: into this rank's shards), expert gradients over their replicas."""
        if isinstance(self.engine, DataParallel):
            self.engine.finish()
        else:
            self.engine.reduce_gradients()
        if self.experts is not None:
            self.experts.reduce_expert_gradients()

    def grad_norm(self) -> float:
        """The whole model's gradient norm, as torch.nn.utils.clip_grad_norm_ computes it on one
        device: every element once, wherever it lives (tp shards, rows or copies replicated over
        tp, pipeline stages and the tied embedding's two copies, ep's experts, ZeRO's shards).
        Call after reduce_gradients (and unscaling). Sums only over the groups whose ranks hold
        different numbers, so plain data parallelism sends nothing."""
        device = next(iter(self.params.values())).device
        replicated, experts, shards = (torch.zeros((), dtype=torch.float64, device=device)
                                       for _ in range(3))
        in_engine = set() if isinstance(self.engine, DataParallel) else \
            {id(p) for shard in self.engine.shards for p in shard.params}
        for name, param in self.params.items():
            if param.grad is None or id(param) in in_engine:
                continue
            part = self.counted(name, param, param.grad)
            if part is not None:
                square = part.double().square().sum()
                if name in self.expert_names:
                    experts += square
                else:
                    replicated += square
        if in_engine:  # ZeRO: each dp x cp rank holds its own shard of the gradients
            for shard, pieces in zip(self.engine.shards, self._shard_segments()):
                for start, end, mask in pieces:
                    grad = shard.main_grad[start:end]
                    shards += (grad if mask is None else grad[mask]).double().square().sum()
            self.comm.all_reduce(shards, self.mesh["dp_cp"], NORM_TAG)
        if self.expert_names:  # equal over edp once reduced, different over ep
            self.comm.all_reduce(experts, self.mesh["ep"], NORM_TAG)
        total = replicated + experts + shards
        for axis in ("tp", "pp"):
            if getattr(self.mesh.dims, axis) > 1:  # a mesh may leave out groups of one rank
                self.comm.all_reduce(total, self.mesh[axis], NORM_TAG)
        return total.sqrt().item()

    def counted(self, name: str, param: nn.Parameter, tensor: torch.Tensor
                ) -> torch.Tensor | None:
        """The part of `tensor` (shaped like `param`) this rank counts in a sum over the whole
        model, within its tp group and pipeline (None: nothing)."""
        if id(param) in self.duplicate:
            return None
        return tensor if self.tensor is None else self.tensor.counted_part(name, tensor)

    def _shard_segments(self) -> list[list[tuple[int, int, torch.Tensor | None]]]:
        """Per ZeRO shard: (start, end, element mask or None) of the pieces of its flat gradient
        this rank counts. Positions, not values, go through `counted`, so the same rule applies."""
        if self._segments is None:
            self._segments = []
            for shard in self.engine.shards:
                lo, hi = shard.shard_range
                pieces = []
                for name, param, offset in zip(shard.names, shard.params, shard.offsets):
                    start, end = max(lo, offset), min(hi, offset + param.numel())
                    positions = torch.arange(param.numel(), device=param.device)
                    part = self.counted(name, param, positions.view(param.shape))
                    if start >= end or part is None:
                        continue
                    mask = torch.zeros(param.numel(), dtype=torch.bool, device=param.device)
                    mask[part.flatten()] = True
                    mask = mask[start - offset:end - offset]
                    if mask.any():
                        pieces.append((start - lo, end - lo, None if mask.all() else mask))
                self._segments.append(pieces)
        return self._segments

    def pieces(self, kind: str, tensors: dict[str, torch.Tensor]) -> list[Piece]:
        """What this rank writes of `tensors` (named and shaped like parameters it holds whole
        over dp x cp: the parameters and AdamW moments outside a ZeRO engine) in a checkpoint:
        its tp shard of a split tensor, each tensor once over its replicas (dp x cp, an expert's
        edp, tp for unsplit ones, the tied embedding's second pipeline copy)."""
        coords = self.mesh.dims.coords(self.mesh.rank)
        pieces = []
        for name, param in self.params.items():
            if name not in tensors or id(param) in self.duplicate:
                continue
            split = self._tp_split(name)
            replicas = ("edp",) if name in self.expert_names else ("dp", "cp")
            if any(coords[axis] for axis in replicas) or (split is None and coords["tp"]):
                continue
            pieces.append(Piece(kind, name, tensors[name],
                                *(split or (tuple(tensors[name].shape),))))
        return pieces

    def engine_pieces(self, kinds: tuple[str, ...] = CHECKPOINT_KINDS) -> list[Piece]:
        """What this rank writes of a ZeRO engine's state: of `kinds`, the fp32 master parameters
        ("model") and AdamW moments of its flat shards, each a flat range of a parameter (of its
        tp shard)."""
        first_tp = self.mesh.dims.coords(self.mesh.rank)["tp"] == 0
        pieces = []
        for shard in self.engine.shards:
            lo, hi = shard.shard_range
            for name, param, offset in zip(shard.names, shard.params, shard.offsets):
                start, end = max(lo, offset), min(hi, offset + param.numel())
                split = self._tp_split(name)
                if start >= end or id(param) in self.duplicate or (split is None and not first_tp):
                    continue
                placement = split or (tuple(param.shape), None, None)
                for kind in kinds:
                    flat = getattr(shard, "master" if kind == "model" else kind)
                    # A copy: slices of one buffer would carry the whole buffer when pickled,
                    # and safetensors refuses tensors that share memory.
                    part = flat[start - lo:end - lo].clone()
                    pieces.append(Piece(kind, name, part, *placement,
                                        flat=(start - offset, end - offset)))
        return pieces

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
