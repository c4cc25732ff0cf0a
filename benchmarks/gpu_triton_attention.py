"""The Triton paged-attention decode on one GPU: how much of the HBM bandwidth it turns into K/V
reads, against SDPA's flash kernel on contiguous K/V (the ceiling: the same bytes, no block table).

    python benchmarks/gpu_triton_attention.py --out runs/gpu     # one H100/H200, about a minute

One decode step of one layer of a 1.1B Llama (32 query heads, 4 KV heads, head dim 64, bf16) at
batch 1 to 256 and contexts 512 and 2048, K/V in 16-token blocks in shuffled order. Rows:
  triton-split   triton_paged_decode with decode_splits' split count (what serving runs)
  triton-unified triton_paged_attention, the one kernel of mixed steps, on the same decode
  sdpa-flash     F.scaled_dot_product_attention on contiguous [batch, kv_heads, context, 64] K/V,
                 flash backend (the ceiling)
Each row is a CUDA graph of 20 launches replayed (so host launch cost is left out, as the engine's
decode graphs leave it out), timed by CUDA events, median of 10 replays. K/V bytes read =
batch x context x kv_heads x head_dim x 2 (K and V) x 2 bytes; bandwidth fraction = those bytes
per second / the catalog's HBM bandwidth of this GPU. Each Triton row is checked against the
flash row's output first. Rows are printed and rewritten to --out/gpu_triton_attention.json as
they come, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tetrad.hardware.catalog import gpu_from_device_name
from tetrad.inference.worker.triton_attention import (decode_splits, split_scratch,
                                                      triton_paged_attention, triton_paged_decode)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 64, 16
LAUNCHES_PER_GRAPH = 20


def graph_seconds(step, repeats: int = 10) -> float:
    """Seconds per call of `step`, replayed from a CUDA graph of LAUNCHES_PER_GRAPH calls."""
    step()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES_PER_GRAPH):
            step()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / LAUNCHES_PER_GRAPH)
    return statistics.median(times)


def decode_case(batch: int, context: int, device: torch.device, multiprocessors: int,
                dtype: torch.dtype = torch.bfloat16) -> dict:
    blocks_per_seq = context // BLOCK_SIZE
    k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=dtype)
    # The same K/V in a pool of shuffled 16-token blocks: sequence b's block j is tables[b, j].
    tables = torch.randperm(batch * blocks_per_seq, device=device, dtype=torch.int32)
    tables = tables.view(batch, blocks_per_seq)
    k_cache = torch.empty(batch * blocks_per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device,
                          dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    for cache, source in ((k_cache, k), (v_cache, v)):
        cache[tables.flatten().long()] = source.permute(0, 2, 1, 3).reshape(
            batch * blocks_per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    cu_seq_q = torch.arange(batch + 1, device=device, dtype=torch.int32)
    splits = decode_splits(batch, KV_HEADS, HEAD_DIM, context, multiprocessors)
    scratch = split_scratch(batch, HEADS, splits, HEAD_DIM, device)
    outputs = {name: torch.empty(batch, HEADS, HEAD_DIM, device=device, dtype=dtype)
               for name in ("triton-split", "triton-unified", "sdpa-flash")}

    def flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            outputs["sdpa-flash"].copy_(F.scaled_dot_product_attention(
                q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2))

    steps = {
        "triton-split": lambda: triton_paged_decode(q, k_cache, v_cache, tables, lens, splits,
                                                    scratch, outputs["triton-split"]),
        "triton-unified": lambda: triton_paged_attention(q, k_cache, v_cache, tables, cu_seq_q,
                                                         lens, outputs["triton-unified"]),
        "sdpa-flash": flash,
    }
    kv_bytes = 2 * k.numel() * k.element_size()
    result = {"batch": batch, "context": context, "num_splits": splits, "kv_bytes": kv_bytes}
    flash()
    for name, step in steps.items():
        step()
        error = (outputs[name].float() - outputs["sdpa-flash"].float()).abs().max().item()
        seconds = graph_seconds(step)
        result[name] = {"seconds": seconds, "bytes_per_s": kv_bytes / seconds,
                        "max_abs_error_vs_flash": error}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu"))
    parser.add_argument("--batches", type=int, nargs="+", default=(1, 4, 16, 64, 256))
    parser.add_argument("--contexts", type=int, nargs="+", default=(512, 2048))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    properties = torch.cuda.get_device_properties(device)
    catalog = gpu_from_device_name(properties.name)
    bandwidth = catalog.memory_bandwidth if catalog else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"gpu": properties.name, "hbm_bytes_per_s": bandwidth, "torch": torch.__version__,
              "rows": []}
    print(f"{properties.name}: HBM "
          f"{f'{bandwidth / 1e12:.2f} TB/s (catalog)' if bandwidth else 'not in the catalog'}")
    print(f"{'batch':>5} {'context':>7} {'splits':>6}  " + "  ".join(
        f"{name:>22}" for name in ("triton-split", "triton-unified", "sdpa-flash"))
        + "  max |triton - flash|")
    for context in args.contexts:
        for batch in args.batches:
            row = decode_case(batch, context, device, properties.multi_processor_count)
            report["rows"].append(row)
            (out / "gpu_triton_attention.json").write_text(json.dumps(report, indent=1))
            cells = []
            for name in ("triton-split", "triton-unified", "sdpa-flash"):
                fraction = row[name]["bytes_per_s"] / bandwidth if bandwidth else float("nan")
                cells.append(f"{row[name]['seconds'] * 1e6:8.1f} us {fraction:6.1%} HBM")
            error = max(row[name]["max_abs_error_vs_flash"]
                        for name in ("triton-split", "triton-unified"))
            print(f"{batch:>5} {context:>7} {row['num_splits']:>6}  " + "  ".join(
                f"{cell:>22}" for cell in cells) + f"  {error:.1e}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
