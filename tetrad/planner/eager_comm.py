"""The bytes one rank of tetrad's runtime hands to each kind of collective per optimizer step (the
`tetrad` runtime profile: tetrad.planner.eager), counted as its byte counter counts them
(tetrad.parallel.comm: ring volumes, p2p the message).

Every microbatch, with T tokens per rank (eager_activations.tokens), S_p = T h bytes of the
residual stream's dtype (the parameters') and S_a of the compute dtype:

  TP   per dense block the column-parallel layers' f (backward all-reduce of S_p) and the
       row-parallel layers' g (forward all-reduce of S_a), twice; an MoE block only attention's.
       Sequence parallelism turns f into an all-gather forward / reduce-scatter backward of S_p
       and g into a reduce-scatter forward / all-gather backward of S_a; an MoE block gathers its
       input forward and its output's gradient backward (S_p each). The embedding all-reduces its
       output forward (SP: reduce-scatter forward, all-gather backward), the head's f the
       gradient of its input, and the vocab-parallel loss two fp32 all-reduces over the tokens
       (the max logit; the sum of exponentials with the target logit: 12 T bytes).
  CP   ring attention per block: (cp - 1) K/V blocks forward, as many backward plus their fp32
       dK/dV accumulators; MoE blocks average their routed fractions over cp (E fp32).
  EP   per MoE block the per-expert counts ((ep - 1) E / ep int64), then dispatch (the stream's
       dtype) and combine (the compute dtype) forward, the reverse backward, of the copies that
       cross ranks: T k (ep - 1) / ep of them in the balanced routing assumed (the router decides
       each rank's share).
  Pa   --partition-activations: before each recomputed forward, the checkpoint's input
       all-gathered over tp (the flat input padded to tp, the parameters' dtype).
  PP   each stage's output forward (not the last stage's) and its input's gradient backward (not
       the first's), in the parameters' dtype; not across the turn of a V-shaped schedule, whose
       two stages share a rank.
  Full recomputation runs each block's forward again up to its last saved tensor (PyTorch's
  checkpoint stops there): every forward collective but the MLP's closing g (SP: its
  reduce-scatter), which overlap (tetrad.parallel.tp_overlap) runs too. Zero bubble's W walks a stage's graph a second time for the weight
  gradients under ZeRO-3 or recomputation (TrainLayout.backward_walks): on every stage but the
  first (whose B has no input gradient to compute, so W does the whole backward) each backward
  collective, and the recomputation, run twice. Otherwise W runs only the weight halves B left,
  no collective among them.

Per pipeline step (--grad-accum of them): the loss and load-balance loss summed over pp (two
fp32). Per optimizer step: the logged loss (and load-balance loss) reduced over dp * cp, the
gradient norm's partial sums over ZeRO's group, ep (experts), tp and pp (one fp64 each where the
group has more than one rank); a tied embedding's gradient all-reduced between its two pipeline
ranks after the last backward (ZeRO-2/3: their 1/N shard of it); the gradients (DDP: all-reduce
over dp * cp; ZeRO-1: reduce-scatter of the padded buckets, ZeRO-2: per microbatch, then the
parameters all-gathered; ZeRO-3: per microbatch each padded unit gathered for forward and again
for backward, under zero bubble a third time for W but on the first stage, and reduce-scattered;
--zero-bucket-size cuts each into calls of at most that many elements: runtime_rules.bucket_chunks),
the tp sum of gradients held in part (sequence-parallel replicas, shared kv rows; with ZeRO-2/3
per microbatch) and the experts' fp32 gradients summed over their edp replicas. Under a
pipeline "per microbatch" means per (stage, microbatch): ZeRO-2 reduces a stage's buckets and
ZeRO-3 its units after each backward of the stage (after W under zero bubble).
"""

from __future__ import annotations

from functools import lru_cache

from tetrad.spec.layout import FORWARD_AGAIN, sqrt_segment_ends
from tetrad.spec.model import ModelConfig
from tetrad.planner.comm import CommLedger
from tetrad.planner.eager_activations import checkpoints, kept_input_bytes, tokens
from tetrad.planner.eager_params import (kv_heads_per_rank, rank_parameters, rank_stages,
                                         stage_blocks)
from tetrad.planner.eager_state import reduced_together, zero3_units, zero_buckets
from tetrad.planner.layout import TrainLayout
from tetrad.planner.precision import TrainingPrecision
from tetrad.schedules.generate import SPLIT_BACKWARD
from tetrad.spec.runtime_rules import bucket_chunks, padded

