"""The search for the best layout: every valid combination of the degrees and knobs the user left
open, ranked by throughput among those that fit (and by how little they overshoot, when none does).

Search rules (given values are always used as given):
  tp      divides the attention heads (and KV heads for training) and fits in a node
  cp      powers of two that leave each rank at least MIN_CP_TOKENS tokens of the sequence
  pp      divides the remaining GPUs and is at most the layer count; dp is what is left
  ep      divides the experts and dp*cp (MoE only)
  micro batch   divides the per-replica batch, up to MAX_MICRO_BATCH
  schedule      1F1B, zero bubble, interleaved (vpp up to MAX_VPP, at least a layer per
                chunk, microbatches a multiple of pp), ZB-V and DualPipeV (two chunks in a V;
                DualPipeV with at least 2 pp microbatches, hiding a MoE model's expert
                all-to-all in its overlapped pairs); GPipe only when asked for (it has 1F1B's
                bubble and more memory)
  sequence parallel   on whenever tp > 1 (it only saves memory and element-wise work), off
                      under --partition-activations (which splits the same inputs; tp > 1 then)
  zero    1-3 with data parallelism (stage 0 moves the same bytes as stage 1 with more memory,
          so only when asked for), 0 without
  recompute     the least of none / selective / full / sqrt that fits (more only adds work;
                sqrt reruns what full does and keeps less, so it comes last); full or sqrt
                under --partition-activations / --offload-activations
  offload       none, then the optimizer state on the host (ZeRO 1-3), then ZeRO-3's parameter
                shard too (--offload params), each tried only where the one before fits with
                no recomputation: offloading adds host transfers to a layout, so it is worth
                it only where it fits with less recomputation, or at all. nvme holds the same
                on the device as params (its files only spare host memory): only when asked
Memory is computed for every candidate; time only for those that fit (or, when none fits, for the
ones that come closest).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tetrad.spec.layout import FORWARD_AGAIN, OFFLOAD_MODES
from tetrad.spec.model import ModelConfig
from tetrad.errors import ConfigError, check_choice
from tetrad.hardware.catalog import Cluster
from tetrad.planner.layout import TrainLayout, check_training_layout, microbatches_for
from tetrad.schedules.generate import V_SHAPED
from tetrad.planner.rules import check_degrees, divisors, valid_tp_degrees
from tetrad.planner.memory import peak_bytes_by_zero_stage
from tetrad.planner.serving import (ServeLayout, ServeWorkload, ServingEstimate,
                                    check_serve_layout, evaluate_serving, experts_spread)
from tetrad.planner.quantized import quantization_refusal
from tetrad.planner.runtime_memory import usable_tensor_memory
from tetrad.planner.ranking import fastest_shapes
from tetrad.planner.training import TrainingEstimate, TrainWorkload, evaluate_training

MIN_CP_TOKENS = 2048
MAX_MICRO_BATCH = 16
MAX_VPP = 8


@dataclass(frozen=True)
class TrainSpace:
    """The user's fixed choices; None means searched."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    ep: int | None = None
    vpp: int | None = None
    zero: int | None = None
    offload: bool = False  # True: --offload optimizer (offload_mode's older spelling)
    recompute: str | None = None
    sequence_parallel: bool | None = None
    schedule: str | None = None
    micro_batch: int | None = None
    offload_mode: str | None = None  # OFFLOAD_MODES
    # ZeRO-R's options (ZERO_R) on every layout, which the CLI checks each searched one holds.
    zero_bucket_size: int = 0
    contiguous_buffers: bool = False
    partition_activations: bool = False
    offload_activations: bool = False

    @property
    def offload_modes(self) -> tuple[str, ...]:
        """The offload modes to try, in order (the module doc's rule)."""
        if self.offload_mode is not None:
            return (self.offload_mode,)
        return ("optimizer",) if self.offload else SEARCHED_OFFLOADS


SEARCHED_OFFLOADS = ("none", "optimizer", "params")
ZERO_R = ("zero_bucket_size", "contiguous_buffers", "partition_activations", "offload_activations")
RECOMPUTES = ("none", "selective", "full", "sqrt")


