"""A training layout as the planner evaluates it: tetrad's one ParallelConfig (degrees, ZeRO stage,
recomputation, schedule, microbatches per pipeline pass, pipeline cut) plus how a rank's batch is
split (micro batch size, pipeline passes per step), and the checks that say which constraint an
impossible layout breaks (the shared rules of tetrad.planner.rules, and the GPU count).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from tetrad.spec.model import ModelConfig, ParallelConfig
from tetrad.errors import ConfigError
from tetrad.planner.partition import partition
from tetrad.planner.rules import check_layout
from tetrad.schedules.generate import SPLIT_BACKWARD


@dataclass(frozen=True)
class TrainLayout(ParallelConfig):
    """`microbatches` microbatches of `micro_batch` sequences go through the pipeline schedule in
    one pass; `grad_accum` passes make one optimizer step (tetrad's --grad-accum; Megatron runs
    all microbatches in one pass). An empty stage_layers is the cut the run makes itself: tetrad's
    runtime partition's balanced one (with_runtime_cut), Megatron's the even stage_layer_counts."""

    micro_batch: int = 1
    grad_accum: int = 1

    @property
    def num_microbatches(self) -> int:
        """Microbatches per optimizer step."""
        return self.microbatches * self.grad_accum

    @property
    def schedule_microbatches(self) -> int:
        """Microbatches of one pass of the pipeline schedule."""
        return self.microbatches

    def backward_walks(self, stage: int) -> int:
        """How many times a microbatch's backward walks `stage`'s graph: twice where zero
        bubble's W walks down from the outputs again, on a stage after the first under ZeRO-3
        (its units are gathered from hooks on the outputs' gradients) or recomputation (a weight
        half needs its block's forward again); otherwise once, B and W sharing the walk
        (tetrad.parallel.pipeline.split_backward)."""
        split = self.schedule in SPLIT_BACKWARD and stage > 0
        return 2 if split and (self.zero == 3 or self.recompute != "none") else 1

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.num_microbatches

    @property
    def zero_group(self) -> int:
        """Ranks that share (and, with ZeRO, shard) the dense parameters' gradients."""
        return self.dp * self.cp

    # --- experts over tensor ranks (planner-only: tetrad's runtime folds ep over dp*cp) ---
    @property
    def expert_tp(self) -> int:
        """Ranks each expert's columns are split over: tp while ep folds over dp*cp (Megatron's
        default); 1 when ep also spans the tensor ranks (ep does not divide dp*cp: Megatron-Core's
        expert tensor parallel size 1, as NVIDIA's DeepSeek-V3 recipe runs ep 64 on tp 2 x dp 32).
        """
        return self.tp if self.zero_group % self.ep == 0 else 1

    def _check_expert_fold(self) -> None:
        """The planner also evaluates experts spread over tensor and data ranks (expert_tp 1);
        check_training_layout refuses that for tetrad's runtime (`experts_over_tp`)."""
        if (self.dp * self.cp * self.tp) % self.ep:
            raise ConfigError(f"ep {self.ep} must divide tp*dp*cp = "
                              f"{self.dp * self.cp * self.tp}")

    @property
    def expert_zero_group(self) -> int:
        """Ranks holding the same experts, which share (and shard) their gradients."""
        return self.dp * self.cp * self.tp // (self.ep * self.expert_tp)

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.ep,
                "vpp": self.vpp, "zero": self.zero, "offload": self.offload,
                "offload_mode": self.offload_mode,
                "recompute": self.recompute, "partition_activations": self.partition_activations,
                "offload_activations": self.offload_activations,
                "sequence_parallel": self.sequence_parallel,
                "schedule": self.schedule, "micro_batch": self.micro_batch,
                "num_microbatches": self.num_microbatches}

    @classmethod
    def of(cls, parallel: ParallelConfig, micro_batch: int,
           num_microbatches: int | None = None) -> "TrainLayout":
        """`parallel` with a batch split. With a pipeline, microbatches beyond
        parallel.microbatches are whole pipeline passes repeated (tetrad's --grad-accum); without
        one they are all one pass."""
        num_microbatches = num_microbatches or parallel.microbatches
        passes = (num_microbatches // parallel.microbatches
                  if parallel.pp > 1 and num_microbatches % parallel.microbatches == 0 else 1)
        fields = {f.name: getattr(parallel, f.name) for f in dataclasses.fields(ParallelConfig)}
        return cls(**{**fields, "microbatches": num_microbatches // passes},
                   micro_batch=micro_batch, grad_accum=passes)


def with_runtime_cut(config: ModelConfig, layout: TrainLayout, seq_len: int) -> TrainLayout:
    """`layout` with the pipeline cut `tetrad train` runs for it: its own stage_layers, else the
    balanced partition that parallelize makes when --stage-layers is not given."""
    if layout.pp == 1 or layout.stage_layers:
        return layout
    return dataclasses.replace(layout, stage_layers=_balanced_cut(config, layout.pp * layout.vpp,
                                                                  seq_len))


@lru_cache(maxsize=1024)  # the search evaluates thousands of layouts sharing a few cuts
def _balanced_cut(config: ModelConfig, num_stages: int, seq_len: int) -> tuple[int, ...]:
    return partition(config, num_stages, seq_len).stage_layers


@lru_cache(maxsize=1024)
def stage_layer_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per pipeline stage as Megatron-style stacks and the serving engine split them: as
    even as possible; when the count does not divide, the last and first stages (which also hold
    the LM head and the embedding) take one layer fewer, then the second-to-last and second, and
    so on. tetrad's trainer balances by cost instead (with_runtime_cut)."""
    base = -(-num_layers // num_stages)
    counts = [base] * num_stages
    outside_in = [stage for pair in zip(range(num_stages - 1, -1, -1), range(num_stages))
                  for stage in dict.fromkeys(pair)]
    for stage in outside_in[:base * num_stages - num_layers]:
        counts[stage] -= 1
    return tuple(counts)


def stage_first_layer(counts: tuple[int, ...], stage: int) -> int:
    return sum(counts[:stage])


def check_training_layout(config: ModelConfig, num_gpus: int, layout: TrainLayout,
                          seq_len: int, kv_replicas: bool = True,
                          experts_over_tp: bool = False) -> None:
    """Raise ConfigError naming the first constraint the layout breaks and how to fix it.
    `kv_replicas`: tp may exceed the KV heads, each replicated (tetrad's trainer, Megatron).
    `experts_over_tp`: ep may span tensor ranks too (TrainLayout.expert_tp), which the planner models for
    Megatron-Core's layouts and tetrad's runtime does not run."""
    check_layout(config, layout, seq_len, runtime=False, kv_replicas=kv_replicas)
    if layout.world_size != num_gpus:
        raise ConfigError(
            f"tp*pp*dp*cp = {layout.tp}*{layout.pp}*{layout.dp}*{layout.cp} = "
            f"{layout.world_size}, but there are {num_gpus} GPUs: the degrees must multiply to "
            f"the GPU count")
    if layout.zero_group % layout.ep and not experts_over_tp:
        raise ConfigError(f"ep {layout.ep} must divide dp*cp = {layout.zero_group} (tetrad's "
                          f"runtime spreads experts over the data-parallel ranks only)")
    if layout.micro_batch < 1:
        raise ConfigError("the micro batch must be at least 1 sequence")


def microbatches_for(global_batch: int, dp: int, micro_batch: int) -> int:
    """Microbatches per step; raises when the global batch does not split evenly."""
    if global_batch % (dp * micro_batch):
        raise ConfigError(
            f"global batch {global_batch} is not divisible by dp*micro_batch = {dp}*{micro_batch}"
            f" = {dp * micro_batch}: change --global-batch, --dp or --micro-batch")
    return global_batch // (dp * micro_batch)