FP32 = 4
INDEX = 8
SCALAR = 8  # the fp64 scalars all-reduced for the logs and the gradient norm


def tensor_parallel_block(ledger: CommLedger, config: ModelConfig, layout: TrainLayout,
                           layer: int, s_p: float, s_a: float, count: int, backwards: int,
                           reruns: int, whole_rerun: bool = False) -> None:
    """One block's f/g (or SP's gathers and scatters) over `count` microbatches, each with
    `backwards` backward passes through it and `reruns` recomputed forwards, which stop after
    the block's last saved tensor: before the MLP's closing g, unless overlap is on (the
    overlapped row-parallel layer's saved tensors are packed when it returns, after its g), or
    `whole_rerun` (a block before the last of a --recompute sqrt segment: the next block needs
    its output)."""
    tp, moe = layout.tp, config.is_moe_layer(layer)
    pairs = 1 if moe else 2  # column-parallel entries and row-parallel exits per block
    closes = layout.overlap or whole_rerun
    exits = pairs + reruns * (pairs if closes else 1)  # g (g_bar_seq), forwards
    if moe and config.num_shared_experts:
        # The shared experts, split like a dense MLP inside the whole MoE layer: f and g over
        # all tokens, SP or overlap or not. A recomputed forward stops before their closing g,
        # unless overlap runs them behind expert parallelism's dispatch, mid-layer.
        rerun = reruns if (layout.overlap and layout.ep > 1) or whole_rerun else 0
        ledger.add("all_reduce", tp, s_a, count * (1 + rerun))
        ledger.add("all_reduce", tp, s_p, count * backwards)
    if not layout.sequence_parallel:
        ledger.add("all_reduce", tp, s_a, count * exits)  # g, forward
        ledger.add("all_reduce", tp, s_p, count * pairs * backwards)  # f, backward
        return
    ledger.add("all_gather", tp, s_p, count * pairs * (1 + reruns))  # g_seq, forward
    ledger.add("reduce_scatter", tp, s_p, count * pairs * backwards)  # g_seq, backward
    ledger.add("reduce_scatter", tp, s_a, count * exits)  # g_bar_seq, forward
    ledger.add("all_gather", tp, s_a, count * pairs * backwards)  # g_bar_seq, backward
    if moe:  # the whole MoE layer gathers its input, and its output's gradient
        ledger.add("all_gather", tp, s_p, count * (1 + reruns + backwards))


def _activations(ledger: CommLedger, config: ModelConfig, layout: TrainLayout, seq_len: int,
                 precision: TrainingPrecision, pp_rank: int) -> None:
    """Tensor-, context-, expert-parallel and pipeline traffic of every microbatch."""
    act, stream, h = precision.activation_bytes, precision.param_bytes, config.hidden_size
    t, stream_tokens = tokens(layout, seq_len)
    m = layout.num_microbatches
    last = layout.pp * layout.vpp - 1
    kv = 2 * t * kv_heads_per_rank(config, layout.tp) * config.head_dim  # K and V elements
    e, k, ep = config.num_experts, config.num_experts_per_token, layout.ep
    stages = rank_stages(layout, pp_rank)
    for stage in stages:
        # Zero bubble's W may walk the stage's graph again (see the module doc).
        backwards = layout.backward_walks(stage)
        reruns = backwards if layout.recompute in FORWARD_AGAIN else 0
        forwards = 1 + reruns
        blocks = stage_blocks(config, layout, stage)
        ends = set(sqrt_segment_ends(blocks)) if layout.recompute == "sqrt" else set(blocks)
        if layout.partition_activations:  # each checkpoint's input gathered before its rerun
            gathered = kept_input_bytes(config, layout, seq_len, precision) * layout.tp
            ledger.add("all_gather", layout.tp, gathered,
                       m * reruns * checkpoints(config, layout, stage))
        for layer in blocks:
            tensor_parallel_block(ledger, config, layout, layer, t * h * stream, t * h * act, m,
                                   backwards, reruns, whole_rerun=layer not in ends)
            ledger.add("p2p", 1, kv * act, m * (layout.cp - 1) * (forwards + backwards))
            ledger.add("p2p", 1, kv * FP32, m * (layout.cp - 1) * backwards)
            if config.is_moe_layer(layer):
                ledger.add("all_reduce", layout.cp, e * FP32, m * forwards)
                ledger.add("all_to_all", ep, e * INDEX, m * forwards)
                # Dispatch (the stream's dtype) and combine (the compute dtype), each its own
                # call: the ring volume of T k copies is what crosses ranks.
                for dtype_bytes in (stream, act):
                    ledger.add("all_to_all", ep, t * k * h * dtype_bytes,
                               m * (forwards + backwards))
        if stage == 0:
            if layout.sequence_parallel:
                ledger.add("reduce_scatter", layout.tp, t * h * stream, m)
                ledger.add("all_gather", layout.tp, t * h * stream, m)
            else:
                ledger.add("all_reduce", layout.tp, t * h * stream, m)
        elif stage - 1 not in stages:  # the turn of a V stays on its rank: no send
            ledger.add("p2p", 1, stream_tokens * h * stream, m)
        if stage == last:
            if layout.sequence_parallel:
                ledger.add("all_gather", layout.tp, t * h * stream, m)
                ledger.add("reduce_scatter", layout.tp, t * h * stream, m * backwards)
            else:
                ledger.add("all_reduce", layout.tp, t * h * stream, m * backwards)
            # The vocab-parallel loss: the max logit, then the sums of exponentials with the
            # target logits, two calls.
            ledger.add("all_reduce", layout.tp, t * FP32, m)
            ledger.add("all_reduce", layout.tp, 2 * t * FP32, m)
        elif stage + 1 not in stages:
            ledger.add("p2p", 1, stream_tokens * h * stream, m)


