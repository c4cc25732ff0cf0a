"""The layout search against brute force: every candidate shape the search rules (the module doc
of tetrad/planner/search.py) allow, found by trying every integer, and the ranking the search
returns against every candidate evaluated in full."""

from __future__ import annotations

import dataclasses

import pytest

from tetrad.errors import ConfigError
from tetrad.hardware.profile import cluster
from tetrad.planner.layout import TrainLayout
from tetrad.planner.rules import valid_tp_degrees
from tetrad.planner.search import (ServeSpace, TrainSpace, search_serving, search_training,
                                   serving_layouts, training_layouts)
from tetrad.planner.serving import ServeLayout, ServeWorkload, evaluate_serving
from tetrad.planner.training import TrainWorkload, evaluate_training
from tetrad.spec.presets import preset

RECOMPUTES = ("none", "selective", "full", "sqrt")


def _given(value, options):
    return [value] if value is not None else list(options)


def _divides(n: int, at_most: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (at_most is None or d <= at_most)]


def _schedules(config, pp: int, m: int, space: TrainSpace) -> list[tuple[str, int]]:
    pipelined = space.schedule not in (None, "1f1b", "gpipe") or (space.vpp or 1) > 1
    if pp == 1:  # a schedule or vpp that needs a pipeline leaves pp 1 out of an open search
        return [] if pipelined else [(space.schedule or "1f1b", 1)]
    # Interleaving needs a multiple of pp microbatches, DualPipeV 2 pp of them (unless schedule
    # and micro batch are both given: then the layout check names the problem).
    both_given = space.schedule is not None and space.micro_batch is not None
    if space.schedule in ("zbv", "dualpipe"):
        return [(space.schedule, 2)] if space.schedule == "zbv" or m >= 2 * pp or both_given \
            else []
    if space.schedule not in (None, "interleaved"):
        return [(space.schedule, 1)]
    vpps = _given(space.vpp, [v for v in range(2, 9) if pp * v <= config.num_layers])
    interleaved = [("interleaved", v) for v in vpps if m % pp == 0 or both_given]
    if space.schedule or (space.vpp or 1) > 1:  # --vpp alone asks for interleaving
        return interleaved
    v_shaped = [(name, 2) for name in ("dualpipe", "zbv") if 2 * pp <= config.num_layers
                and (name == "zbv" or m >= 2 * pp)]
    return [("1f1b", 1), ("zb", 1)] + interleaved + v_shaped


