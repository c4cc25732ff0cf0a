"""The measurements of benchmarks/cpu_vs_llamacpp.py, each run in a process of its own: tetrad's
engine (in tetrad's venv) and llama.cpp through llama-cpp-python (in a venv of its own, which has
neither torch nor tetrad: nothing here imports either at the top).

Every side takes `requests` prompts at once (1: one request; 32: batched decoding) and reports
the time until every request has its first token, then the decode tokens/s of all requests
together after that point, the greedy tokens, and the process's peak RSS."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

VOCAB = 8192
# tetrad's engine settings per row: int8 / int4 compute in bf16 (resolve_dtype's rule for an
# fp32 checkpoint that is quantized).
TETRAD_SETTINGS = {"fp32": dict(dtype="fp32"), "bf16": dict(dtype="bf16"),
                   "int8": dict(dtype="bf16", quantization="int8"),
                   "int4": dict(dtype="bf16", quantization="int4")}


def prompt_ids(length: int, request: int = 0) -> list[int]:
    """Request `request`'s prompt: the same ids on both sides, a different prompt per request."""
    return [(7 * i + 3 + 131 * request) % VOCAB for i in range(length)]


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM): getrusage's maxrss would report the parent's
    peak, which Linux carries across the fork and exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _result(start: float, first: float, end: float, tokens_at_first: int,
            tokens: list[list[int]]) -> dict:
    decoded = sum(map(len, tokens)) - tokens_at_first
    return {"ttft_s": first - start, "decode_tok_s": decoded / (end - first), "tokens": tokens,
            "peak_rss_mb": peak_rss_mb()}


def _tetrad_engine(args):
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))
    from token_ids import Tokens

    from tetrad.inference.engine import LLM

    # The KV pool holds what llama.cpp's context does (n_ctx below), not the CPU default.
    config = json.loads((Path(args.folder) / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    token_bytes = (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
                   * (4 if args.dtype == "fp32" else 2))
    return LLM(args.folder, Tokens(VOCAB), log=None, enforce_eager=args.eager,
               max_num_seqs=args.requests, max_model_len=_context(args),
               kv_memory=args.requests * _context(args) * token_bytes,
               **TETRAD_SETTINGS[args.dtype])


def _context(args) -> int:
    """Positions one request may hold (llama.cpp's n_ctx per sequence)."""
    return args.prompt + args.tokens + 16


def run_tetrad(args) -> dict:
    """`requests` prompts through LLM.step() (what LLM.generate loops over): the time until every
    request has its first token, then the decode tokens/s of all of them."""
    from tetrad.inference.core.params import SamplingParams

    llm = _tetrad_engine(args)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([prompt_ids(8)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    ids = [llm.add_request(prompt_ids(args.prompt, r), params) for r in range(args.requests)]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    first, tokens_at_first = None, 0
    while llm.has_unfinished():
        for output in llm.step():
            tokens[output.request_id] = output.token_ids
        if first is None and all(tokens.values()):
            first, tokens_at_first = time.perf_counter(), sum(map(len, tokens.values()))
    end = time.perf_counter()
    return _result(start, first, end, tokens_at_first, [tokens[i] for i in ids])


def profile_tetrad(args) -> dict:
    """torch.profiler over 16 decode steps of `requests` requests: ops per step, those of them
    called from Python (not nested in another op, such as the fused layer's own), and the ops
    that take the most self CPU time (ms per step)."""
    from torch.profiler import profile

    from tetrad.inference.core.params import SamplingParams

    llm = _tetrad_engine(args)
    for request in range(args.requests):
        llm.add_request(prompt_ids(args.prompt, request),
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(4):  # the prefill and a few decode steps first
        llm.step()
    steps = 16
    start = time.perf_counter()
    with profile() as prof:
        for _ in range(steps):
            llm.step()
    wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {"ops_per_step": sum(e.count for e in events) / steps,
            "outer_ops_per_step": sum(e.cpu_parent is None for e in prof.events()) / steps,
            "step_ms": 1e3 * wall / steps,
            "top": [(e.key, e.count // steps, e.self_cpu_time_total / 1e3 / steps)
                    for e in events[:6]]}


def run_llamacpp(args) -> dict:
    """The same through llama.cpp's own batched decoding (the low-level API, as llama.cpp's
    batched example runs it): one context of `requests` sequences, the prompts in llama_batches
    of up to n_batch tokens, then one llama_batch per step holding each sequence's last token;
    greedy is the argmax of each sequence's logits (what llama.cpp's greedy sampler takes)."""
    import llama_cpp
    import numpy as np

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(args.gguf.encode(),
                                                 llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = args.requests * _context(args)
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = args.requests
    params.n_threads = params.n_threads_batch = args.threads
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(max(512, args.requests), 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits), at most n_batch of them."""
        for i, (token, position, sequence, logits) in enumerate(entries):
            batch.token[i], batch.pos[i] = token, position
            batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = 1, sequence, logits
        batch.n_tokens = len(entries)
        if llama_cpp.llama_decode(ctx, batch):
            raise RuntimeError("llama_decode failed")

    def greedy(row: int) -> int:
        logits = llama_cpp.llama_get_logits_ith(ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(VOCAB,))))

    decode([(t, p, 0, p == 7) for p, t in enumerate(prompt_ids(8))])  # warm-up, as tetrad's
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    start = time.perf_counter()
    tokens: list[list[int]] = [[] for _ in range(args.requests)]
    prompt = [(t, p, r, p == args.prompt - 1) for r in range(args.requests)
              for p, t in enumerate(prompt_ids(args.prompt, r))]
    for offset in range(0, len(prompt), 512):
        chunk = prompt[offset:offset + 512]
        decode(chunk)
        for row, (_, _, request, logits) in enumerate(chunk):
            if logits:
                tokens[request].append(greedy(row))
    first = time.perf_counter()
    for position in range(args.prompt, args.prompt + args.tokens - 1):
        decode([(seq[-1], position, r, True) for r, seq in enumerate(tokens)])
        for request, seq in enumerate(tokens):
            seq.append(greedy(request))
    end = time.perf_counter()
    llama_cpp.llama_batch_free(batch)
    return _result(start, first, end, args.requests, tokens)


def quantize_gguf(source: str, target: str, ftype: str) -> None:
    """llama.cpp's llama_model_quantize (what its llama-quantize tool calls), default settings:
    as `llama-quantize SOURCE TARGET Q4_0` writes it."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    if llama_cpp.llama_model_quantize(source.encode(), target.encode(), params):
        raise RuntimeError(f"llama_model_quantize {source} -> {ftype} failed")
