"""The planner prices parameter offload copy by copy (tetrad.planner.offload_time): the copies it
counts are the ones ZeRO-3 with --offload params makes in a step (into its staging buffers),
counted by the copy operators torch dispatches, and each costs the calibrated fixed cost plus its bytes at the calibrated rate."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from tests.dist import run_ranks
from tetrad.hardware.catalog import gpu
from tetrad.planner.layout import TrainLayout
from tetrad.planner.offload_time import host_link_time, offload_copies, offload_time
from tetrad.planner.training import TrainWorkload
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.spec.presets import resolve_model

MODEL = {"num_layers": 3, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 4,
         "ffn_hidden_size": 176}
SEQ, BATCH, ACCUM = 8, 4, 2


def _config(mode: str) -> TrainConfig:
    return TrainConfig(model="tiny", model_overrides=MODEL, seq_len=SEQ, batch_size=BATCH,
                       grad_accum=ACCUM, parallel=ParallelConfig(zero=3, offload_mode=mode))


def _copies_of_a_step(rank: int, world_size: int) -> dict[str, Counter]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from tetrad.models.transformer import Transformer
    from tetrad.parallel.comm import Comm, CommCounter
    from tetrad.parallel.mesh import build_mesh
    from tetrad.train.strategy import build_strategy

    torch.set_num_threads(1)

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                self.sizes[args[0].numel() * args[0].element_size()] += 1
            return func(*args, **(kwargs or {}))

    counted = {}
    batch = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    for mode in ("none", "params"):
        config = _config(mode)
        torch.manual_seed(0)
        model = Transformer(resolve_model("tiny", MODEL))
        run = build_strategy(model, config, torch.device("cpu"),
                             build_mesh(config.parallel, rank, world_size), Comm(CommCounter()))
        with Copies() as copies:
            run.forward_backward(batch)
            run.finish_gradients()
            run.clip_grad_norm(1.0)
            run.step(1e-4)
        counted[mode] = copies.sizes
    return counted


def _layout_and_precision(mode: str):
    config = _config(mode)
    layout = TrainLayout.of(config.parallel, BATCH // ACCUM, ACCUM)
    return layout, TrainWorkload(seq_len=SEQ, dtype="fp32").precision


def test_the_planner_counts_the_copies_a_step_makes():
    counted = run_ranks(_copies_of_a_step, 1)[0]
    made = counted["params"] - counted["none"]
    assert not counted["none"] - counted["params"]  # offload only adds copies
    layout, precision = _layout_and_precision("params")
    planned = Counter()
    for count, nbytes in offload_copies(resolve_model("tiny", MODEL), layout, precision, 0):
        planned[int(nbytes)] += count
    assert made == planned and sum(planned.values()) > 0


def test_each_copy_costs_the_calibrated_fixed_cost_and_its_bytes_at_the_rate():
    config = resolve_model("tiny", MODEL)
    layout, precision = _layout_and_precision("params")
    base = gpu("rtx-4090")
    calibrated = dataclasses.replace(base, efficiency=dataclasses.replace(
        base.efficiency, host_copy_s=1e-3, host_copy_bandwidth=2e9))
    copies = offload_copies(config, layout, precision, 0)
    assert host_link_time(calibrated, 4e6) == pytest.approx(1e-3 + 2e-3)
    assert offload_time(config, layout, precision, calibrated, 0) == pytest.approx(
        sum(count * (1e-3 + nbytes / 2e9) for count, nbytes in copies))
    # Without a calibration, PCIe alone: no fixed cost.
    assert offload_time(config, layout, precision, base, 0) == pytest.approx(
        sum(count * nbytes for count, nbytes in copies) / base.pcie_bandwidth)
    none, _ = _layout_and_precision("none")
    assert offload_copies(config, none, precision, 0) == []


def test_the_copies_enter_the_step_as_calibrated_not_scaled_by_step_scale():
    """step_scale is fitted on a calibration step that makes no offload copies, and calibrate times
    the copies as a step makes them: a profile's step_scale stretches the rank's optimizer work
    but leaves the copies' time as it is."""
    from tetrad.hardware.catalog import Cluster
    from tetrad.planner.eager_time import rank_time

    config = resolve_model("tiny", MODEL)
    layout, precision = _layout_and_precision("params")
    base = gpu("rtx-4090")

    def optimizer(step_scale: float) -> float:
        profile = dataclasses.replace(base, efficiency=dataclasses.replace(
            base.efficiency, host_copy_s=1e-3, host_copy_bandwidth=2e9, step_scale=step_scale))
        return rank_time(config, Cluster(profile, 1, 1), layout, SEQ, precision, True,
                         0).optimizer, offload_time(config, layout, precision, profile, 0)

    (once, copies), (twice, _) = optimizer(1.0), optimizer(2.0)
    assert copies > 0
    assert twice - once == pytest.approx(once - copies)  # only the work outside the copies doubles
