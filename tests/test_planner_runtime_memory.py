"""What a training process holds beside its tensors (tetrad.planner.runtime_memory): the
communicators each layout opens, their NCCL buffers, the allocator's share, and that the search,
evaluate_training and the JSON report all fit a layout by the same sum."""

from __future__ import annotations

import json

import pytest

from tetrad.cli.main import main
from tetrad.hardware.catalog import GiB
from tetrad.planner import runtime_memory
from tetrad.planner.layout import TrainLayout
from tetrad.planner.runtime_memory import (communicator_sizes, nccl_buffer_bytes,
                                           runtime_reserve, usable_tensor_memory)

PAIR, GROUP = 544 * 2**20, 688 * 2**20


@pytest.mark.parametrize("degrees, sizes", [
    (dict(), ()),
    (dict(tp=2, pp=2, dp=2), (2, 2, 2)),
    (dict(tp=8, pp=8, dp=8), (8, 8, 8)),
    (dict(tp=4, cp=2, dp=2), (4, 2, 4)),  # tp, cp, and the gradients' dp x cp group
    (dict(tp=2, dp=8, ep=4), (2, 8, 4, 2)),  # experts: ep 4, each expert's data group 8/4
])
def test_each_parallel_group_opens_a_communicator(degrees, sizes):
    layout = TrainLayout(**degrees)
    assert communicator_sizes(layout) == sizes
    assert nccl_buffer_bytes(layout) == sum(PAIR if size == 2 else GROUP for size in sizes)


def test_allocator_share_is_the_median_measured_reserve():
    ratios = sorted(reserved / allocated
                    for allocated, reserved in runtime_memory.MEASURED_ALLOCATOR_PEAKS)
    assert runtime_memory.ALLOCATOR_RESERVE_SHARE == pytest.approx(
        (ratios[2] + ratios[3]) / 2 - 1)
    assert ratios[0] - 1 <= runtime_memory.ALLOCATOR_RESERVE_SHARE <= ratios[-1] - 1


def test_usable_memory_holds_tensors_and_reserve_exactly():
    layout = TrainLayout(tp=8, pp=4, dp=2)
    gpu = 80 * GiB
    usable = usable_tensor_memory(gpu, layout)
    reserve = runtime_reserve(layout)
    assert sum(reserve.lines(usable).values()) + usable == pytest.approx(gpu)
    assert reserve.nccl_buffers == 2 * GROUP + PAIR  # tp 8, pp 4, dp 2


def test_report_lines_add_up_to_what_fits(capsys):
    args = ["plan", "train", "--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "16",
            "--tp", "2", "--pp", "2", "--top", "3", "--json"]
    assert main(args) == 0
    configs = json.loads(capsys.readouterr().out)["configs"]
    for config in configs:
        memory = config["memory_gib"]
        held = memory["total"] + memory["cuda_context"] + memory["nccl_buffers"] \
            + memory["allocator_reserve"]
        assert config["fits"] and held <= 80 + 1e-2  # the catalog H100's 80 GiB
        assert memory["allocator_reserve"] == pytest.approx(
            memory["total"] * runtime_memory.ALLOCATOR_RESERVE_SHARE, abs=2e-3)