def _gradients(ledger: CommLedger, config: ModelConfig, layout: TrainLayout,
               precision: TrainingPrecision, pp_rank: int) -> None:
    """The gradient reduction and ZeRO's parameter gathers of one optimizer step."""
    params = rank_parameters(config, layout, pp_rank)
    replicated = [p for p in params if not p.expert and not p.frozen]
    experts = [p for p in params if p.expert]
    pb, gb = precision.param_bytes, precision.grad_bytes
    n, m = layout.zero_group, layout.num_microbatches
    per_microbatch = layout.zero >= 2
    reductions = reduced_together(replicated, layout)
    for params_reduced in reductions:
        ledger.add("all_reduce", layout.tp, sum(p.partial for p in params_reduced) * gb,
                   m if per_microbatch else 1)
    ledger.add("all_reduce", n // layout.ep, sum(p.elements for p in experts) * FP32)
    if layout.zero == 0:
        for bucket in reductions:
            ledger.add("all_reduce", n, sum(p.elements for p in bucket) * gb)
    elif layout.zero in (1, 2):
        for bucket in zero_buckets(replicated, layout):
            ledger.add("reduce_scatter", n, bucket * gb, m if per_microbatch else 1)
            ledger.add("all_gather", n, bucket * pb)
    else:
        for stage, units in zero3_units(replicated, n).items():
            # Unit by unit: gathered for its forward, again for its backward (zero bubble's W a
            # third time, but on the first stage, whose B computes nothing), reduce-scattered.
            gathers = 3 if layout.schedule in SPLIT_BACKWARD and stage > 0 else 2
            for unit in units.all:  # --zero-bucket-size: a call per bucket of it
                for start, end in bucket_chunks(unit // n, n, layout.zero_bucket_size):
                    ledger.add("all_gather", n, (end - start) * n * pb, gathers * m)
                    ledger.add("reduce_scatter", n, (end - start) * n * gb, m)


def _scalars(ledger: CommLedger, config: ModelConfig, layout: TrainLayout,
             precision: TrainingPrecision, pp_rank: int) -> None:
    """Losses and norms, and the tied embedding's gradient between its two pipeline ranks."""
    params = rank_parameters(config, layout, pp_rank)
    dp_cp = layout.dp * layout.cp
    ledger.add("reduce", dp_cp, SCALAR, 2 if config.is_moe else 1)  # to rank 0, which logs
    if layout.zero >= 1:
        ledger.add("all_reduce", dp_cp, SCALAR)
    if any(p.expert for p in params):
        ledger.add("all_reduce", layout.ep, SCALAR)
    ledger.add("all_reduce", layout.tp, SCALAR)
    ledger.add("all_reduce", layout.pp, SCALAR)
    ledger.add("all_reduce", layout.pp, 2 * FP32, layout.grad_accum)
    # Aux-loss-free balancing: the routers' expert loads summed over dp x cp after each step.
    if config.router_bias_update_rate:
        ledger.add("all_reduce", dp_cp, sum(p.elements for p in params if p.frozen) * FP32)
    tied = [p for p in params if p.tied]
    if tied:  # summed once per step, after the last backward: ZeRO-2/3 sum their shards of it
        elements = tied[0].elements
        if layout.zero >= 2:
            elements = padded(elements, layout.zero_group) // layout.zero_group
        ledger.add("all_reduce", 2, elements * precision.grad_bytes)


@lru_cache(maxsize=1024)
def rank_comm(config: ModelConfig, layout: TrainLayout, seq_len: int,
              precision: TrainingPrecision, pp_rank: int) -> CommLedger:
    """Bytes per collective kind one rank of pipeline rank `pp_rank` sends per step."""
    ledger = CommLedger()
    _activations(ledger, config, layout, seq_len, precision, pp_rank)
    _gradients(ledger, config, layout, precision, pp_rank)
    _scalars(ledger, config, layout, precision, pp_rank)
    return ledger


def zero3_passes(layout: TrainLayout, pp_rank: int) -> int:
    """ZeRO-3's passes over the rank's stages per step (forward, backward, zero bubble's W):
    the first gather of each waits right after compute; every other unit's gather runs while
    the unit before it computes, and each reduce-scatter is retired behind the next unit's
    backward."""
    return layout.num_microbatches * sum(
        3 if layout.schedule in SPLIT_BACKWARD and stage > 0 else 2
        for stage in rank_stages(layout, pp_rank))


@lru_cache(maxsize=1024)
def overlapped_calls(config: ModelConfig, layout: TrainLayout, precision: TrainingPrecision,
                     pp_rank: int) -> float:
    """Calls issued between computations that wait for nothing (zero3_passes): ZeRO-3's per-unit
    gathers and reduce-scatters but each pass's first gather and the one that leads the step's
    closing burst."""
    if layout.zero != 3 or layout.zero_group == 1:
        return 0.0
    end = CommLedger()
    _gradients(end, config, layout, precision, pp_rank)
    sharded = sum(count for (kind, size, _), count in end.calls.items()
                  if size == layout.zero_group and kind in ("all_gather", "reduce_scatter"))
    return float(sharded - zero3_passes(layout, pp_rank) - 1)


@lru_cache(maxsize=1024)
def queued_calls(config: ModelConfig, layout: TrainLayout, seq_len: int,
                 precision: TrainingPrecision, pp_rank: int) -> float:
    """How many calls between computations come right behind another call, only a norm and a
    residual add apart, and so find their peers still running (what calls back to back cost,
    EfficiencyProfile.sync_wait_back_to_back): sequence parallelism's all-gathers, each behind
    the reduce-scatter that closed the layer before it (forward: a block's attention and MLP
    behind the previous one's exit, the head behind the last block's; backward: the reverse)."""
    if not layout.sequence_parallel or layout.tp == 1:
        return 0.0
    during = CommLedger()
    _activations(during, config, layout, seq_len, precision, pp_rank)
    return float(sum(count for (kind, size, _), count in during.calls.items()
                     if kind == "all_gather" and size == layout.tp))


@lru_cache(maxsize=1024)
def waiting_calls(config: ModelConfig, layout: TrainLayout, seq_len: int,
                  precision: TrainingPrecision, pp_rank: int) -> float:
    """How many of rank_comm's calls start right after compute, each waiting for its peers to be
    scheduled again (EfficiencyProfile.sync_wait): every call between computations (tensor,
    context, expert and pipeline traffic but queued_calls; the first gather of each of ZeRO-3's
    passes, zero3_passes; ZeRO-2's reduce-scatter after every backward but the last) and the
    first call of each burst at the step's end (the gradient reduction, with the norms and
    losses right behind it; ZeRO-1/2's parameter gather after the optimizer). The calls of a
    burst follow each other with no compute between them: their peers are already there."""
    during = CommLedger()
    _activations(during, config, layout, seq_len, precision, pp_rank)
    calls = sum(during.calls.values()) - queued_calls(config, layout, seq_len, precision,
                                                      pp_rank)
    end = CommLedger()
    _gradients(end, config, layout, precision, pp_rank)
    n = layout.zero_group
    if layout.zero == 3 and n > 1:
        calls += zero3_passes(layout, pp_rank)
    elif layout.zero == 2:
        # ZeRO-2 reduces after every backward, the last one's leading the end burst.
        calls += layout.num_microbatches - 1
    _scalars(end, config, layout, precision, pp_rank)
    if end.calls:
        calls += 1 + (layout.zero in (1, 2) and n > 1)
    return float(calls)
