"""The pieces every ZeRO stage shares: flat parameter buffers cut into N shards, AdamW on this
rank's shard (fp32 master weights, optionally in host memory), what a rank counts of them in the
global gradient norm, and checkpoint pieces to and from the shards.

A FlatShard is one flat buffer of parameters (a bucket for ZeRO-1/2, a unit for ZeRO-3), padded
to a multiple of N elements so that every rank owns exactly numel/N of it: rank i owns
[i*numel/N, (i+1)*numel/N). A shard cuts parameters anywhere; weight decay is applied per
parameter segment, so the update is element for element torch's AdamW (single-tensor path;
the single-process run's fused AdamW gives the same update to fp32 rounding).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from tetrad.parallel.engine import Counted, Placement
from tetrad.parallel.mesh import Group
from tetrad.parallel.offload import Offload, host_zeros
from tetrad.sharded_tensors import Piece
from tetrad.spec.runtime_rules import padded


def nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def flat_buffers(sizes: list[int], dtype: torch.dtype, device: torch.device | None,
                 contiguous: bool = False) -> list[torch.Tensor]:
    """Zeroed flat buffers of `sizes` elements on `device` (None: in host memory, pinned when a
    GPU copies to and from it): each an allocation of its own, or with `contiguous` (ZeRO-R's
    defragmentation, DeepSpeed's contiguous_gradients) slices of one block allocated once, so
    the allocator never has to fit them between other tensors."""
    def allocate(numel: int) -> torch.Tensor:
        if device is None:
            return host_zeros(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=device)

    if not contiguous:
        return [allocate(numel) for numel in sizes]
    return list(allocate(sum(sizes)).split(sizes))


@dataclass
class FlatShard:
    """Parameters laid out in one flat buffer, and this rank's 1/N of it."""

    names: list[str]
    params: list[nn.Parameter]
    weight_decays: list[float]
    offsets: list[int]  # element offset of each parameter in the flat buffer
    numel: int  # padded to a multiple of the group size
    index: int  # this rank's shard
    size: int  # number of shards
    master: torch.Tensor | None = None  # fp32 [numel / size]: may alias the compute-dtype shard
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    main_grad: torch.Tensor | None = None  # fp32 gradient of the shard, set before the step
    host_grad: torch.Tensor | None = None  # with offload: the host buffer main_grad lives in
    decay_segments: list[tuple[int, int, float]] = field(default_factory=list)

    @classmethod
    def build(cls, named_params: list[tuple[str, float, nn.Parameter]], group: Group
              ) -> "FlatShard":
        """From (name, weight decay, parameter) triples, in buffer order."""
        offsets, total = [], 0
        for _, _, param in named_params:
            offsets.append(total)
            total += param.numel()
        numel = padded(total, group.size)
        flat = cls([n for n, _, _ in named_params], [p for _, _, p in named_params],
                   [wd for _, wd, _ in named_params], offsets, numel, group.index, group.size)
        lo, hi = flat.shard_range
        for offset, param, decay in zip(offsets, flat.params, flat.weight_decays):
            start, end = max(lo, offset), min(hi, offset + param.numel())
            if start < end and decay != 0.0:
                flat.decay_segments.append((start - lo, end - lo, decay))
        return flat

    @property
    def shard_numel(self) -> int:
        return self.numel // self.size

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.index * self.shard_numel, (self.index + 1) * self.shard_numel

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Tensors shaped like the parameters -> one padded flat buffer [numel]."""
        flat = torch.zeros(self.numel, dtype=dtype, device=self.params[0].device)
        for offset, tensor in zip(self.offsets, tensors):
            flat[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One flat buffer [numel] -> views shaped like the parameters."""
        return [flat[offset:offset + param.numel()].view_as(param)
                for offset, param in zip(self.offsets, self.params)]

    def init_optimizer(self, shard32: torch.Tensor, shard_param: torch.Tensor,
                       offload: Offload, name: str) -> None:
        """fp32 master of the shard and AdamW moments, where `offload` keeps them (`name` tells
        this shard's files apart). An fp32 parameter shard is its own master copy (no second
        copy, as the ZeRO formulas assume) wherever it lives, except with optimizer offload,
        which keeps the shard on the device and the master on the host."""
        if shard_param.dtype == torch.float32 and offload.mode != "optimizer":
            self.master = shard_param
        elif offload.optimizer:
            self.master = offload.keep(f"{name}.master", shard32)
        else:
            self.master = shard32
        zeros = torch.zeros_like(self.master)
        if offload.files is not None:
            self.exp_avg = offload.files.tensor(f"{name}.exp_avg", zeros)
            self.exp_avg_sq = offload.files.tensor(f"{name}.exp_avg_sq", zeros)
        else:
            self.exp_avg, self.exp_avg_sq = zeros, torch.zeros_like(zeros)
        if offload.mode == "optimizer":
            self.host_grad = torch.zeros_like(self.master)

    def state(self) -> list[torch.Tensor]:
        """The tensors the optimizer step reads and writes."""
        return [self.master, self.exp_avg, self.exp_avg_sq]

    def set_main_grad(self, grad_shard: torch.Tensor, inv_scale: float | None) -> None:
        """The fp32 gradient the optimizer reads, unscaled: the shard itself when it already is
        fp32 on the right side, otherwise a copy (into host memory with offload)."""
        if self.host_grad is not None:
            self.main_grad = self.host_grad.copy_(grad_shard)
        elif grad_shard.dtype == torch.float32:
            self.main_grad = grad_shard
        else:
            self.main_grad = grad_shard.float()
        if inv_scale is not None:
            self.main_grad.mul_(inv_scale)

    def optimizer_bytes(self, shard_param: torch.Tensor) -> int:
        separate_master = 0 if self.master is shard_param else nbytes(self.master)
        return separate_master + nbytes(self.exp_avg) + nbytes(self.exp_avg_sq)


class ShardedAdamW:
    """AdamW on the shards this rank owns, op for op torch.optim.AdamW's single-tensor path, so
    every element gets the update the single-process run gives it (whose fused kernel computes
    the same formula, equal to fp32 rounding). Runs wherever the master
    weights live: in host memory with offload (the host-side step of ZeRO-Offload)."""

    def __init__(self, shards: list[FlatShard], betas: tuple[float, float], eps: float,
                 offload: Offload | None = None):
        self.shards = shards
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.step_count = 0
        self.files = offload.files if offload is not None else None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        bias_correction1 = 1 - self.beta1 ** float(self.step_count)
        bias_correction2 = 1 - self.beta2 ** float(self.step_count)
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        for index, shard in enumerate(self.shards):
            if self.files is not None:  # the next shard's state is read while this one steps
                self.files.read_ahead(self.shards[index + 1].state()
                                      if index + 1 < len(self.shards) else [])
            master, grad = shard.master, shard.main_grad
            for start, end, decay in shard.decay_segments:
                master[start:end].mul_(1 - lr * decay)
            shard.exp_avg.lerp_(grad, 1 - self.beta1)
            shard.exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
            denom = (shard.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
            master.addcdiv_(shard.exp_avg, denom, value=-step_size)
            shard.main_grad = None
            if self.files is not None:
                self.files.write_behind(shard.state())


def scatter_state(shard: FlatShard, full: Mapping[str, torch.Tensor],
                  target: torch.Tensor) -> None:
    """This rank's piece of whole per-parameter tensors into `target` [shard_numel], looking up
    only the parameters its range overlaps."""
    lo, hi = shard.shard_range
    target.zero_()  # the padding
    for name, param, offset in zip(shard.names, shard.params, shard.offsets):
        start, end = max(lo, offset), min(hi, offset + param.numel())
        if start < end:
            piece = full[name].reshape(-1)[start - offset:end - offset]
            target[start - lo:end - lo].copy_(piece)


def counted_segments(shards: list[FlatShard], counted: Counted
                     ) -> list[list[tuple[int, int, torch.Tensor | None]]]:
    """Per shard: (start, end, element mask or None) of the pieces of its flat gradient this rank
    counts in the global norm. Positions, not values, go through `counted`, so the rule is the
    one for whole gradients."""
    segments = []
    for shard in shards:
        lo, hi = shard.shard_range
        pieces = []
        for name, param, offset in zip(shard.names, shard.params, shard.offsets):
            start, end = max(lo, offset), min(hi, offset + param.numel())
            positions = torch.arange(param.numel(), device=param.device)
            part = counted(name, param, positions.view(param.shape))
            if start >= end or part is None:
                continue
            mask = torch.zeros(param.numel(), dtype=torch.bool, device=param.device)
            mask[part.flatten()] = True
            mask = mask[start - offset:end - offset]
            if mask.any():
                pieces.append((start - lo, end - lo, None if mask.all() else mask))
        segments.append(pieces)
    return segments


def shard_pieces(shards: list[FlatShard], kinds: tuple[str, ...], placement: Placement
                 ) -> list[Piece]:
    """Of `kinds`, the fp32 master parameters ("model") and AdamW moments of this rank's flat
    shards, each a flat range of a parameter (of its tp shard)."""
    pieces = []
    for shard in shards:
        lo, hi = shard.shard_range
        for name, param, offset in zip(shard.names, shard.params, shard.offsets):
            start, end = max(lo, offset), min(hi, offset + param.numel())
            place = placement(name, param) if start < end else None
            if place is None:
                continue
            for kind in kinds:
                flat = getattr(shard, "master" if kind == "model" else kind)
                # A copy: slices of one buffer would carry the whole buffer when pickled, and
                # safetensors refuses tensors that share memory.
                part = flat[start - lo:end - lo].clone()
                pieces.append(Piece(kind, name, part, *place, flat=(start - offset, end - offset)))
    return pieces