@dataclass(frozen=True)
class SearchResult:
    ranked: list[TrainingEstimate] | list[ServingEstimate]  # best first
    num_candidates: int
    num_fitting: int


def _choices(given, options):
    return [given] if given is not None else list(options)


def _schedules(config: ModelConfig, pp: int, space: TrainSpace) -> list[tuple[str, int]]:
    if pp == 1:
        if space.schedule not in (None, "1f1b", "gpipe") or (space.vpp or 1) > 1:
            if space.pp == 1:
                raise ConfigError("--schedule and --vpp need pipeline parallelism (pp > 1)")
            return []  # pp left open: the pipelined shapes carry the schedule asked for
        return [(space.schedule or "1f1b", 1)]
    if space.schedule in V_SHAPED:
        return [(space.schedule, 2)]
    if space.schedule is not None and space.schedule != "interleaved":
        return [(space.schedule, 1)]
    vpps = [space.vpp] if space.vpp else [v for v in range(2, MAX_VPP + 1)
                                          if pp * v <= config.num_layers]
    interleaved = [("interleaved", v) for v in vpps]
    if space.schedule == "interleaved" or (space.vpp or 1) > 1:  # --vpp alone means interleaved
        return interleaved
    v_shaped = [(name, 2) for name in sorted(V_SHAPED) if 2 * pp <= config.num_layers]
    return [("1f1b", 1), ("zb", 1)] + interleaved + v_shaped


