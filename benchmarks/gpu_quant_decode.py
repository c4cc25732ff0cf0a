"""Quantized weights on a GPU: the engine's decode step with `--quantization none|int8|int4` on
gpu_serving.py's 1.1B Llama (bf16 activations, random weights), at a few batch sizes past
512-token contexts, each against its bandwidth floor ((the weights as that method holds them,
the planner's bytes, + the KV it reads) / the catalog's HBM bandwidth of this GPU). At batch 1 a
decode step reads every weight once, so a kernel that reads int8 or int4 where bf16 reads 16 bits
should approach 2x or 4x fewer bytes' time; past that the matrix units take over.

    python3 benchmarks/gpu_quant_decode.py --out $OUT      # writes $OUT/gpu_quant_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_serving import SHAPES, Tokens, build_models, time_decode_steps  # noqa: E402

from tetrad.hardware.catalog import gpu, gpu_from_device_name  # noqa: E402
from tetrad.inference.engine import LLM  # noqa: E402
from tetrad.models import quant  # noqa: E402
from tetrad.planner.memory import kv_bytes_per_token  # noqa: E402
from tetrad.planner.serving import ServeLayout, weight_bytes_per_gpu  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="1b")
    parser.add_argument("--methods", nargs="+", default=["none", "int8", "int8-widened", "int4"],
                        choices=("none", "int8", "int8-widened", "int4"))
    parser.add_argument("--batches", type=int, nargs="+", default=(1, 16, 64))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--count", type=int, default=20, help="decode steps timed per row")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cuda = args.device == "cuda"
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    known = gpu_from_device_name(device_name) if cuda else None
    bandwidth = gpu(known.name if known else "h100").memory_bandwidth
    dtype = torch.bfloat16
    config, model, hf = build_models(SimpleNamespace(shape=args.shape), torch.device(args.device),
                                     dtype)
    del hf
    per_token = kv_bytes_per_token(config, 2)
    report = {"device": device_name, "model": config.name, "context": args.context, "rows": []}
    out = Path(args.out) / "gpu_quant_decode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    kernel_rows = quant.MAX_KERNEL_ROWS
    print(f"{device_name}: {config.name}, bf16 activations, context {args.context}, "
          f"floor at {bandwidth / 1e12:.2f} TB/s")
    for method in args.methods:
        # int8-widened: int8 weights widened to bf16 for cuBLAS at every row count, the product
        # the layer takes past MAX_KERNEL_ROWS (int8_triton.py), timed where the kernel runs.
        quant.MAX_KERNEL_ROWS = -1 if method == "int8-widened" else kernel_rows
        held = {"none": "bf16", "int8-widened": "int8"}.get(method, method)
        weights = weight_bytes_per_gpu(config, ServeLayout(), held, 0)
        for batch in args.batches:
            llm = LLM(model, Tokens(config.vocab_size), device=args.device, block_size=16,
                      quantization=held if held != "bf16" else "none",
                      max_num_seqs=max(batch, 1), kv_memory="8GiB", log=None)
            times = time_decode_steps(llm, batch, args.context, args.count).per_step_ms()
            llm.close()
            del llm
            floor = (weights + batch * (args.context + args.count) * per_token) / bandwidth
            row = {"quantization": method, "batch": batch, "weight_bytes": weights,
                   "step_ms": times["step_ms"], "floor_ms": floor * 1e3}
            print(f"  {method:12s} batch {batch:3d}: {row['step_ms']:7.2f} ms, floor "
                  f"{row['floor_ms']:6.2f} ms ({row['step_ms'] / row['floor_ms']:.1f}x), weights "
                  f"{weights / 2**20:.0f} MiB")
            report["rows"].append(row)
            out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
