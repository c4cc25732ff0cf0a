"""Serving on one GPU: the engine against transformers on the same requests, one command.

A ~1B Llama shape (TinyLlama's: hidden 2048, 22 layers, 32 heads / 4 KV heads, FFN 5632, vocab
32000), random weights in bf16; 256 requests whose prompt and output lengths follow a
ShareGPT-like spread (log-normal, medians 160 and 190 tokens, capped at 1024 and 512), greedy,
no early stop. Reports:

  1. tokens/s of `LLM.generate` (CUDA graphs, in-place paged attention), with TTFT and TPOT
     p50 / p99 of its run (every request arrives at the start);
  2. the decode step time at batch 1 to 64 against the memory-bandwidth floor (weight bytes + the
     batch's K/V bytes over the GPU's HBM bandwidth, from the catalog) and the planner's
     predicted TPOT, with the host's time per step (`StepTimes`: the step's wall time less the
     wait for the sampled ids, and how much of it is outside the model call);
  3. the engine's tokens/s against HF `generate` in static batches of --hf-batch (left-padded,
     each batch running to its longest output) and HF's continuous batching
     (ContinuousBatchingManager, each request with its own length), the slowest part, last.

    python benchmarks/gpu_serving.py --out runs/gpu        # one H100/H200, under 8 minutes
    python benchmarks/gpu_serving.py --device cpu          # a tiny scale, to check it runs

Every result is printed and rewritten to --out/gpu_serving.json as it comes, so a run cut short
keeps what it measured. The GPU defaults are the Triton backend's: 16-token blocks (varlen wanted
256), `--attention auto` (Triton first on a GPU where it runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from tetrad.spec.model import ModelConfig
from tetrad.hardware.catalog import gpu, gpu_from_device_name
from tetrad.hardware.profile import cluster
from tetrad.spec.hf import hf_from_model_config
from tetrad.inference.engine import LLM
from tetrad.inference.core.metrics import percentile
from tetrad.inference.core.params import SamplingParams
from tetrad.models.hf import to_hf_state_dict
from tetrad.models.transformer import Transformer
from tetrad.planner.memory import kv_bytes_per_token
from tetrad.planner.serving import (ServeLayout, ServeWorkload, evaluate_serving,
                                    model_weight_bytes)
from token_ids import Tokens

SHAPES = {  # (hidden, layers, heads, kv heads, ffn, vocab)
    "1b": (2048, 22, 32, 4, 5632, 32000),
    "tiny": (128, 2, 4, 2, 344, 512),
}


def sharegpt_like(count: int, max_prompt: int, max_output: int, vocab: int, seed: int):
    """(prompt ids, output length) pairs: log-normal lengths, as ShareGPT conversations have."""
    rng = random.Random(seed)

    def length(median: float, cap: int) -> int:
        return max(4, min(cap, int(rng.lognormvariate(math.log(median), 0.9))))

    return [([rng.randrange(vocab) for _ in range(length(160 * max_prompt / 1024, max_prompt))],
             length(190 * max_output / 512, max_output)) for _ in range(count)]


def build_models(args, device: torch.device, dtype: torch.dtype):
    hidden, layers, heads, kv_heads, ffn, vocab = SHAPES[args.shape]
    config = ModelConfig(name=f"llama-{args.shape}", vocab_size=vocab, hidden_size=hidden,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                         ffn_hidden_size=ffn, max_seq_len=2048)
    torch.manual_seed(0)
    with torch.device(device):
        ours = Transformer(config).to(dtype).eval()
        hf = LlamaForCausalLM(LlamaConfig(**hf_from_model_config(config),
                                          attn_implementation="sdpa")).to(dtype).eval()
    hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    hf.generation_config.pad_token_id = 0
    return config, ours, hf


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_engine(llm: LLM, requests) -> tuple[float, list]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in requests], params)
    return time.perf_counter() - start, outputs


def run_hf_static(hf, requests, batch: int, device: torch.device) -> float:
    start = time.perf_counter()
    for first in range(0, len(requests), batch):
        group = requests[first:first + batch]
        width = max(len(prompt) for prompt, _ in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group],
                            device=device)
        longest = max(n for _, n in group)
        hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                    do_sample=False)
    synchronize(device)
    return time.perf_counter() - start


def run_hf_continuous(hf, requests) -> float:
    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                              max_new_tokens=max(n for _, n in requests))
    manager = hf.init_continuous_batching(generation_config=config)
    start = time.perf_counter()
    manager.start()
    for prompt, n in requests:
        manager.add_request(prompt, max_new_tokens=n)
    done = 0
    while done < len(requests):
        done += manager.get_result(timeout=60) is not None
    manager.stop(block=True)
    return time.perf_counter() - start


class StepTimes:
    """Where the wall time of decode steps goes, in seconds summed over `steps`: `execute`, the
    runner's call (the forward, or a CUDA graph's input copy and replay) of which `prepare` is
    the runner's tables, slots and uploads; `wait`, reading the sampled ids back (the step's one
    host sync: on a GPU the host idles there until the device is done). The host's time per
    step is the wall time less the wait; outside the model call it is also less the model call
    (on a CPU the forward computes, on a GPU it only launches)."""

    def __init__(self):
        self.steps = 0
        self.wall = self.execute = self.prepare = self.wait = 0.0

    def per_step_ms(self) -> dict[str, float]:
        model = self.execute - self.prepare
        values = {"step_ms": self.wall, "host_ms": self.wall - self.wait,
                  "outside_model_ms": self.wall - model - self.wait, "prepare_ms": self.prepare,
                  "model_call_ms": model, "wait_ms": self.wait}
        return {name: seconds * 1e3 / self.steps for name, seconds in values.items()}


@contextmanager
def timing_steps(llm: LLM):
    """StepTimes of the `llm.step()` calls made through the yielded `step`."""
    times, runner, tolist = StepTimes(), llm.runner, torch.Tensor.tolist

    def timed(function, name: str):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                setattr(times, name, getattr(times, name) + time.perf_counter() - start)
        return call

    def step():
        start = time.perf_counter()
        llm.step()
        times.wall += time.perf_counter() - start
        times.steps += 1

    execute, prepare = llm._execute, runner.prepare
    llm._execute, runner.prepare = timed(execute, "execute"), timed(prepare, "prepare")
    torch.Tensor.tolist = timed(tolist, "wait")
    try:
        yield step, times
    finally:
        torch.Tensor.tolist, llm._execute, runner.prepare = tolist, execute, prepare


def time_decode_steps(llm: LLM, batch: int, context: int, count: int) -> StepTimes:
    """StepTimes of `count` decode steps of `batch` sequences past `context` tokens each."""
    vocab = llm.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=count + 2, ignore_eos=True)
    for index in range(batch):
        llm.add_request([(index + j) % vocab for j in range(context)], params)
    while any(seq.num_computed_tokens < context for seq in llm.scheduler.running) or \
            llm.scheduler.waiting:
        llm.step()  # prefill (and a first decode for the earliest)
    llm.step()
    with timing_steps(llm) as (step, times):
        for _ in range(count):
            step()
    return times


def decode_step_times(llm_factory, config: ModelConfig, args):
    """Per batch size, as measured: a decode step's wall and host time against the bandwidth
    floor and the planner."""
    context = args.step_context
    bandwidth = gpu(args.gpu).memory_bandwidth
    weights = model_weight_bytes(config, "bf16")
    per_token = kv_bytes_per_token(config, 2)
    for batch in args.step_batches:
        llm = llm_factory(max_num_seqs=max(batch, 1))
        times = time_decode_steps(llm, batch, context, args.step_count).per_step_ms()
        floor = (weights + batch * (context + args.step_count) * per_token) / bandwidth
        workload = ServeWorkload(context_len=context + args.step_count, prompt_len=context,
                                 output_len=args.step_count, batch=batch)
        planned = evaluate_serving(config, cluster(args.gpu, 1), ServeLayout(), workload).tpot_s
        yield {"batch": batch, **times, "floor_ms": floor * 1e3, "planner_ms": planned * 1e3}
        del llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=tuple(SHAPES), help="default: 1b on cuda, tiny on cpu")
    parser.add_argument("--requests", type=int, help="default: 256 on cuda, 16 on cpu")
    parser.add_argument("--max-prompt", type=int, help="default: 1024 on cuda, 64 on cpu")
    parser.add_argument("--max-output", type=int, help="default: 512 on cuda, 32 on cpu")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=64, help="HF static batch size")
    parser.add_argument("--block-size", type=int, default=16,
                        help="16: the Triton kernels' (varlen needs a multiple of 256)")
    parser.add_argument("--attention", default="auto", help="the engine's --attention")
    parser.add_argument("--gpu", help="the GPU of the floor and the planner (default: this one)")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu"),
                        help="where gpu_serving.json is written as results come")
    parser.add_argument("--step-batches", type=int, nargs="+", default=(1, 8, 16, 32, 64))
    parser.add_argument("--step-context", type=int, default=512)
    parser.add_argument("--step-count", type=int, default=20)
    parser.add_argument("--kv-memory", default="16GiB", help="the engine's KV pool (HF needs "
                                                             "the rest of the GPU)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    args.shape = args.shape or ("tiny" if cpu else "1b")
    args.requests = args.requests or (16 if cpu else 256)
    args.max_prompt = args.max_prompt or (64 if cpu else 1024)
    args.max_output = args.max_output or (32 if cpu else 512)
    if cpu:
        args.step_context, args.step_count, args.block_size = 64, 4, 16
        args.step_batches = [b for b in args.step_batches if b <= 16]
    dtype = torch.float32 if cpu else torch.bfloat16
    device_name = "cpu" if cpu else torch.cuda.get_device_name()
    known = None if cpu else gpu_from_device_name(device_name)
    args.gpu = args.gpu or (known.name if known else "h100")
    config, model, hf = build_models(args, device, dtype)
    print(f"device {device_name}: {config.name}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {dtype}, "
          f"--block-size {args.block_size}, --attention {args.attention}")
    report = {"device": device_name, "model": config.name, "block_size": args.block_size,
              "attention": args.attention, "requests": args.requests}
    out = Path(args.out) / "gpu_serving.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def record(**results) -> None:
        report.update(results)
        out.write_text(json.dumps(report, indent=1))

    def llm_factory(**overrides) -> LLM:
        settings = dict(device=args.device, block_size=args.block_size, attention=args.attention,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192, log=None,
                        kv_memory="64MiB" if cpu else args.kv_memory)
        return LLM(model, Tokens(config.vocab_size), **{**settings, **overrides})

    requests = sharegpt_like(args.requests, args.max_prompt, args.max_output,
                             config.vocab_size, seed=0)
    tokens = sum(n for _, n in requests)
    prompt_median = statistics.median(len(prompt) for prompt, _ in requests)
    print(f"{len(requests)} requests: prompts median {prompt_median:.0f} tokens, outputs median "
          f"{statistics.median(n for _, n in requests):.0f}, {tokens} output tokens")
    llm = llm_factory()
    record(backend=llm.runner.backend)
    run_engine(llm, requests[:8])  # warm-up
    seconds, outputs = run_engine(llm, requests)
    del llm  # its KV pool and graphs: HF needs the memory
    if not cpu:
        torch.cuda.empty_cache()
    ttft = [o.first_token_time - o.arrival_time for o in outputs]
    tpot = [(o.finish_time - o.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outputs if len(o.outputs[0].token_ids) > 1]
    ours = tokens / seconds
    print(f"LLM.generate: {ours:.0f} tokens/s; TTFT p50 {percentile(ttft, 50) * 1e3:.0f} ms, "
          f"p99 {percentile(ttft, 99) * 1e3:.0f} ms; TPOT p50 {percentile(tpot, 50) * 1e3:.1f} "
          f"ms, p99 {percentile(tpot, 99) * 1e3:.1f} ms (backend {report['backend']})")
    record(engine_tokens_per_s=ours, ttft_p50_ms=percentile(ttft, 50) * 1e3,
           tpot_p50_ms=percentile(tpot, 50) * 1e3, tpot_p99_ms=percentile(tpot, 99) * 1e3)
    # The engine's own numbers first: HF's continuous batching is the slowest part (it did not
    # finish in 200 s on an H100), so whatever time a run has left goes to it last.
    print(f"decode step, context {args.step_context} (floor and planner: {args.gpu}, HBM "
          f"{gpu(args.gpu).memory_bandwidth / 1e12:.2f} TB/s); host: the step less its wait for "
          f"the device, and of that outside the model call:")
    rows = []
    for row in decode_step_times(llm_factory, config, args):
        print(f"  batch {row['batch']:3d}: {row['step_ms']:8.2f} ms   floor "
              f"{row['floor_ms']:6.2f} ms ({row['step_ms'] / row['floor_ms']:.1f}x)   planner "
              f"{row['planner_ms']:6.2f} ms   host {row['host_ms']:6.2f} ms, outside the model "
              f"{row['outside_model_ms']:6.2f} ms (prepare {row['prepare_ms']:.2f} ms)")
        rows.append(row)
        record(decode_steps=rows)
    if not args.skip_hf:
        with torch.inference_mode():
            static = tokens / run_hf_static(hf, requests, args.hf_batch, device)
            print(f"HF generate, static batches of {args.hf_batch}: {static:.0f} tokens/s -> "
                  f"engine {ours / static:.2f}x")
            record(hf_static_tokens_per_s=static, engine_vs_hf_static=ours / static)
            continuous = tokens / run_hf_continuous(hf, requests)
            print(f"HF continuous batching: {continuous:.0f} tokens/s -> engine "
                  f"{ours / continuous:.2f}x")
            record(hf_continuous_tokens_per_s=continuous,
                   engine_vs_hf_continuous=ours / continuous)

if __name__ == "__main__":
    main()
