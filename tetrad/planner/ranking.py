"""Which of the search's fitting layouts it shows: the fastest of each distinct shape, found
without evaluating every layout (a step-time lower bound rules most out unevaluated)."""

from __future__ import annotations

import heapq

from tetrad.hardware.catalog import Cluster
from tetrad.planner.estimate import TrainingEstimate
from tetrad.planner.layout import TrainLayout
from tetrad.planner.training import TrainWorkload, evaluate_training, step_time_lower_bound
from tetrad.spec.model import ModelConfig


def fastest_shapes(config: ModelConfig, cluster: Cluster, workload: TrainWorkload,
                   fitting: list[TrainLayout], top: int) -> list[TrainLayout]:
    """distinct_shapes of every fitting layout evaluated and ranked, without evaluating them
    all: in order of their step-time lower bound, until the throughput that bound allows falls
    below that of the `top`-th distinct shape found so far. Such a layout ranks below `top`
    shapes faster than it, so it can neither enter the answer nor stand for a shape in it; the
    answer is the same layouts as evaluating every one (tests/test_planner_search_speed.py)."""
    if workload.runtime == "tetrad":  # its step time is its runtime's own, which no bound limits
        bounds = [0.0] * len(fitting)
    else:
        bounds = [step_time_lower_bound(config, cluster, layout, workload) for layout in fitting]
    evaluated: list[tuple[int, TrainingEstimate]] = []
    fastest: dict[tuple, float] = {}  # shape -> its best tokens per second so far
    threshold = 0.0  # the top-th shape's, once there are top shapes
    for index in sorted(range(len(fitting)), key=bounds.__getitem__):
        layout = fitting[index]
        if bounds[index] and layout.global_batch * workload.seq_len / bounds[index] < threshold:
            break
        estimate = evaluate_training(config, cluster, layout, workload, count_bytes=False)
        evaluated.append((index, estimate))
        shape = _shape(layout)
        fastest[shape] = max(fastest.get(shape, 0.0), estimate.tokens_per_s)
        if len(fastest) >= top:
            threshold = heapq.nlargest(top, fastest.values())[-1]
    evaluated.sort(key=lambda pair: pair[0])  # fitting's order, so ties fall as they would
    estimates = sorted((estimate for _, estimate in evaluated),
                       key=lambda e: (-e.tokens_per_s, e.memory.total))
    return distinct_shapes([e.layout for e in estimates], top)


def _shape(layout: TrainLayout) -> tuple:
    return (layout.tp, layout.pp, layout.dp, layout.cp, layout.ep, layout.schedule, layout.vpp,
            layout.micro_batch)


def distinct_shapes(layouts: list[TrainLayout], top: int) -> list[TrainLayout]:
    """The best `top` layouts that differ in more than ZeRO stage and recomputation (variants of
    one shape that only trade memory for a little speed say little to a reader)."""
    seen, chosen = set(), []
    for layout in layouts:
        shape = _shape(layout)
        if shape not in seen:
            seen.add(shape)
            chosen.append(layout)
        if len(chosen) == top:
            break
    return chosen
