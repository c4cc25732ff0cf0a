"""Parameters, gradients and optimizer state one rank of tetrad's runtime holds (the `tetrad`
runtime profile: tetrad.planner.eager), from the rank's own tensors (eager_params).

Without ZeRO, torch.optim.AdamW steps every tensor the rank holds and keeps a 4-byte fp32 step
count per tensor. tetrad's ZeRO engines take the rank's replicated tensors (all but its experts):
ZeRO-1/2 in flat buckets of about 25 MiB (of fp32 parameters, in reverse registration order),
each padded to a multiple of the group, ZeRO-2 under a pipeline each stage's apart (a tied
embedding's copy alone): the runtime's own rules (tetrad.spec.runtime_rules), sized here by the
planner's tensors; ZeRO-3 in units (eager_params), each padded, gathered one while
prefetching the next of its stage (--recompute sqrt: a segment's units at once while backward
reruns it), a root unit gathered around its stage's forward besides. The
engine keeps the fp32 gradient of its shard beside a 16-bit one; offload keeps fp32 master,
moments and gradient shard on the host; parameter offload (ZeRO-3) the parameter and gradient
shards there too (an fp32 parameter shard is its own master), NVMe offload the parameter shards,
masters and moments in files and the gradient shards on the host. Experts (ep > 1) stay out of ZeRO: fp32 parameters with
an AdamW of their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from tetrad.spec.model import ModelConfig
from tetrad.planner.eager_params import Param, rank_parameters
from tetrad.planner.layout import TrainLayout
from tetrad.planner.precision import TrainingPrecision
from tetrad.spec.layout import sqrt_segments
# The tests read FIRST_BUCKET_BYTES through this module, as the planner's.
from tetrad.spec.runtime_rules import (BUCKET_BYTES, FIRST_BUCKET_BYTES, ddp_buckets,
                                       fill_buckets, padded, reduces_per_stage, stage_buckets)

FP32 = 4


@dataclass(frozen=True)
class ModelState:
    """Bytes of one rank's model state. `params` includes `params_gathered` (ZeRO-3's whole
    units at their peak); host and disk bytes (offload) are not GPU memory."""

    params: float
    grads: float
    optimizer: float
    params_gathered: float = 0.0
    host_optimizer: float = 0.0
    host_grads: float = 0.0
    host_params: float = 0.0
    disk_params: float = 0.0
    disk_optimizer: float = 0.0


def fp32_bytes(param: Param) -> int:
    """What a parameter weighs in the buckets: the runtime buckets its fp32 parameters."""
    return param.elements * FP32


def buckets_of(params: list[Param], first_bytes: int | None = None) -> list[list[Param]]:
    """The flat buckets of `params` as the runtime fills them (reverse registration order; the
    first of about `first_bytes` when given)."""
    return fill_buckets(params, fp32_bytes, BUCKET_BYTES, first_bytes)


def ddp_bucket_params(params: list[Param]) -> list[list[Param]]:
    """DDP's gradient buckets of `params` (the first small, as torch's)."""
    return ddp_buckets(params, fp32_bytes)


def zero_bucket_params(params: list[Param], layout: TrainLayout) -> list[list[Param]]:
    """The flat buckets ZeRO-1/2 builds of the replicated `params`: one run of buckets over them
    all, or where ZeRO reduces stage by stage (ZeRO-2 under a pipeline) one run per stage, a tied
    embedding's copy alone in a bucket after its stage's."""
    if not reduces_per_stage(layout.zero, layout.pp):
        return buckets_of(params)
    stages = {stage: [p for p in params if p.stage == stage]
              for stage in sorted({p.stage for p in params})}
    return [bucket for per_stage in stage_buckets(stages, lambda p: p.tied, fp32_bytes).values()
            for bucket in per_stage]


def zero_buckets(params: list[Param], layout: TrainLayout) -> list[int]:
    """Padded elements of each of zero_bucket_params' buckets."""
    return [padded(sum(p.elements for p in bucket), layout.zero_group)
            for bucket in zero_bucket_params(params, layout)]


def reduced_together(params: list[Param], layout: TrainLayout) -> list[list[Param]]:
    """The replicated `params` by the gradient reduction that carries them, one collective call
    each: DDP's buckets (the first small), ZeRO-1/2's buckets, ZeRO-3's units. Tensor
    parallelism sums the partial gradients among them just before (one call per group)."""
    if layout.zero == 0:
        return ddp_bucket_params(params)
    if layout.zero in (1, 2):
        return zero_bucket_params(params, layout)
    units: dict[tuple[int, int | None], list[Param]] = {}
    for param in params:
        units.setdefault((param.stage, param.unit), []).append(param)
    return list(units.values())


@dataclass(frozen=True)
class StageUnits:
    """Padded elements of one stage's ZeRO-3 units: its root unit (0 without one) and the others,
    in forward order."""

    root: int
    in_turn: tuple[int, ...]

    @property
    def total(self) -> int:
        return self.root + sum(self.in_turn)

    @property
    def all(self) -> tuple[int, ...]:
        """Every unit, the root (if any) first."""
        return ((self.root,) if self.root else ()) + self.in_turn

    @property
    def gathered_peak(self) -> int:
        """The root, a unit and the next one prefetched (forward; backward the previous)."""
        pairs = [a + b for a, b in zip(self.in_turn, self.in_turn[1:])]
        return self.root + max(pairs or self.in_turn)


