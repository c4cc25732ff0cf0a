"""Fused attention's share of the GPU's bf16 peak, forward and backward apart, against the length
of one kernel call: what the planner's long-context and context-parallel times rest on
(tetrad/planner/compute.py, ATTENTION_LENGTH_CURVE).

    python benchmarks/gpu_attention_efficiency.py --out runs/gpu     # one H100/H200, about a minute

PyTorch SDPA on [batch, 32 heads, length, 128] bf16, two backends: `flash` (FlashAttention-2, the
planner's "portable" kernels) and `cudnn` (cuDNN's fused attention, the vendor kernel Transformer
Engine calls). Two masks: causal (a whole sequence, or a context-parallel rank's diagonal step)
and full (a ring step's block of queries against another rank's keys). The batch keeps about
64K tokens per call so short lengths fill the GPU as a training microbatch does. FLOPs: forward
2 matmuls x 2 x heads x 128 x queries x keys (half for causal), backward 2.5 times that
(FlashAttention-2 paper, section 3.1.2). Each time is the median of 5 calls by CUDA events after
2 warm-ups; the backward is (forward + backward) less the forward. Efficiency = FLOPs / time /
the catalog's dense bf16 peak of this GPU (989 TFLOP/s for the H100 and H200).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from timing import cuda_median_seconds

from tetrad.hardware.catalog import gpu_from_device_name

HEADS, HEAD_DIM, TOKENS = 32, 128, 65536
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def seconds(call) -> float:
    return cuda_median_seconds(call, warmup=2, repeats=5)


def case(backend: str, causal: bool, length: int, peak: float) -> dict:
    batch = max(1, TOKENS // length)
    shape = (batch, HEADS, length, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(BACKENDS[backend]):
        forward = seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))

        def both():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.grad(out, (q, k, v), grad)
        total = seconds(both)
    flops = 4 * batch * HEADS * HEAD_DIM * length * length * (0.5 if causal else 1.0)
    backward = total - forward
    return {"backend": backend, "causal": causal, "length": length, "batch": batch,
            "forward_s": forward, "backward_s": backward,
            "forward_efficiency": flops / forward / peak,
            "backward_efficiency": 2.5 * flops / backward / peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/gpu")
    args = parser.parse_args()
    name = torch.cuda.get_device_name()
    peak = gpu_from_device_name(name).peak("bf16")
    print(f"{name}, torch {torch.__version__}, bf16 peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for backend in BACKENDS:
        for causal in (True, False):
            for length in LENGTHS:
                try:
                    row = case(backend, causal, length, peak)
                except RuntimeError as error:  # a backend refusing a shape
                    print(f"{backend} causal={causal} {length}: {str(error).splitlines()[0]}")
                    continue
                rows.append(row)
                print(f"{backend:5} {'causal' if causal else 'full  '} {length:6} "
                      f"fwd {row['forward_efficiency']:.3f} bwd {row['backward_efficiency']:.3f}",
                      flush=True)
                (out / "gpu_attention_efficiency.json").write_text(json.dumps(
                    {"device": name, "torch": torch.__version__, "rows": rows}, indent=1))
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
