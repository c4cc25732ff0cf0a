"""The search's shortcuts change no answer: the closed forms it takes instead of simulating equal
the simulation, the step-time bound it prunes by never exceeds the step, the candidates it builds
without re-validating equal the validated ones, and whole searches rank the same layouts as
evaluating every fitting layout through the simulator."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

import tetrad.planner.ranking as ranking
import tetrad.planner.search as search
import tetrad.planner.timeline as timeline
from tetrad.cli.main import main
from tetrad.hardware.profile import cluster
from tetrad.planner.search import TrainSpace, search_training
from tetrad.planner.timeline import (closed_form_in_flight, pipeline_bubble_ratio,
                                     pipeline_bubble_ratio_floor)
from tetrad.planner.training import TrainWorkload, evaluate_training, step_time_lower_bound
from tetrad.schedules import build_schedule, peak_in_flight
from tetrad.spec.presets import preset

# F, B - W, W in grid units, W <= F and W <= B - W as the planner's are (W the forward's matmuls)
UNITS = [(32, 64, 32), (32, 40, 20), (32, 70, 31), (32, 33, 32), (32, 90, 5), (32, 50, 1)]


def _clear_caches() -> None:
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("tetrad."):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()


@pytest.mark.parametrize("name", ["zbv", "dualpipe"])
def test_v_in_flight_closed_forms_are_what_the_action_lists_hold(name):
    for pp in (*range(2, 11), 16):
        for m in range(2 * pp if name == "dualpipe" else 1, 2 * pp + 3):
            order = build_schedule(name, pp, m, 2, communication=False)
            assert closed_form_in_flight(name, pp, m, 2) == tuple(
                p / 2 for p in peak_in_flight(order, release="W")), (name, pp, m)


@pytest.mark.parametrize("name", ["zbv", "dualpipe"])
def test_the_v_bubble_floor_is_below_the_simulated_bubble(name):
    for pp in (2, 3, 4, 8):
        for m in (2 * pp, 2 * pp + 3, 5 * pp) + ((1, pp) if name == "zbv" else ()):
            for f, b, w in UNITS:
                forward, backward, weight = f / 32, (b + w) / 32, w / 32
                floor = pipeline_bubble_ratio_floor(name, pp, m, 2, forward, backward, weight)
                exact = pipeline_bubble_ratio(name, pp, m, 2, forward, backward, weight)
                assert 0 < floor <= exact, (name, pp, m, f, b, w)


def _fitting(config, gpus, global_batch, workload, space=TrainSpace()):
    """Every fitting layout of a search, as search_training collects them."""
    collected = []
    real = ranking.fastest_shapes

    def spy(config, cluster, workload, fitting, top):
        collected.extend(fitting)
        return real(config, cluster, workload, fitting, top)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(search, "fastest_shapes", spy)
        search_training(config, gpus, workload, global_batch, space)
    return collected


@pytest.mark.parametrize("model,gpu,count,batch", [("llama3-70b", "h100-sxm", 256, 256),
                                                   ("mixtral-8x7b", "h100-sxm", 16, 64)])
def test_the_step_time_bound_never_exceeds_the_step(model, gpu, count, batch):
    config, gpus, workload = preset(model), cluster(gpu, count), TrainWorkload(seq_len=4096)
    fitting = _fitting(config, gpus, batch, workload)
    schedules = {layout.schedule for layout in fitting}
    assert len(fitting) > 20 and {"zbv", "zb", "1f1b"} <= schedules
    for layout in fitting:
        step = evaluate_training(config, gpus, layout, workload, count_bytes=False).step.total
        assert 0 < step_time_lower_bound(config, gpus, layout, workload) <= step, layout


def test_candidates_built_without_validation_equal_validated_ones(monkeypatch):
    built = []

    def checked(layout, **choices):
        variant = real(layout, **choices)
        built.append(variant)
        assert variant == dataclasses.replace(layout, **choices)
        assert vars(variant) == vars(dataclasses.replace(layout, **choices))
        return variant

    real = search._variant
    monkeypatch.setattr(search, "_variant", checked)
    search_training(preset("llama3-70b"), cluster("a100-40gb", 16), TrainWorkload(seq_len=4096),
                    64)
    assert len(built) > 100 and {v.offload_mode for v in built} >= {"none", "optimizer"}


def _plan(capsys, args):
    _clear_caches()
    capsys.readouterr()
    main(["plan", "train", "--json", "--top", "8", *args])
    return json.loads(capsys.readouterr().out)


def _slow_path(monkeypatch, simulate: bool) -> None:
    """Every fitting layout evaluated (no bound) and every candidate validated; with `simulate`,
    every bubble and in-flight peak from the schedules' action lists too."""
    monkeypatch.setattr(ranking, "step_time_lower_bound", lambda *args: 0.0)
    monkeypatch.setattr(search, "_variant", dataclasses.replace)
    if simulate:
        monkeypatch.setattr(timeline, "has_closed_form", lambda *args: False)
        monkeypatch.setattr(timeline, "v_in_flight_closed_form", lambda *args: False)


@pytest.mark.parametrize("args,simulate", [
    (["--model", "llama3-405b", "--gpu", "h100", "--num-gpus", "16384"], False),
    (["--model", "llama3-70b", "--gpu", "a100-40gb", "--num-gpus", "64"], False),
    (["--model", "llama3-70b", "--gpu", "a100-40gb", "--num-gpus", "16", "--global-batch", "64"],
     True),
    (["--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "16", "--global-batch", "64"], True),
    (["--model", "mixtral-8x7b", "--gpu", "h100", "--num-gpus", "8", "--global-batch", "32"],
     True),
    (["--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "16", "--rank-by", "cost"], False),
])
def test_the_search_ranks_as_evaluating_every_layout(capsys, monkeypatch, args, simulate):
    evaluated = []
    real_evaluate = ranking.evaluate_training
    monkeypatch.setattr(ranking, "evaluate_training",
                        lambda *a, **k: evaluated.append(1) or real_evaluate(*a, **k))
    fast = _plan(capsys, args)
    pruned = len(evaluated)
    _slow_path(monkeypatch, simulate)
    evaluated.clear()
    assert _plan(capsys, args) == fast
    assert len(evaluated) > pruned  # the bound pruned some
