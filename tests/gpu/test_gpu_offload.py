"""`--offload optimizer|params|nvme` on one GPU (NCCL, pinned host buffers, copies between the
device and the host) against the CPU run of ZeRO-3 without offload: the CPU suite runs offload on
gloo only, where nothing is pinned and nothing crosses a bus, and there offload changes no bit of
the result (tests/test_offload_train.py). Skipped without CUDA. The tolerances and why:
tests/gpu/test_gpu_training.py."""

from __future__ import annotations

import pytest
import torch

from test_gpu_training import assert_same_training, no_tf32, run  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def references(corpus_file):
    """ZeRO-3 without offload: on the CPU (the losses) and on the GPU (its allocator's peak)."""
    return run(corpus_file, "cpu", zero=3), run(corpus_file, "cuda", zero=3)


@pytest.mark.parametrize("mode", ["optimizer", "params", "nvme"])
def test_one_gpu_with_offload_trains_as_the_cpu_does(corpus_file, tmp_path, references, mode):
    cpu, gpu_without = references
    layout = dict(zero=3, offload_mode=mode)
    if mode == "nvme":
        (tmp_path / "offload").mkdir()
        layout["offload_dir"] = str(tmp_path / "offload")
    gpu = run(corpus_file, "cuda", **layout)
    assert gpu["device"]["type"] == "cuda"
    assert_same_training(gpu, cpu)
    held = gpu["ranks"][0]["bytes"]
    assert held["optimizer"] == 0  # every mode moves the optimizer state off the device
    if mode != "optimizer":
        # The parameter and gradient shards too: the device holds a layer at a time.
        assert held["params"] == held["grads"] == 0
        # host_grads: the gradient shards and the staging buffer reduced shards land in, the
        # size of the device one (zero_buffers) in fp32.
        assert (held.get("host_params", 0) + held.get("disk_params", 0) + held["zero_buffers"]
                == held["host_grads"])
    peak = gpu["ranks"][0]["cuda_memory"]["allocated_peak"]
    without = gpu_without["ranks"][0]["cuda_memory"]["allocated_peak"]
    assert peak < without, (peak, without)