def training_layouts(config: ModelConfig, cluster: Cluster, global_batch: int, seq_len: int,
                     space: TrainSpace):
    """Every valid layout shape in the space, with ZeRO stage 0 and no recomputation standing
    in for the choices search_training makes per shape (given values are validated, not
    silently dropped)."""
    n = cluster.num_gpus
    tps = _choices(space.tp, [t for t in valid_tp_degrees(config)
                              if n % t == 0 and t <= cluster.node_size
                              and (t > 1 or not space.partition_activations)])
    cps = _choices(space.cp, [c for c in (2 ** i for i in range(0, 20))
                              if c == 1 or (seq_len % (2 * c) == 0
                                            and seq_len // c >= MIN_CP_TOKENS)])
    for tp in tps:
        for cp in cps:
            if n % (tp * cp):
                continue
            rest = n // (tp * cp)
            pps = _choices(space.pp, divisors(rest, at_most=config.num_layers))
            for pp in pps:
                if rest % pp:
                    continue
                dp = rest // pp
                if (space.dp is not None and dp != space.dp) or global_batch % dp:
                    continue
                eps = _choices(space.ep, [e for e in divisors(dp * cp)
                                          if config.is_moe and config.num_experts % e == 0]
                               or [1])
                micro_batches = _choices(space.micro_batch,
                                         divisors(global_batch // dp, at_most=MAX_MICRO_BATCH))
                sequence_parallel = (space.sequence_parallel if space.sequence_parallel
                                     is not None else tp > 1 and not space.partition_activations)
                for ep in eps:
                    for schedule, vpp in _schedules(config, pp, space):
                        for micro_batch in micro_batches:
                            if global_batch % (dp * micro_batch):
                                continue
                            m = global_batch // (dp * micro_batch)
                            if schedule == "interleaved" and m % pp and (
                                    space.schedule is None or space.micro_batch is None):
                                continue  # interleaving needs a multiple of pp microbatches
                            if schedule == "dualpipe" and m < 2 * pp and (
                                    space.schedule is None or space.micro_batch is None):
                                continue  # DualPipeV needs a microbatch per stage
                            yield TrainLayout(
                                tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vpp=vpp,
                                zero=1 if space.offload else 0, offload=space.offload,
                                sequence_parallel=sequence_parallel, schedule=schedule,
                                microbatches=m, micro_batch=micro_batch)


def _variant(layout: TrainLayout, **choices) -> TrainLayout:
    """`layout` (validated) with a recomputation, ZeRO stage and offload the search chose by its
    rules (_zero_stages), as dataclasses.replace would build it but without ParallelConfig's
    checks again: re-validating ~2,000 candidates was a fifth of a large search's time.
    tests/test_planner_search_speed.py checks each equal to the validated copy."""
    variant = object.__new__(TrainLayout)
    variant.__dict__.update(layout.__dict__, **choices)
    return variant


def _zero_stages(layout: TrainLayout, space: TrainSpace, offload: str) -> tuple[int, ...]:
    """ZeRO stages worth trying with `offload`. Without data parallelism they are all the same as
    stage 0 (offload needs a stage: 1, or 3 for the parameter shard); with it, stage 1 moves the
    same bytes as stage 0 with less memory, so stage 0 only when asked. Empty: the given stage
    cannot hold that offload."""
    if offload in ("params", "nvme"):
        return (3,) if space.zero in (None, 3) else ()
    if space.zero is not None:
        return (space.zero,) if offload == "none" or space.zero else ()
    if layout.zero_group == 1:
        return (1,) if offload != "none" else (0,)
    return (1, 2, 3)


def _explain_no_layout(config: ModelConfig, cluster: Cluster, global_batch: int, seq_len: int,
                       space: TrainSpace) -> None:
    """Nothing matched the given values: say which constraint they break."""
    check_degrees(config, space.tp or 1, space.pp or 1, space.ep or 1)
    model_parallel = (space.tp or 1) * (space.pp or 1) * (space.cp or 1)
    n = cluster.num_gpus
    if space.dp is not None and model_parallel * space.dp != n:
        raise ConfigError(f"tp*pp*dp*cp = {model_parallel * space.dp}, but there are {n} GPUs: "
                          f"the degrees must multiply to the GPU count")
    if n % model_parallel:
        raise ConfigError(f"tp*pp*cp = {model_parallel} does not divide the {n} GPUs: the "
                          f"degrees must multiply to the GPU count")
    if space.cp and space.cp > 1 and seq_len % (2 * space.cp):
        raise ConfigError(f"cp {space.cp} needs seq_len divisible by 2*cp = {2 * space.cp}")
    dp = space.dp or n // model_parallel
    microbatches_for(global_batch, dp, space.micro_batch or 1)
    raise ConfigError(f"no valid layout of {n} GPUs matches the given degrees with global "
                      f"batch {global_batch}: leave more degrees open or change the batch")


def check_training_space(cluster: Cluster, workload: TrainWorkload, global_batch: int,
                         space: TrainSpace) -> None:
    """Given choices that contradict each other or the hardware, refused before the search
    (which would otherwise drop or ignore them without a word)."""
    if workload.seq_len < 1 or global_batch < 1:
        raise ConfigError(f"seq_len and global batch must be at least 1, got {workload.seq_len} "
                          f"and {global_batch}")
    if (space.vpp is not None and space.vpp > 1
            and space.schedule not in (None, "interleaved", *V_SHAPED)):
        raise ConfigError(f"--vpp {space.vpp} needs --schedule interleaved, not "
                          f"{space.schedule}: drop --vpp or use the interleaved schedule")
    if space.zero:
        # The most ranks ZeRO can shard over: dp*cp as given, else what tp*pp leaves of the GPUs.
        if space.dp is not None:
            sharding, given = space.dp * (space.cp or 1), f"--dp {space.dp}"
        else:
            fixed = (space.tp or 1) * (space.pp or 1)
            sharding = cluster.num_gpus // fixed
            given = f"tp*pp = {fixed} of {cluster.num_gpus} GPUs"
        if sharding == 1:
            raise ConfigError(f"--zero {space.zero} shards over dp*cp ranks, and {given} leaves "
                              f"one: use --zero 0 or more data-parallel ranks")
    if space.offload_mode is not None:
        check_choice("offload", space.offload_mode, OFFLOAD_MODES)
        if space.offload_mode in ("params", "nvme") and space.zero not in (None, 3):
            raise ConfigError(f"--offload {space.offload_mode} moves ZeRO-3's parameter shard: "
                              f"use --zero 3 (or leave it open), or --offload optimizer")
        if space.offload_mode != "none" and space.zero == 0:
            raise ConfigError("--offload needs a ZeRO stage: add --zero 1, 2 or 3")
    compute = workload.precision.compute_dtype
    if compute not in cluster.gpu.peak_flops:
        raise ConfigError(f"{cluster.gpu.name} has no {compute} tensor cores: train in "
                          f"{', '.join(d for d in ('bf16', 'fp16') if d in cluster.gpu.peak_flops)}")


RANKINGS = ("time", "cost")


def search_training(config: ModelConfig, cluster: Cluster, workload: TrainWorkload,
                    global_batch: int, space: TrainSpace = TrainSpace(),
                    top: int = 5, rank_by: str = "time") -> SearchResult:
    """Rank the layouts of `space`. Per layout shape, recomputation is tried from none to sqrt
    and the search keeps the least that fits (more recomputation only adds work), then with
    the optimizer state and then the parameter shard offloaded where that fits with less
    recomputation (the module doc); memory is computed for every candidate, time only for the
    fitting ones. By time: the fastest step on
    all the GPUs. By cost: the fewest GPU-seconds per token, on all the GPUs or on a half, a
    quarter, ... of them (fewer GPUs communicate less, so they can train cheaper, only slower;
    the rental price per GPU-hour is the same for each, so it does not change the order)."""
    if rank_by not in RANKINGS:
        raise ConfigError(f"--rank-by must be one of {', '.join(RANKINGS)}, got {rank_by!r}")
    if rank_by == "cost":
        return _search_by_cost(config, cluster, workload, global_batch, space, top)
    check_training_space(cluster, workload, global_batch, space)
    precision, options = workload.precision, workload.activation_options
    kept_inputs = space.partition_activations or space.offload_activations
    recomputes = _choices(space.recompute, FORWARD_AGAIN if kept_inputs else RECOMPUTES)
    closest: list[tuple[float, TrainLayout]] = []
    fitting: list[TrainLayout] = []
    num_candidates = 0
    for shape in training_layouts(config, cluster, global_batch, workload.seq_len, space):
        tried = recomputes  # what a further offload may still save: less recomputation
        for offload in space.offload_modes:
            zeros = _zero_stages(shape, space, offload)
            if not zeros:
                continue
            for recompute in tried:
                layout = _variant(shape, recompute=recompute, zero=zeros[0],
                                  offload=offload != "none", offload_mode=offload,
                                  **{name: getattr(space, name) for name in ZERO_R})
                check_training_layout(config, cluster.num_gpus, layout, workload.seq_len,
                                      experts_over_tp=workload.runtime != "tetrad")
                totals = peak_bytes_by_zero_stage(config, layout, precision,
                                                  workload.seq_len, options, zeros)
                num_candidates += len(zeros)
                usable = usable_tensor_memory(cluster.gpu.memory_bytes, layout)
                fits = [zero for zero, total in zip(zeros, totals) if total <= usable]
                fitting += [layout if zero == layout.zero else _variant(layout, zero=zero)
                            for zero in fits]
                if fits:
                    tried = tried[:tried.index(recompute)]
                    break
                closest.append((min(totals),
                                _variant(layout, zero=zeros[totals.index(min(totals))])))
            if not tried:
                break
    if not num_candidates:
        _explain_no_layout(config, cluster, global_batch, workload.seq_len, space)
    if fitting:
        chosen = fastest_shapes(config, cluster, workload, fitting, top)
    else:
        chosen = [layout for _, layout in sorted(closest, key=lambda pair: pair[0])[:top]]
    # The winners again, with their per-collective byte counts.
    ranked = [evaluate_training(config, cluster, layout, workload) for layout in chosen]
    return SearchResult(ranked, num_candidates, len(fitting))


def _search_by_cost(config: ModelConfig, cluster: Cluster, workload: TrainWorkload,
                    global_batch: int, space: TrainSpace, top: int) -> SearchResult:
    """search_training by cost: each halving of the cluster searched by time, the winners of
    all ranked by GPU-seconds per token (a count the given degrees or the batch rule out is
    skipped; the whole cluster's refusal stands)."""
    results, count = [], cluster.num_gpus
    while True:
        try:
            results.append(search_training(config, dataclasses.replace(cluster, num_gpus=count),
                                           workload, global_batch, space, top))
        except ConfigError:
            if count == cluster.num_gpus:
                raise
        if count % 2:
            break
        count //= 2
    fitting = [e for result in results for e in result.ranked if result.num_fitting]
    ranked = (sorted(fitting, key=lambda e: (e.num_gpus / e.tokens_per_s, -e.tokens_per_s))
              if fitting else results[0].ranked)
    return SearchResult(ranked[:top], sum(r.num_candidates for r in results),
                        sum(r.num_fitting for r in results))


@dataclass(frozen=True)
class ServeSpace:
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None


def serving_layouts(config: ModelConfig, cluster: Cluster, space: ServeSpace):
    n = cluster.num_gpus
    for tp in _choices(space.tp, [t for t in valid_tp_degrees(config, training=False)
                                  if n % t == 0]):
        if n % tp:
            continue
        for pp in _choices(space.pp, divisors(n // tp, at_most=config.num_layers)):
            if (n // tp) % pp:
                continue
            dp = n // (tp * pp)
            # Experts either split by columns over the TP group (ep 1) or spread whole from
            # the TP group outward (ep a multiple of tp); ep between 1 and tp is neither.
            eps = [1]
            if config.is_moe:
                eps += [e for e in divisors(tp * dp) if config.num_experts % e == 0
                        and e % tp == 0 and e > 1]
            for ep in _choices(space.ep, eps):
                if experts_spread(tp, dp, ep):  # a given ep skips the pp that leave too few dp
                    yield ServeLayout(tp, pp, dp, ep)


def search_serving(config: ModelConfig, cluster: Cluster, workload: ServeWorkload,
                   space: ServeSpace = ServeSpace(), top: int = 5,
                   rank_by: str = "cost") -> SearchResult:
    """Serving layouts that fit, by cost (the most decode tokens per second from the same GPUs,
    so the most per dollar) or by time (the shortest whole request: the batch's prefill and
    every decode step)."""
    if rank_by not in RANKINGS:
        raise ConfigError(f"--rank-by must be one of {', '.join(RANKINGS)}, got {rank_by!r}")
    estimates: list[ServingEstimate] = []
    refusals: list[str] = []  # layouts whose int4 shards the engine cannot hold
    for layout in serving_layouts(config, cluster, space):
        check_serve_layout(config, cluster.num_gpus, layout)
        if refusal := quantization_refusal(config, layout, workload.weight_dtype):
            refusals.append(refusal)
            continue
        estimates.append(evaluate_serving(config, cluster, layout, workload))
    if not estimates and refusals:
        raise ConfigError(refusals[0])
    if not estimates:
        check_degrees(config, space.tp or 1, space.pp or 1, space.ep or 1, training=False)
        given = (space.tp or 1) * (space.pp or 1)
        if cluster.num_gpus % given or not space.ep:
            raise ConfigError(f"tp*pp = {given} does not divide the {cluster.num_gpus} GPUs: "
                              f"change the given degrees")
        raise ConfigError(f"ep {space.ep} cannot spread over any layout of the "
                          f"{cluster.num_gpus} GPUs with the given degrees: ep must divide tp*dp "
                          f"and be a multiple or divisor of tp (dp = GPUs / (tp*pp))")
    fitting = [e for e in estimates if e.fits]
    if fitting:
        fitting.sort(key=(lambda e: (e.request_s, -e.decode_tokens_per_s)) if rank_by == "time"
                     else (lambda e: (-e.decode_tokens_per_s, e.tpot_s)))
        ranked = fitting
    else:
        ranked = sorted(estimates, key=lambda e: e.weights + e.activations)
    return SearchResult(ranked[:top], len(estimates), len(fitting))
