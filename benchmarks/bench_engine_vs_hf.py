"""The serving engine's decode step against transformers' on the same model (a Llama shape, random
weights, the same weights in both), CPU, everything in one run:

  1. aten ops per decode step (TorchDispatchMode: every kernel-level op, about one launch each on
     a GPU) of `LLM.step()` against HF's forward over its KV cache + argmax, batch --batch;
  2. host syncs per decode step: ops that read a device value back (item, nonzero, ...) and
     `Tensor.tolist` calls; for HF, `generate()`'s per token;
  3. bytes attention reads per decode step / K+V bytes of the contexts: the CPU kernel (the
     default, --attention cpu) counts the K and V rows it reads as it runs; from the step's block
     tables, the gathering backends read the padded tables' blocks twice (the copy, then SDPA
     over it) and FlexAttention visits the blocks its block mask lists;
  4. host time per decode step at batch --batch past --step-context tokens (gpu_serving.py's
     StepTimes): the step's wall time outside the model's forward (scheduling, the plan, the
     runner's prepare, sampling, bookkeeping), and the prepare alone;
  5. tokens/s of `LLM.generate` against HF `generate` in static batches of --max-num-seqs
     (left-padded) and HF's continuous batching (ContinuousBatchingManager), on the same
     requests (gpu_serving.py's runs of the three).

    .venv/bin/python benchmarks/bench_engine_vs_hf.py [--threads 1] [--requests 32]
"""

from __future__ import annotations

import argparse
import random
import time
import warnings
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from gpu_serving import run_engine, run_hf_continuous, run_hf_static, time_decode_steps
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tetrad.spec.model import ModelConfig
from tetrad.spec.hf import hf_from_model_config
from tetrad.inference.worker.attention import paged_block_mask
from tetrad.inference.engine import LLM
from tetrad.inference.core.params import SamplingParams
from tetrad.models.hf import to_hf_state_dict
from tetrad.models.transformer import Transformer
from tetrad.tokenizer import ByteTokenizer

# Ops whose result the host must wait for (the device value is read back).
SYNC_OPS = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "unique")


class OpCounter(TorchDispatchMode):
    """ops: every aten op dispatched; kernels: those that compute (not views, not a `to` or
    `contiguous` that hands back its input): about one launch each on a GPU."""

    def __init__(self):
        super().__init__()
        self.ops = self.kernels = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        aliased = func.is_view or (not func._schema.is_mutable
                                   and any(out is arg for arg in args))
        self.kernels += not aliased
        if any(name in func.__name__ for name in SYNC_OPS):
            self.syncs += 1
        return out


@contextmanager
def counting():
    """An OpCounter whose syncs include Tensor.tolist calls (which dispatch no op on CPU)."""
    counter, tolist = OpCounter(), torch.Tensor.tolist

    def counted(tensor):
        counter.syncs += 1
        return tolist(tensor)

    torch.Tensor.tolist = counted
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = tolist


def models(args):
    torch.manual_seed(0)
    config = ModelConfig(name="bench", vocab_size=args.vocab, hidden_size=args.hidden,
                         num_layers=args.layers, num_heads=8, num_kv_heads=4,
                         ffn_hidden_size=args.ffn, max_seq_len=1024)
    ours = Transformer(config).eval()
    hf = LlamaForCausalLM(LlamaConfig(**hf_from_model_config(config),
                                      attn_implementation="sdpa")).eval()
    hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    hf.generation_config.pad_token_id = 0
    return ours, hf


def engine(model, args, **config) -> LLM:
    return LLM(model, ByteTokenizer(), log=None, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=2048, **config)


def decode_step_counts(model, hf, args) -> dict:
    prompts = [[(7 * i + j) % args.vocab for j in range(40 + 13 * i)] for i in range(args.batch)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = engine(model, args)
    for prompt in prompts:
        llm.add_request(prompt, greedy)
    llm.step()  # the prompts' prefill
    llm.step()  # a first decode step: warm
    plans, execute = [], llm._execute
    rows_read = torch.zeros(1, dtype=torch.long)
    llm.runner.fused.rows_read = rows_read  # the CPU kernel counts the rows it reads

    def recording(plan):
        plans.append(plan)
        return execute(plan)

    llm._execute = recording
    with counting() as ours:
        llm.step()
    plan = plans[-1]
    assert max(plan.num_tokens) == 1, "the measured step must be a pure decode step"
    ids = torch.tensor([prompt[:40] for prompt in prompts])  # equal lengths: no padding
    with torch.inference_mode():
        cache = DynamicCache()
        logits = hf(input_ids=ids, past_key_values=cache, use_cache=True).logits
        next_ids = logits[:, -1].argmax(-1, keepdim=True)
        hf(input_ids=next_ids, past_key_values=cache, use_cache=True)  # warm
        with counting() as theirs:
            logits = hf(input_ids=next_ids, past_key_values=cache, use_cache=True).logits
            logits[:, -1].argmax(-1, keepdim=True)
        with counting() as generate:
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                        min_new_tokens=16, do_sample=False)
    # Bytes attention reads over the K+V bytes of the contexts, from the step's tables.
    size = llm.runner.block_size
    _, width, padded = plan.decode_slots_and_tables(size, llm.runner.kv_cache.pad_block)
    tables = torch.tensor(padded).view(len(plan.starts), width)
    query_positions = torch.tensor(plan.starts)[:, None]
    context_tokens = sum(start + 1 for start in plan.starts)
    gathered = 2 * tables.numel() * size  # the copy, then SDPA reading it
    num_blocks = query_positions[:, 0] // size + 1
    mask = paged_block_mask(tables, num_blocks, query_positions,
                            llm.runner.kv_cache.pool.shape[2], size)
    visited = int(mask.kv_num_blocks.sum()) * size
    # The kernel's count covers every layer and KV head, K and V: per layer, one row per token.
    kernel_rows = int(rows_read) / (2 * args.layers * model.config.num_kv_heads)
    return {"ops": ours.ops, "hf_ops": theirs.ops, "kernels": ours.kernels,
            "hf_kernels": theirs.kernels, "syncs": ours.syncs,
            "hf_forward_syncs": theirs.syncs, "hf_generate_syncs_per_token": generate.syncs / 16,
            "gather_bytes_ratio": gathered / context_tokens, "flex_bytes_ratio":
            visited / context_tokens, "kernel_bytes_ratio": kernel_rows / context_tokens,
            "backend": llm.runner.backend}


