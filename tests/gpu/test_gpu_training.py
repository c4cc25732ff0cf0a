"""Training on GPUs (NCCL, one GPU per rank) against the CPU run. Collected everywhere, skipped
without CUDA; the 2-GPU layouts are skipped with fewer than 2 GPUs.

Tolerance. In fp32 with TF32 off (set here; spawned ranks keep torch's default, off for
matmuls: cuBLAS would otherwise round matmul inputs to 10 mantissa bits), a GPU and the CPU
compute the same function with different summation orders: cuBLAS tiles (and may split) each
dot product differently from the CPU's BLAS, and SDPA's fused CUDA kernels reduce the softmax
online. Each op then differs by a few fp32 ulps (~1e-7 relative), and the differences grow
through the layers and a few AdamW steps, whose update normalizes small gradient differences.
We allow 1e-4 on the losses: ten times the tolerance every CPU layout meets against one process
(1e-5), and far below what a wrong device path (a missed gradient reduction, a stale
parameter, a dropped microbatch) changes: each of these six steps moves the loss by 3% to 7%
(the same settings on the CPU: 5.5500, 5.3715, 5.0014, 4.7299, 4.4973, 4.3594). Gradient
norms get 1e-3: a norm sums squares of small numbers whose relative error is larger than the
loss's. (Written without a GPU: the margins GPUs really leave are for the first session with
one to read off.)
"""

from __future__ import annotations

import pytest
import torch

from tetrad.spec.model import TrainConfig
from tetrad.train.launch import train_model
from tetrad.viz.report import device_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

STEPS = 6
LOSS_RTOL, GRAD_NORM_RTOL = 1e-4, 1e-3


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def run(corpus_file, device: str, model: str = "tiny", nproc: int = 1, grad_accum: int = 1,
        **parallel):
    config = TrainConfig(model=model, data=corpus_file, steps=STEPS, batch_size=8, seq_len=64,
                         warmup_steps=2, sample_tokens=0, device=device, nproc=nproc,
                         grad_accum=grad_accum, parallel=parallel)
    return train_model(config).report


def assert_same_training(report, reference):
    for step, expected in zip(report["steps"], reference["steps"], strict=True):
        assert step["loss"] == pytest.approx(expected["loss"], rel=LOSS_RTOL), step["step"]
        assert step["grad_norm"] == pytest.approx(expected["grad_norm"], rel=GRAD_NORM_RTOL)
    assert report["validation_loss"] == pytest.approx(reference["validation_loss"],
                                                      rel=LOSS_RTOL)


def assert_cuda_memory(report):
    """Every rank measured its allocator's peaks, and they hold at least what was counted alive
    at once (parameters and optimizer state all run long; the saved activations at the end of
    forward, or the gradients at the end of backward)."""
    total = torch.cuda.get_device_properties(0).total_memory
    for entry in report["ranks"]:
        cuda, held = entry["cuda_memory"], entry["bytes"]
        alive_at_once = (held["params"] + held["optimizer"]
                         + max(held["activations_peak"], held["grads"]))
        assert alive_at_once <= cuda["allocated_peak"] <= cuda["reserved_peak"] < total, entry
        assert device_bytes(held) > 0


def test_one_gpu_trains_as_the_cpu_does(corpus_file):
    gpu, cpu = run(corpus_file, "cuda"), run(corpus_file, "cpu")
    assert gpu["device"]["type"] == "cuda" and cpu["device"]["type"] == "cpu"
    assert_same_training(gpu, cpu)
    assert_cuda_memory(gpu)
    assert cpu["ranks"][0]["cuda_memory"] is None


# Each layout's collectives on NCCL: all-reduce (DDP), reduce-scatter / all-gather (ZeRO-3),
# tensor parallelism's all-reduces with sequence parallelism's gathers, pipeline p2p, context
# parallelism's ring p2p, and expert parallelism's uneven all-to-all. name -> (model, layout,
# the reference's grad_accum: MoE load-balance losses are per microbatch, so the one-GPU run
# splits the batch as the layout does).
LAYOUTS = {
    "dp2": ("tiny", dict(dp=2), 1),
    "dp2-zero3": ("tiny", dict(dp=2, zero=3), 1),
    "tp2-sp": ("tiny", dict(tp=2, sequence_parallel=True), 1),
    "pp2-1f1b": ("tiny", dict(pp=2, microbatches=4, schedule="1f1b"), 1),
    "cp2": ("tiny", dict(cp=2), 1),
    "moe-dp2-ep2": ("tiny-moe", dict(dp=2, ep=2), 2),
}


@two_gpus
@pytest.mark.parametrize("name", LAYOUTS)
def test_two_gpus_train_as_one(corpus_file, name):
    model, parallel, grad_accum = LAYOUTS[name]
    reference = run(corpus_file, "cuda", model, grad_accum=grad_accum)
    report = run(corpus_file, "cuda", model, nproc=2, **parallel)
    assert_same_training(report, reference)
    assert_cuda_memory(report)
    assert len(report["ranks"]) == 2
