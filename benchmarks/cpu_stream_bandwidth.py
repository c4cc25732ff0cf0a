"""How fast the fused decode step's weight-streaming matmul (torch.ops.tetrad.linear_rows) reads
its weights at one row (or --rows rows: a decode batch), per weight shape of cpu_vs_llamacpp.py's
32m Llama (512 x 8 layers, 8k vocabulary): qkv / out 512x512 (the qkv's 1536 rows too), gate_up
2816x512, down 512x1408, head 8192x512; fp32, bf16, int8 and int4 (group 128) weights, bf16
activations for the quantized ones as the engine runs them. Against it, on the same bytes: a
plain read (torch.sum over the weight's bytes seen as fp32) and torch's own product on the same
rows (F.linear; _weight_int8pack_mm; _weight_int4pack_mm_for_cpu).

A decode step reads ~120 MB of fp32 weights, more than the last-level cache, so each shape is
timed over enough copies of its weight (>= 96 MB) that every call reads memory, not cache. GB/s
is weight bytes read per wall-clock second, the median of 7 repeats. Beside it, "busy" is the
process's CPU seconds over the wall seconds (median of the repeats): how many threads really
worked, 1.0 for one, up to the thread count when all did (spinning threads count as working).
CPU seconds divided by the thread count are no rate: a kernel that ran on one of two threads
(the kernels built without OpenMP did, before 7554db6) looked twice as fast per thread. On a
shared machine compare runs taken back to back; the last columns, linear_rows over the plain
read and over torch's product, move least with the load.

    .venv/bin/python benchmarks/cpu_stream_bandwidth.py [--threads 1 2]
        [--dtypes fp32 bf16 int8 int4] [--rows 1 16 32 64] [--library OLD.so]
"""

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from tetrad.inference.worker.cpu_kernels import load_cpu_kernels
from tetrad.models.quant import Int4Linear, Int8Linear

SHAPES = {"qkv": (1536, 512), "out": (512, 512), "gate_up": (2816, 512), "down": (512, 1408),
          "head": (8192, 512)}
COLD_BYTES = 96 * 2**20
REPEATS = 7


def weight(dtype: str, n: int, k: int):
    """A weight [n, k] as linear_rows takes it: (weight, scales or None)."""
    w = torch.randn(n, k) / k**0.5
    if dtype == "fp32":
        return w, None
    if dtype == "bf16":
        return w.bfloat16(), None
    if dtype == "int8":
        layer = Int8Linear.quantize(w.bfloat16())
        return layer.values, layer.scales
    layer = Int4Linear.quantize(w.bfloat16())
    assert layer.kernel == "cpu", "int4 not on torch's CPU kernel"
    return layer.values, layer.scales_and_offsets


def torch_product(dtype: str, x: torch.Tensor, w: torch.Tensor, scales, k: int):
    if dtype == "int8":
        return torch._weight_int8pack_mm(x, w, scales)
    if dtype == "int4":
        return torch._weight_int4pack_mm_for_cpu(x, w, k // scales.size(0), scales)
    return F.linear(x, w)


def rate(step, nbytes: int) -> tuple[float, float]:
    """(GB/s per wall second, CPU seconds per wall second), medians of REPEATS."""
    step()  # warm: page faults, the kernel's first-call setup
    rates, busy = [], []
    for _ in range(REPEATS):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        rates.append(nbytes / wall / 1e9)
        busy.append(cpu / wall)
    return statistics.median(rates), statistics.median(busy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "int8", "int4"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1],
                        help="rows of activations (sequences of a decode step)")
    parser.add_argument("--library", help="a kernel library built from other sources (before / "
                        "after a change), loaded instead of this checkout's")
    args = parser.parse_args()
    if args.library:
        torch.ops.load_library(args.library)
    else:
        load_cpu_kernels()
    torch.manual_seed(0)
    print(f"load average {os.getloadavg()[0]:.2f}; GB/s of weights read (wall clock), "
          "threads busy", flush=True)
    for dtype in args.dtypes:
        for shape in args.shapes:
            n, k = SHAPES[shape]
            w, s = weight(dtype, n, k)
            per_copy = sum(t.numel() * t.element_size() for t in (w, s) if t is not None)
            copies = max(1, -(-COLD_BYTES // per_copy))
            # Copies of one quantized weight: quantizing each would take minutes; the bytes
            # read are the same.
            ws = [(w.clone(), None if s is None else s.clone()) for _ in range(copies)]
            nbytes = per_copy * copies
            flat = [t.view(-1).view(torch.uint8)[: t.numel() * t.element_size() // 4 * 4]
                    .view(torch.float32) for t, _ in ws]
            for rows, threads in ((r, t) for r in args.rows for t in args.threads):
                x = torch.randn(rows, k).to(torch.float32 if dtype == "fp32" else torch.bfloat16)
                torch.set_num_threads(threads)
                ours = rate(lambda: [torch.ops.tetrad.linear_rows(x, w, scales=s) for w, s in ws],
                            nbytes)
                read = rate(lambda: [f.sum() for f in flat], nbytes)
                theirs = rate(lambda: [torch_product(dtype, x, w, s, k) for w, s in ws],
                              nbytes)
                print(f"{dtype:5s} {shape:8s} {n:5d}x{k:<5d} {rows:2d} rows {threads}t  "
                      f"linear_rows {ours[0]:5.1f} GB/s busy {ours[1]:.2f}   read {read[0]:5.1f} "
                      f"busy {read[1]:.2f}   torch {theirs[0]:5.1f} busy {theirs[1]:.2f}   "
                      f"linear_rows / read {ours[0] / read[0]:.2f}, / torch "
                      f"{ours[0] / theirs[0]:.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