def throughput(model, hf, args) -> dict:
    """The same requests (prompts 16-160 tokens, outputs 16-112, greedy, no early stop) through
    the three: a static batch runs to its longest output, as HF generate does."""
    rng = random.Random(0)
    requests = [([rng.randrange(args.vocab) for _ in range(rng.randint(16, 160))],
                 rng.randint(16, 112)) for _ in range(args.requests)]
    tokens, device = sum(n for _, n in requests), torch.device("cpu")
    runs = {"tetrad": lambda: run_engine(engine(model, args), requests),
            # The former CPU default: decode K/V gathered into padded tensors for SDPA.
            "tetrad_gathering": lambda: run_engine(engine(model, args, attention="sdpa"),
                                                   requests),
            "hf_static": lambda: run_hf_static(hf, requests, args.max_num_seqs, device),
            "hf_continuous": lambda: run_hf_continuous(hf, requests)}
    best = {name: float("inf") for name in runs}
    with torch.inference_mode():
        for _ in range(args.repeats):  # alternate, keep each one's best: noise favours none
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
    return {"tokens": tokens, **{f"{name}_tokens_per_s": tokens / seconds
                                 for name, seconds in best.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=256, help="the byte tokenizer's")
    parser.add_argument("--batch", type=int, default=8, help="sequences of the counted step")
    parser.add_argument("--step-context", type=int, default=128,
                        help="context of the host-time steps")
    parser.add_argument("--step-count", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model, hf = models(args)
    counts = decode_step_counts(model, hf, args)
    print(f"decode step, batch {args.batch}, {args.layers} layers "
          f"(attention backend {counts['backend']}):")
    print(f"  aten ops: tetrad {counts['ops']}, HF {counts['hf_ops']} "
          f"(ratio {counts['ops'] / counts['hf_ops']:.2f}); of them computing (no view or "
          f"alias): tetrad {counts['kernels']}, HF {counts['hf_kernels']} "
          f"(ratio {counts['kernels'] / counts['hf_kernels']:.2f})")
    print(f"  host syncs: tetrad {counts['syncs']}, HF forward + argmax "
          f"{counts['hf_forward_syncs']}, HF generate {counts['hf_generate_syncs_per_token']:.1f}"
          f" per token")
    print(f"  attention bytes read / K+V bytes of the contexts: CPU kernel (counted as it runs) "
          f"{counts['kernel_bytes_ratio']:.2f}, gathering {counts['gather_bytes_ratio']:.2f}, "
          f"flex block mask {counts['flex_bytes_ratio']:.2f}")
    with torch.inference_mode():
        times = time_decode_steps(engine(model, args), args.batch, args.step_context,
                                  args.step_count).per_step_ms()
    print(f"  host time per decode step (batch {args.batch}, context {args.step_context}, "
          f"{args.step_count} steps): step {times['step_ms']:.2f} ms, outside the forward "
          f"{times['outside_model_ms']:.2f} ms ({times['outside_model_ms'] / times['step_ms']:.0%}"
          f"), of which the runner's prepare {times['prepare_ms']:.2f} ms")
    if not args.skip_throughput:
        rates = throughput(model, hf, args)
        ours = rates["tetrad_tokens_per_s"]
        print(f"{args.requests} requests, {rates['tokens']} output tokens: LLM.generate "
              f"{ours:.0f} tokens/s = {ours / rates['hf_static_tokens_per_s']:.2f}x HF static "
              f"batches ({rates['hf_static_tokens_per_s']:.0f}), "
              f"{ours / rates['hf_continuous_tokens_per_s']:.2f}x HF continuous batching "
              f"({rates['hf_continuous_tokens_per_s']:.0f}); with --attention sdpa (gathering) "
              f"{rates['tetrad_gathering_tokens_per_s']:.0f} tokens/s")


if __name__ == "__main__":
    main()