def zero3_units(params: list[Param], group: int) -> dict[int, StageUnits]:
    """The ZeRO-3 units of the replicated `params`, by stage."""
    stages: dict[int, dict[int, int]] = {}
    for param in params:
        units = stages.setdefault(param.stage, {})
        units[param.unit] = units.get(param.unit, 0) + param.elements
    roots = {(p.stage, p.unit) for p in params if p.root}
    return {stage: StageUnits(sum(padded(units[unit], group) for unit in units
                                  if (stage, unit) in roots),
                              tuple(padded(units[unit], group) for unit in sorted(units)
                                    if (stage, unit) not in roots))
            for stage, units in sorted(stages.items())}


def _expert_state(experts: list[Param]) -> tuple[float, float, float]:
    """fp32 parameters, gradients and AdamW (two moments and a step count per tensor)."""
    elements = sum(p.elements for p in experts)
    return elements * FP32, elements * FP32, elements * 2 * FP32 + len(experts) * FP32


@lru_cache(maxsize=1024)
def model_state(config: ModelConfig, layout: TrainLayout, precision: TrainingPrecision,
                pp_rank: int) -> ModelState:
    """Parameters, gradients and optimizer state of one rank of pipeline rank `pp_rank`."""
    # The frozen routing bias: held (fp32, as its router's parameters), never stepped.
    frozen = sum(p.elements for p in rank_parameters(config, layout, pp_rank) if p.frozen) * FP32
    params = [p for p in rank_parameters(config, layout, pp_rank) if not p.frozen]
    pb, gb = precision.param_bytes, precision.grad_bytes
    if layout.zero == 0:
        elements = sum(p.elements for p in params)
        return ModelState(elements * pb + frozen, elements * gb,
                          elements * precision.optimizer_state_bytes + len(params) * FP32)
    replicated = [p for p in params if not p.expert]
    expert_params, expert_grads, expert_optimizer = _expert_state(
        [p for p in params if p.expert])
    n = layout.zero_group
    gathered = 0.0
    if layout.zero == 3:
        by_stage = zero3_units(replicated, n)
        stages = by_stage.values()
        shard = sum(units.total for units in stages) // n
        # Units are gathered within one stage's forward or backward at a time.
        gathered = max(units.gathered_peak for units in stages) * pb
        if layout.recompute == "sqrt":
            gathered = max(gathered, _segment_gathered(replicated, by_stage, n,
                                                       config.num_layers) * pb)
        params_bytes, grads = shard * pb + gathered, shard * gb
    else:
        flat = sum(zero_buckets(replicated, layout))
        shard = flat // n
        params_bytes, grads = flat * pb, (flat if layout.zero == 1 else shard) * gb
    # The step reads an fp32 gradient of the shard: the 16-bit one converted (on the host with
    # offload, where the fp32 master copy and the moments live too). With fp32 parameters the
    # device shard is its own master copy.
    fp32_grad = shard * FP32
    params_bytes += expert_params + frozen
    grads += expert_grads
    if layout.offload_params:
        largest = max(max(units.all) for units in by_stage.values()) // n
        return _offloaded_shards(layout, shard, largest, precision, ModelState(
            gathered + expert_params + frozen, expert_grads, expert_optimizer, gathered))
    if layout.offload:
        return ModelState(params_bytes, grads, expert_optimizer, gathered,
                          shard * (FP32 + precision.optimizer_bytes), fp32_grad)
    return ModelState(params_bytes, grads + (fp32_grad if gb != FP32 else 0.0),
                      shard * precision.optimizer_state_bytes + expert_optimizer, gathered)


def _segment_gathered(params: list[Param], by_stage: dict[int, StageUnits], group: int,
                      num_layers: int) -> int:
    """--recompute sqrt under ZeRO-3: backward's rerun of a segment gathers each of its blocks'
    units and frees none before that block's own backward, so a whole segment's units are
    gathered at once, beside its stage's root (padded elements, the largest segment)."""
    blocks: dict[int, dict[int, int]] = {}
    for param in params:
        if param.unit is not None and 2 <= param.unit < 2 + num_layers:
            units = blocks.setdefault(param.stage, {})
            units[param.unit] = units.get(param.unit, 0) + param.elements
    peak = 0
    for stage, units in blocks.items():
        sizes = [padded(units[unit], group) for unit in sorted(units)]
        start = 0
        for size in sqrt_segments(len(sizes)):
            peak = max(peak, by_stage[stage].root + sum(sizes[start:start + size]))
            start += size
    return peak


def _offloaded_shards(layout: TrainLayout, shard: int, largest: int,
                      precision: TrainingPrecision, on_device: ModelState) -> ModelState:
    """ZeRO-3 with its shards off the device: the parameter shard (its own fp32 master when the
    parameters are fp32), the optimizer state, and on the host the gradient shard with its fp32
    copy for the step when the gradients are 16-bit, and the staging buffer reduced gradient
    shards land in (the `largest` unit shard; none with --zero-bucket-size, whose pieces are
    added straight into the host shard)."""
    params = shard * precision.param_bytes
    optimizer = shard * precision.optimizer_state_bytes
    staging = 0 if layout.zero_bucket_size else largest * precision.grad_bytes
    grads = (shard * precision.grad_bytes + (shard * FP32 if precision.grad_bytes != FP32 else 0)
             + staging)
    if layout.offload_files:
        return dataclasses.replace(on_device, host_grads=grads, disk_params=params,
                                   disk_optimizer=optimizer)
    return dataclasses.replace(on_device, host_grads=grads, host_params=params,
                               host_optimizer=optimizer)