def reference_shapes(config, world, batch: int, seq_len: int, space=TrainSpace()) -> list:
    """Every shape the search rules allow, by trying every integer up to the GPU count."""
    n, shapes = world.num_gpus, []
    tps = _given(space.tp, [t for t in valid_tp_degrees(config)
                            if t <= world.gpus_per_node and n % t == 0])
    cps = _given(space.cp, [c for c in range(1, n + 1) if c & (c - 1) == 0 and (
        c == 1 or seq_len % (2 * c) == 0 and seq_len // c >= 2048)])
    for tp in tps:
        for cp in cps:
            if n % (tp * cp):
                continue
            rest = n // (tp * cp)
            for pp in _given(space.pp, _divides(rest, config.num_layers)):
                dp = rest // pp
                if rest % pp or batch % dp or space.dp not in (None, dp):
                    continue
                experts = [e for e in _divides(dp * cp) if config.num_experts % e == 0]
                for ep in _given(space.ep, experts if config.is_moe else [1]):
                    for micro in _given(space.micro_batch, _divides(batch // dp, 16)):
                        if batch % (dp * micro):
                            continue
                        m = batch // (dp * micro)
                        for schedule, vpp in _schedules(config, pp, m, space):
                            shapes.append(TrainLayout(
                                tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vpp=vpp, schedule=schedule,
                                zero=1 if space.offload else 0, offload=space.offload,
                                sequence_parallel=(tp > 1 if space.sequence_parallel is None
                                                   else space.sequence_parallel),
                                microbatches=m, micro_batch=micro))
    return shapes


SHAPE_CASES = [
    # dense, a node of 4: tp stops at the node; cp 1, 2, 4 leave >= 2048 tokens of 8192
    ("llama3-8b", {}, 8, 4, 12, 8192, TrainSpace()),
    # a given micro batch leaves 3 microbatches on 4 stages: no interleaving there
    ("llama3-8b", {}, 8, 8, 12, 4096, TrainSpace(micro_batch=2)),
    # 4 layers: pp and pp*vpp stop at the layer count; batch 16 gives every micro batch to 16
    ("llama3-8b", {"num_layers": 4}, 16, 8, 32, 4096, TrainSpace()),
    # experts: ep over dp*cp, dividing the 8 experts
    ("mixtral-8x7b", {}, 8, 8, 8, 4096, TrainSpace()),
    # given values used as given, searched ones by the rules
    ("llama3-8b", {}, 16, 8, 32, 4096, TrainSpace(pp=2, schedule="interleaved")),
    ("llama3-8b", {}, 16, 4, 64, 4096, TrainSpace(tp=8, pp=2, vpp=2, sequence_parallel=False)),
    ("mixtral-8x7b", {}, 16, 8, 16, 8192, TrainSpace(ep=2, cp=2, micro_batch=2)),
    ("llama3-8b", {}, 8, 8, 8, 4096, TrainSpace(dp=2, offload=True)),
    # 34 sequences on 2 GPUs: micro batches 1, 17 and 34 divide 34, only 1 is at most 16
    ("llama3-8b", {"num_layers": 4}, 2, 2, 34, 4096, TrainSpace()),
    ("llama3-8b", {}, 8, 8, 16, 4096, TrainSpace(pp=2, schedule="interleaved", vpp=2,
                                                 micro_batch=2)),
]


@pytest.mark.parametrize("name,changes,n,per_node,batch,seq_len,space", SHAPE_CASES)
def test_candidate_shapes_are_exactly_those_the_rules_allow(name, changes, n, per_node, batch,
                                                            seq_len, space):
    config = preset(name).replace(**changes)
    world = cluster("h100-sxm", n, gpus_per_node=per_node)
    found = list(training_layouts(config, world, batch, seq_len, space))
    expected = reference_shapes(config, world, batch, seq_len, space)
    assert len(found) == len(set(found))
    assert set(found) == set(expected)


def _zero_stages(layout: TrainLayout, space: TrainSpace, offload: str) -> tuple[int, ...]:
    if offload in ("params", "nvme"):
        return (3,) if space.zero in (None, 3) else ()
    if space.zero is not None:
        return (space.zero,) if offload == "none" or space.zero else ()
    if layout.dp * layout.cp == 1:
        return (0,) if offload == "none" else (1,)
    return (1, 2, 3)


def _offloads(space: TrainSpace) -> tuple[str, ...]:
    if space.offload_mode is not None:
        return (space.offload_mode,)
    return ("optimizer",) if space.offload else ("none", "optimizer", "params")


def reference_search(config, world, workload, batch, space, top):
    """Every candidate evaluated in full: per shape and offload mode (none, the optimizer, the
    parameters), the least recomputation at which some ZeRO stage fits, the next mode tried
    only with less recomputation than the least that fitted so far; ranked by throughput, then
    memory; one layout per shape. None fitting: per shape, mode and recomputation the ZeRO stage
    closest to fitting, ranked by memory."""
    fitting, closest, candidates = [], [], 0
    for shape in reference_shapes(config, world, batch, workload.seq_len, space):
        least = None  # the least recomputation that fitted, over the modes so far
        recomputes = _given(space.recompute, RECOMPUTES)
        for offload in _offloads(space):
            if least == recomputes[0]:
                break
            for recompute in recomputes:
                if least is not None and recomputes.index(recompute) >= recomputes.index(least):
                    break
                estimates = [evaluate_training(config, world, dataclasses.replace(
                    shape, zero=zero, recompute=recompute, offload=offload != "none",
                    offload_mode=offload), workload, count_bytes=False)
                    for zero in _zero_stages(shape, space, offload)]
                candidates += len(estimates)
                fits = [e for e in estimates if e.fits]
                fitting += fits
                if fits:
                    least = recompute
                    break
                if estimates:
                    closest.append(min(estimates, key=lambda e: e.memory.total))
    if not fitting:
        ranked = sorted(closest, key=lambda e: e.memory.total)[:top]
        return [e.layout for e in ranked], candidates, 0
    fitting.sort(key=lambda e: (-e.tokens_per_s, e.memory.total))
    chosen, shapes = [], set()
    for estimate in fitting:
        layout = estimate.layout
        shape = (layout.tp, layout.pp, layout.dp, layout.cp, layout.ep, layout.schedule,
                 layout.vpp, layout.micro_batch)
        if shape not in shapes and len(chosen) < top:
            shapes.add(shape)
            chosen.append(layout)
    return chosen, candidates, len(fitting)


SEARCH_CASES = [
    # 8B on 4 A100-40GBs: some shapes fit only with full recomputation or ZeRO-3, many not at all
    ("llama3-8b", "a100-40gb", 4, 8, 4096, TrainSpace(), 5),
    # one data-parallel rank: ZeRO stage 0, or 1 with offload
    ("llama3-8b", "h100-sxm", 4, 4, 4096, TrainSpace(dp=1), 2),
    ("llama3-8b", "h100-sxm", 4, 4, 4096, TrainSpace(dp=1, offload=True), 2),
    # nothing fits: the closest layouts, by memory
    ("llama3-70b", "h100-sxm", 2, 4, 4096, TrainSpace(), 5),
    ("llama3-70b", "a100-80gb", 8, 8, 4096, TrainSpace(zero=2, recompute="selective"), 5),
    # 8B on one 24 GB GPU: nothing fits without the parameter shard on the host
    ("llama3-8b", "rtx-4090", 1, 8, 2048, TrainSpace(), 4),
    # 70B on 8 A100-40GBs: the optimizer's or the parameters' offload spares recomputation
    ("llama3-70b", "a100-40gb", 8, 8, 4096, TrainSpace(tp=8), 5),
    ("llama3-70b", "a100-40gb", 8, 8, 4096, TrainSpace(tp=8, offload_mode="params"), 5),
]


@pytest.mark.parametrize("name,gpu,n,batch,seq_len,space,top", SEARCH_CASES)
def test_search_ranks_as_brute_force_over_every_candidate(name, gpu, n, batch, seq_len, space,
                                                         top):
    config, world = preset(name), cluster(gpu, n)
    workload = TrainWorkload(seq_len=seq_len)
    result = search_training(config, world, workload, batch, space, top)
    layouts, candidates, num_fitting = reference_search(config, world, workload, batch, space,
                                                        top)
    assert (result.num_candidates, result.num_fitting) == (candidates, num_fitting)
    assert [e.layout for e in result.ranked] == layouts
    assert all(e.fits == bool(num_fitting) for e in result.ranked)


def reference_serving_layouts(config, n: int, space=ServeSpace()) -> list[ServeLayout]:
    layouts = []
    for tp in _given(space.tp, [t for t in valid_tp_degrees(config, training=False)
                                if n % t == 0]):
        for pp in _given(space.pp, _divides(n // tp, config.num_layers)):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            # ep 1 (experts split by columns over tp) or a multiple of tp spreading whole experts
            spread = [e for e in _divides(tp * dp) if e > 1 and e % tp == 0
                      and config.num_experts % e == 0] if config.is_moe else []
            layouts += [ServeLayout(tp, pp, dp, ep) for ep in _given(space.ep, [1] + spread)]
    return layouts


@pytest.mark.parametrize("name,changes,n,space", [
    ("llama3-8b", {}, 8, ServeSpace()),
    ("llama3-8b", {"num_layers": 2}, 8, ServeSpace()),
    ("mixtral-8x7b", {}, 8, ServeSpace()),
    ("mixtral-8x7b", {}, 16, ServeSpace(tp=2)),
    ("llama3-8b", {}, 6, ServeSpace(pp=3)),
    ("llama3-8b", {}, 16, ServeSpace()),  # serving replicates the 8 kv heads over tp 16
])
def test_serving_candidates_are_exactly_those_the_rules_allow(name, changes, n, space):
    config = preset(name).replace(**changes)
    found = list(serving_layouts(config, cluster("h100-sxm", n), space))
    assert len(found) == len(set(found))
    assert set(found) == set(reference_serving_layouts(config, n, space))


@pytest.mark.parametrize("name,gpu,n,batch,top", [
    ("llama3-70b", "h100-sxm", 8, 64, 3),  # some fit: fastest decode first
    ("llama3-70b", "rtx-4090", 4, 8, 4),  # none fit: least weights and scratch first
])
def test_serving_search_ranks_as_brute_force(name, gpu, n, batch, top):
    config, world = preset(name), cluster(gpu, n)
    workload = ServeWorkload(context_len=2048, prompt_len=1536, output_len=512, batch=batch)
    estimates = [evaluate_serving(config, world, layout, workload)
                 for layout in reference_serving_layouts(config, n)]
    fitting = [e for e in estimates if e.fits]
    if fitting:
        expected = sorted(fitting, key=lambda e: (-e.decode_tokens_per_s, e.tpot_s))
    else:
        expected = sorted(estimates, key=lambda e: e.weights + e.activations)
    result = search_serving(config, world, workload, top=top)
    assert (result.num_candidates, result.num_fitting) == (len(estimates), len(fitting))
    assert [e.layout for e in result.ranked] == [e.layout for e in expected[:top]]


@pytest.mark.parametrize("space,seq_len,batch,message", [
    (TrainSpace(), 0, 8, "at least 1"),
    (TrainSpace(), 4096, 0, "at least 1"),
    (TrainSpace(vpp=2, schedule="1f1b"), 4096, 8, "needs --schedule interleaved"),
    (TrainSpace(zero=1, dp=1), 4096, 8, "leaves one"),
    (TrainSpace(zero=2, tp=4, pp=2), 4096, 8, "leaves one"),
    (TrainSpace(pp=1, schedule="zb"), 4096, 8, "need pipeline parallelism"),
    (TrainSpace(pp=1, vpp=2), 4096, 8, "need pipeline parallelism"),
    (TrainSpace(pp=3), 4096, 8, r"tp\*pp\*cp = 3 does not divide the 8 GPUs"),
    (TrainSpace(pp=3, cp=2), 4096, 8, r"tp\*pp\*cp = 6 does not divide the 8 GPUs"),
    (TrainSpace(tp=2, dp=3), 4096, 6, r"tp\*pp\*dp\*cp = 6, but there are 8 GPUs"),
    # nothing matched: the first constraint broken, in the order the degrees are checked
    (TrainSpace(cp=4, dp=2), 4116, 3, r"cp 4 needs seq_len divisible by 2\*cp = 8"),
    (TrainSpace(cp=4, dp=2), 4096, 3, r"not divisible by dp\*micro_batch = 2\*1"),
    (TrainSpace(cp=1, dp=8), 4097, 4, r"not divisible by dp\*micro_batch = 8\*1"),
    (TrainSpace(pp=2, micro_batch=3), 4096, 8, r"not divisible by dp\*micro_batch = 4\*3"),
    (TrainSpace(tp=4, pp=2, schedule="interleaved", vpp=2), 4096, 3, "no valid layout of 8"),
    (TrainSpace(pp=2, schedule="interleaved", vpp=2, micro_batch=1), 4096, 6, "multiple of"),
])
def test_contradicting_choices_are_refused_with_the_reason(space, seq_len, batch, message):
    with pytest.raises(ConfigError, match=message):
        search_training(preset("llama3-8b"), cluster("h100-sxm", 8), TrainWorkload(
            seq_len=seq_len), batch, space)


@pytest.mark.parametrize("space,batch", [
    (TrainSpace(zero=1, dp=1, cp=2), 4),  # cp ranks shard too
    (TrainSpace(zero=1, dp=2, cp=2), 4),
    (TrainSpace(zero=3, tp=4), 2),  # tp*pp leaves 2 ranks to shard over
    (TrainSpace(vpp=1, schedule="1f1b"), 1),
    (TrainSpace(pp=1), 1),
])
def test_consistent_choices_at_the_limits_are_searched(space, batch):
    result = search_training(preset("llama3-8b"), cluster("h100-sxm", 8),
                             TrainWorkload(seq_len=4096), batch, space)
    assert result.num_candidates > 0
    for estimate in result.ranked:
        layout = estimate.layout
        assert layout.global_batch == batch
        assert all(getattr(layout, key) == value for key, value in
                   dataclasses.asdict(space).items() if value is not None and key != "offload")


def test_experts_spread_over_tensor_ranks_only_outside_tetrads_runtime():
    """ep 8 over tp 4 x dp 4: Megatron-Core runs it (expert tensor parallel 1); tetrad's runtime
    folds experts over dp*cp = 4 only, so its search refuses it."""
    config, world = preset("mixtral-8x7b"), cluster("h100-sxm", 16)
    space = TrainSpace(ep=8, tp=4, pp=1)
    result = search_training(config, world, TrainWorkload(seq_len=4096), 16, space, top=1)
    assert result.ranked[0].layout.ep == 8
    with pytest.raises(ConfigError, match="ep 8"):
        search_training(config, world, TrainWorkload(seq_len=4096, runtime="tetrad"), 16, space)


def test_a_gpu_without_the_training_dtype_is_refused():
    world = cluster("rtx-3090", 8)  # no fp8 tensor cores
    with pytest.raises(ConfigError, match="has no fp8 tensor cores: train in bf16, fp16"):
        search_training(preset("llama3-8b"), world, TrainWorkload(seq_len=4096, dtype="fp8"),
                        8)


@pytest.mark.parametrize("changes,n,space", [
    ({}, 8, ServeSpace(tp=2, pp=3)), ({}, 8, ServeSpace(pp=3)),
    ({}, 16, ServeSpace(tp=16, pp=3)),  # tp past the kv heads is fine for serving
    ({"num_heads": 1, "num_kv_heads": 1}, 3, ServeSpace(pp=2)),  # only tp 1 splits one head
    ({"num_layers": 1}, 6, ServeSpace(tp=4)),  # one layer: one stage
])
def test_serving_with_degrees_that_cannot_spread_is_refused(changes, n, space):
    with pytest.raises(ConfigError, match=f"does not divide the {n} GPUs"):
        search_serving(preset("llama3-8b").replace(**changes), cluster("h100-sxm", n),
                       ServeWorkload(context_len=2048, prompt_len=1024, output_len=1024), space)
