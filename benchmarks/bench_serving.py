"""Serving benchmarks for the paged-KV engine, on CPU with a small model (or a GPU when present).

  1. throughput: the same requests with continuous batching vs static batching (groups of
     max_num_seqs that run to the end of their longest member before the next group starts);
  2. KV-cache utilization: tokens stored / slots reserved in held blocks, sampled every step
     (vLLM reports < 4% waste for paged attention);
  3. latency under load: TTFT and TPOT percentiles with Poisson arrivals;
  4. --attention: the paged attention kernels (SDPA on gathered K/V vs the tiled kernel), the
     measurement behind the runner's "auto" choice.

    .venv/bin/python benchmarks/bench_serving.py                # small random model, CPU
    .venv/bin/python benchmarks/bench_serving.py --model PATH --device cuda --requests 256
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from tetrad.inference.worker.attention import sdpa_paged_attention, tiled_paged_attention
from tetrad.inference.engine import LLM
from tetrad.inference.core.metrics import percentile
from tetrad.inference.core.params import SamplingParams
from tetrad.models.transformer import Transformer
from tetrad.spec.presets import resolve_model
from tetrad.tokenizer import ByteTokenizer


def make_engine(args, **overrides) -> LLM:
    config = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                  dtype=args.dtype, log=None, **overrides)
    if args.model_path:
        return LLM(args.model_path, **config)
    torch.manual_seed(0)
    return LLM(Transformer(resolve_model(args.model)), ByteTokenizer(), **config)


def make_requests(args, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_len))]
        params = SamplingParams(temperature=0, ignore_eos=True,
                                max_tokens=rng.randint(*args.output_len))
        requests.append((prompt, params))
    return requests


def run_offline(llm: LLM, requests, group: int | None) -> dict:
    """All requests at once (group None: continuous batching) or `group` at a time (static)."""
    utilization = []
    start = time.perf_counter()
    chunks = [requests] if group is None else [requests[i:i + group]
                                               for i in range(0, len(requests), group)]
    generated = steps = 0
    for chunk in chunks:
        for prompt, params in chunk:
            llm.add_request(prompt, params)
        while llm.has_unfinished():
            steps += 1
            for output in llm.step():
                generated += len(output.outputs[0].delta_token_ids)
            if llm.scheduler.running:
                utilization.append(llm.kv_utilization())
    elapsed = time.perf_counter() - start
    return {"time_s": elapsed, "steps": steps, "tokens": generated,
            "tokens_per_s": generated / elapsed,
            "kv_utilization_mean": statistics.fmean(utilization) if utilization else 1.0,
            "preemptions": llm.scheduler.num_preemptions}


def run_poisson(llm: LLM, requests, rate: float, seed: int) -> dict:
    """Requests arrive as a Poisson process of `rate` per second, in real time."""
    rng = random.Random(seed)
    arrivals, moment = [], 0.0
    for request in requests:
        moment += rng.expovariate(rate)
        arrivals.append((moment, request))
    start, finished = time.perf_counter(), []
    while arrivals or llm.has_unfinished():
        now = time.perf_counter() - start
        while arrivals and arrivals[0][0] <= now:
            prompt, params = arrivals.pop(0)[1]
            llm.add_request(prompt, params)
        if not llm.has_unfinished():
            time.sleep(max(0.0, arrivals[0][0] - now))
            continue
        finished += [output for output in llm.step() if output.finished]
    ttft = [o.first_token_time - o.arrival_time for o in finished]
    tpot = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1)
            for o in finished if len(o.token_ids) > 1]
    return {"rate_per_s": rate, "requests": len(finished),
            **{f"ttft_p{q}_s": percentile(ttft, q) for q in (50, 90, 99)},
            **{f"tpot_p{q}_s": percentile(tpot, q) for q in (50, 90, 99)}}


def bench_attention(device: str) -> list[dict]:
    """ms per call of each paged kernel: decode batches and prefill chunks over a context."""
    torch.manual_seed(0)
    block_size, kv_heads, heads, head_dim, num_blocks = 16, 4, 8, 64, 4096
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device)
    v_cache = torch.randn_like(k_cache)
    rows = []
    for batch, queries, context in [(32, 1, 256), (32, 1, 2048), (8, 1, 8192), (1, 256, 2048),
                                    (1, 512, 8192)]:
        tables = torch.stack([torch.randperm(num_blocks, device=device)[:-(-context // block_size)]
                              for _ in range(batch)])
        positions = (context - queries + torch.arange(queries, device=device)).repeat(batch, 1)
        q = torch.randn(batch, queries, heads, head_dim, device=device)
        row = {"batch": batch, "queries": queries, "context": context}
        for name, kernel in (("sdpa_ms", sdpa_paged_attention),
                             ("tiled_ms", tiled_paged_attention)):
            kernel(q, k_cache, v_cache, tables, positions)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                kernel(q, k_cache, v_cache, tables, positions)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            row[name] = (time.perf_counter() - start) / 5 * 1e3
        rows.append(row)
        print(f"  batch {batch:3d} queries {queries:4d} context {context:5d}: "
              f"sdpa {row['sdpa_ms']:8.2f} ms   tiled {row['tiled_ms']:8.2f} ms")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="preset with random weights")
    parser.add_argument("--model-path", help="HF folder or tetrad checkpoint instead of a preset")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(8, 96))
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 128))
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rate", type=float, help="Poisson arrivals per second (default: 70%% "
                                                   "of the measured continuous-batching rate)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (1 on a busy machine)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each batching mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention", action="store_true", help="only the kernel comparison")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available()
                                                         else "cpu")
    results: dict = {"device": torch.cuda.get_device_name() if device.startswith("cuda")
                     else f"cpu ({torch.get_num_threads()} threads)"}
    print(f"device: {results['device']}")
    if args.attention:
        results["attention"] = bench_attention(device)
    else:
        llm = make_engine(args)
        print(llm.kv_plan.describe())
        requests = make_requests(args, min(llm.model_config.vocab_size, 256))
        run_offline(make_engine(args), requests[:8], group=None)  # warm-up: allocator, kernels
        # Alternate the two modes and keep each one's best run: a shared machine's noise then
        # favours neither.
        runs = {"continuous": [], "static": []}
        for _ in range(args.repeats):
            runs["continuous"].append(run_offline(make_engine(args), requests, group=None))
            runs["static"].append(run_offline(make_engine(args), requests, args.max_num_seqs))
        continuous, static = (max(runs[mode], key=lambda run: run["tokens_per_s"])
                              for mode in ("continuous", "static"))
        results.update(continuous=continuous, static=static,
                       speedup=continuous["tokens_per_s"] / static["tokens_per_s"])
        print(f"continuous batching: {continuous['tokens_per_s']:8.1f} tokens/s, "
              f"KV utilization {continuous['kv_utilization_mean']:.1%} "
              f"(waste {1 - continuous['kv_utilization_mean']:.1%})")
        print(f"static batching:     {static['tokens_per_s']:8.1f} tokens/s  -> continuous is "
              f"{results['speedup']:.2f}x faster, in {continuous['steps']} steps instead of "
              f"{static['steps']}")
        rate = args.rate or 0.7 * len(requests) / continuous["time_s"]
        results["poisson"] = poisson = run_poisson(make_engine(args), requests, rate, args.seed)
        print(f"Poisson {rate:.2f}/s: TTFT p50/p90/p99 {poisson['ttft_p50_s'] * 1e3:.0f}/"
              f"{poisson['ttft_p90_s'] * 1e3:.0f}/{poisson['ttft_p99_s'] * 1e3:.0f} ms, TPOT "
              f"p50/p90/p99 {poisson['tpot_p50_s'] * 1e3:.1f}/{poisson['tpot_p90_s'] * 1e3:.1f}/"
              f"{poisson['tpot_p99_s'] * 1e3:.1f} ms")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
