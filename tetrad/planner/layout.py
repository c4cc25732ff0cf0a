"""A training layout (degrees, ZeRO stage, recomputation, schedule, microbatching) and the checks
that say which constraint an impossible layout breaks.

The rank grid is Megatron's: tp innermost, then cp, dp and pp outermost; expert parallelism folds
over dp*cp and does not multiply the world size (tetrad.config.ParallelConfig says the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tetrad.config import ModelConfig, ParallelConfig
from tetrad.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


@dataclass(frozen=True, slots=True)
class TrainLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    zero: int = 0
    offload: bool = False
    recompute: str = "none"
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    micro_batch: int = 1
    num_microbatches: int = 1
    # What tetrad's runtime adds (the `tetrad` runtime profile, tetrad.planner.eager): the
    # layers of each of the pp * vpp pipeline stages (empty: the planner's even cut), and the
    # whole pipeline steps per optimizer step (--grad-accum: each runs num_microbatches /
    # grad_accum microbatches through the schedule; Megatron runs them all in one).
    stage_layers: tuple[int, ...] = ()
    grad_accum: int = 1

    @property
    def schedule_microbatches(self) -> int:
        """Microbatches of one pass of the pipeline schedule."""
        return self.num_microbatches // self.grad_accum

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

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

    @property
    def expert_zero_group(self) -> int:
        """Ranks holding the same experts, which share (and shard) their gradients."""
        return self.dp * self.cp * self.tp // (self.ep * self.expert_tp)

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.ep,
                "vpp": self.vpp, "zero": self.zero, "offload": self.offload,
                "recompute": self.recompute, "sequence_parallel": self.sequence_parallel,
                "schedule": self.schedule, "micro_batch": self.micro_batch,
                "num_microbatches": self.num_microbatches}

    @classmethod
    def from_parallel_config(cls, parallel: ParallelConfig, micro_batch: int,
                             num_microbatches: int | None = None) -> "TrainLayout":
        """With a pipeline, microbatches beyond parallel.microbatches are whole pipeline steps
        repeated (tetrad's --grad-accum)."""
        num_microbatches = num_microbatches or parallel.microbatches
        grad_accum = (num_microbatches // parallel.microbatches
                      if parallel.pp > 1 and num_microbatches % parallel.microbatches == 0
                      else 1)
        return cls(tp=parallel.tp, pp=parallel.pp, dp=parallel.dp, cp=parallel.cp,
                   ep=parallel.ep, vpp=parallel.vpp, zero=parallel.zero,
                   offload=parallel.offload, recompute=parallel.recompute,
                   sequence_parallel=parallel.sequence_parallel, schedule=parallel.schedule,
                   micro_batch=micro_batch, num_microbatches=num_microbatches,
                   stage_layers=parallel.stage_layers, grad_accum=grad_accum)


@lru_cache(maxsize=1024)
def stage_layer_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per pipeline stage: as even as possible; when the count does not divide, the last
    and first stages (which also hold the LM head and the embedding) take one layer fewer, then
    the second-to-last and second, and so on."""
    base = -(-num_layers // num_stages)
    counts = [base] * num_stages
    outside_in = [stage for pair in zip(range(num_stages - 1, -1, -1), range(num_stages))
                  for stage in dict.fromkeys(pair)]
    for stage in outside_in[:base * num_stages - num_layers]:
        counts[stage] -= 1
    return tuple(counts)


def stage_first_layer(counts: tuple[int, ...], stage: int) -> int:
    return sum(counts[:stage])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _options(values: list[int]) -> str:
    return ", ".join(str(v) for v in values[:12]) + (" ..." if len(values) > 12 else "")


def valid_tp_degrees(config: ModelConfig, training: bool = True,
                     kv_replicas: bool = False) -> list[int]:
    """TP splits attention heads; training (Megatron) also needs it to split the KV heads.
    Serving replicates KV heads when TP exceeds them (vLLM), so only the query heads count;
    tetrad's trainer (`kv_replicas`) replicates each on tp / num_kv_heads ranks."""
    heads = [d for d in divisors(config.num_heads)]
    kv = config.num_kv_heads
    if training and config.attention == "mha":
        heads = [d for d in heads if kv % d == 0 or (kv_replicas and d % kv == 0)]
    return heads


def check_tp(config: ModelConfig, tp: int, training: bool = True,
             kv_replicas: bool = False) -> None:
    if config.num_heads % tp:
        raise ConfigError(f"tp {tp} does not divide num_heads {config.num_heads}: use one of "
                          f"{_options(valid_tp_degrees(config, training, kv_replicas))}")
    if tp not in valid_tp_degrees(config, training, kv_replicas):
        rule = ("nor is a multiple of it (each kv head then replicated on tp / num_kv_heads "
                "ranks)" if kv_replicas else "(each TP rank needs whole KV heads)")
        raise ConfigError(f"tp {tp} does not divide num_kv_heads {config.num_kv_heads} {rule}: "
                          f"use one of {_options(valid_tp_degrees(config, training, kv_replicas))}")


def check_degrees(config: ModelConfig, tp: int, pp: int, ep: int, training: bool = True,
                  kv_replicas: bool = False) -> None:
    """The model-shape constraints of the degrees, whatever the GPU count."""
    check_tp(config, tp, training, kv_replicas)
    if pp > config.num_layers:
        raise ConfigError(f"pp {pp} is more than the model's {config.num_layers} layers: "
                          f"use pp <= {config.num_layers}")
    if ep > 1:
        if not config.is_moe:
            raise ConfigError(f"ep {ep} needs a mixture-of-experts model; {config.name} is "
                              f"dense: use --ep 1")
        if config.num_experts % ep:
            raise ConfigError(f"ep {ep} does not divide num_experts {config.num_experts}: "
                              f"use one of {_options(divisors(config.num_experts))}")


def check_training_layout(config: ModelConfig, num_gpus: int, layout: TrainLayout,
                          seq_len: int, kv_replicas: bool = False,
                          experts_over_tp: bool = False) -> None:
    """Raise ConfigError naming the first constraint the layout breaks and how to fix it.
    `kv_replicas`: tp may exceed the KV heads, as tetrad's trainer allows. `experts_over_tp`:
    ep may span tensor ranks too (TrainLayout.expert_tp), which the planner models for
    Megatron-Core's layouts and tetrad's runtime does not run."""
    check_degrees(config, layout.tp, layout.pp, layout.ep, kv_replicas=kv_replicas)
    if layout.world_size != num_gpus:
        raise ConfigError(
            f"tp*pp*dp*cp = {layout.tp}*{layout.pp}*{layout.dp}*{layout.cp} = "
            f"{layout.world_size}, but there are {num_gpus} GPUs: the degrees must multiply to "
            f"the GPU count")
    if layout.schedule == "interleaved":
        if layout.pp == 1 or layout.vpp < 2:
            raise ConfigError("the interleaved schedule needs pp > 1 and --vpp >= 2 "
                              "(model chunks per pipeline rank)")
        if layout.pp * layout.vpp > config.num_layers:
            raise ConfigError(f"pp*vpp = {layout.pp * layout.vpp} chunks is more than the "
                              f"{config.num_layers} layers: lower --vpp")
        if layout.num_microbatches % layout.pp:
            # Megatron's rule, and tetrad.schedules': forwards cycle through the chunks in
            # groups of pp microbatches.
            raise ConfigError(f"the interleaved schedule needs microbatches per step to be a "
                              f"multiple of pp = {layout.pp}, got {layout.num_microbatches}: "
                              f"change --global-batch or --micro-batch")
    elif layout.vpp != 1:
        raise ConfigError(f"--vpp {layout.vpp} needs --schedule interleaved")
    if layout.stage_layers and (len(layout.stage_layers) != layout.pp * layout.vpp
                                or sum(layout.stage_layers) != config.num_layers
                                or min(layout.stage_layers) < 1):
        raise ConfigError(f"stage_layers {list(layout.stage_layers)} must give each of the "
                          f"pp*vpp = {layout.pp * layout.vpp} stages at least one layer and add "
                          f"up to the model's {config.num_layers}")
    if layout.zero_group % layout.ep and not (
            experts_over_tp and (layout.zero_group * layout.tp) % layout.ep == 0):
        where = (f"tp*dp*cp = {layout.zero_group * layout.tp} (experts spread over tensor "
                 f"and data-parallel ranks)" if experts_over_tp else
                 f"dp*cp = {layout.zero_group} (tetrad's runtime spreads experts over the "
                 f"data-parallel ranks only)")
        raise ConfigError(f"ep {layout.ep} must divide {where}")
    if layout.cp > 1 and seq_len % (2 * layout.cp):
        raise ConfigError(f"cp {layout.cp} needs seq_len divisible by 2*cp = {2 * layout.cp} "
                          f"(each rank takes two balanced chunks of the causal sequence)")
    if config.position == "learned" and seq_len > config.max_seq_len:
        raise ConfigError(f"seq_len {seq_len} exceeds the learned position table "
                          f"({config.max_seq_len}): lower --seq-len")
    if layout.zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero must be 0, 1, 2 or 3, got {layout.zero}")
    if layout.offload and layout.zero == 0:
        raise ConfigError("--offload needs a ZeRO stage: add --zero 1, 2 or 3")
    if layout.schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, "
                          f"got {layout.schedule!r}")
    if layout.recompute not in ("none", "selective", "full"):
        raise ConfigError(f"recompute must be none, selective or full, got {layout.recompute!r}")
    if layout.micro_batch < 1 or layout.num_microbatches < 1:
        raise ConfigError("micro batch and number of microbatches must be at least 1")


def microbatches_for(global_batch: int, dp: int, micro_batch: int) -> int:
    """Microbatches per step; raises when the global batch does not split evenly."""
    if global_batch % (dp * micro_batch):
        raise ConfigError(
            f"global batch {global_batch} is not divisible by dp*micro_batch = {dp}*{micro_batch}"
            f" = {dp * micro_batch}: change --global-batch, --dp or --micro-batch")
    return global_batch // (dp * micro_batch)
