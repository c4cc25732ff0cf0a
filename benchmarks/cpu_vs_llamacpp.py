"""tetrad's engine against llama.cpp (llama-cpp-python, the engine inside Ollama) on a CPU: the
same weights (a Llama shape with random weights, saved as an HF folder and converted to GGUF by
llama.cpp's own convert_hf_to_gguf.py), the same token-id prompts, greedy, 2 threads each, each
measurement in a process of its own (so peak RSS is that side's alone), the sides interleaved
round after round so that a change in the machine's load hits both.

Per dtype (fp32 / bf16 against the GGUF f32 / bf16 file): one request's decode tokens/s, its
first-token time, the greedy tokens both sides agree on, and the peak RSS of the process.

Set-up (nothing of it is a tetrad dependency; the llama.cpp side is skipped when
--llamacpp-python cannot import llama_cpp):

    python3 -m venv /tmp/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llamacpp-venv/bin/pip install llama-cpp-python
    pip download --no-binary :all: --no-deps llama-cpp-python   # its sdist: the converter
    pip install --target /tmp/llamacpp-pydeps sentencepiece     # the converter's tokenizer

    .venv/bin/python benchmarks/cpu_vs_llamacpp.py --shape 32m \\
        --convert SDIST/vendor/llama.cpp/convert_hf_to_gguf.py \\
        --converter-path /tmp/llamacpp-pydeps --llamacpp-python /tmp/llamacpp-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (hidden, layers, heads, kv heads, ffn): Llama shapes of ~34M and ~300M parameters, 8k vocabulary.
SHAPES = {"32m": (512, 8, 8, 8, 1408), "300m": (1024, 22, 16, 16, 2816)}
VOCAB = 8192
GGUF_TYPES = {"fp32": "f32", "bf16": "bf16"}


def prompt_ids(length: int) -> list[int]:
    return [(7 * i + 3) % VOCAB for i in range(length)]


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM): getrusage's maxrss would report the parent's
    peak, which Linux carries across the fork and exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_tetrad(args) -> dict:
    """One request through LLM.step(): the first token's time, then the decode tokens/s."""
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_serving import Tokens

    from tetrad.inference.core.params import SamplingParams
    from tetrad.inference.engine import LLM

    llm = LLM(args.folder, Tokens(VOCAB), log=None, dtype=args.dtype,
              enforce_eager=args.eager)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([prompt_ids(8)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    llm.add_request(prompt_ids(args.prompt), params)
    first = None
    tokens: list[int] = []
    while llm.has_unfinished():
        for output in llm.step():
            tokens = output.token_ids
        if first is None and tokens:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft_s": first - start, "decode_tok_s": (len(tokens) - 1) / (end - first),
            "tokens": tokens, "peak_rss_mb": peak_rss_mb()}


def profile_tetrad(args) -> dict:
    """torch.profiler over 16 decode steps of one request: ops per step, and the ops that take
    the most self CPU time (ms per step)."""
    import torch
    from torch.profiler import profile

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_serving import Tokens

    from tetrad.inference.core.params import SamplingParams
    from tetrad.inference.engine import LLM

    llm = LLM(args.folder, Tokens(VOCAB), log=None, dtype=args.dtype, enforce_eager=args.eager)
    llm.add_request(prompt_ids(args.prompt),
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
            "step_ms": 1e3 * wall / steps,
            "top": [(e.key, e.count // steps, e.self_cpu_time_total / 1e3 / steps)
                    for e in events[:6]]}


def print_profiles(folder: Path, args) -> None:
    for dtype in args.dtypes:
        for name, extra in (("eager forward", ["--eager"]), ("fused step", [])):
            result = child(sys.executable, ["--side", "tetrad", "--profile", "--folder",
                                            str(folder), "--dtype", dtype, "--prompt",
                                            str(args.prompt), "--threads", str(args.threads),
                                            *extra])
            top = "; ".join(f"{key} x{count} {ms:.2f} ms" for key, count, ms in result["top"])
            print(f"{dtype} {name}: {result['ops_per_step']:.0f} profiled ops per decode step, "
                  f"{result['step_ms']:.1f} ms per step (profiled); most self time: {top}")


def run_llamacpp(args) -> dict:
    """The same through llama-cpp-python's eval loop (greedy: the argmax of each step's logits,
    as llama.cpp's greedy sampler takes)."""
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    def greedy() -> int:  # the last evaluated token's logits (eval keeps none without logits_all)
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(VOCAB,))))

    llm = Llama(args.gguf, n_ctx=args.prompt + args.tokens + 16, n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=512, verbose=False)
    llm.eval(prompt_ids(8))  # warm-up, as the tetrad side's
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt_ids(args.prompt))
    tokens = [greedy()]
    first = time.perf_counter()
    while len(tokens) < args.tokens:
        llm.eval([tokens[-1]])
        tokens.append(greedy())
    end = time.perf_counter()
    return {"ttft_s": first - start, "decode_tok_s": (len(tokens) - 1) / (end - first),
            "tokens": tokens, "peak_rss_mb": peak_rss_mb()}


def export(args, folder: Path) -> None:
    """The random model as an HF folder, with a small SentencePiece tokenizer (the converter
    pads its vocabulary to the model's with unused tokens; the benchmark sends ids)."""
    import torch

    from tetrad.models.hf import save_hf
    from tetrad.models.transformer import Transformer
    from tetrad.spec.model import ModelConfig

    hidden, layers, heads, kv_heads, ffn = SHAPES[args.shape]
    config = ModelConfig(name=f"llama-{args.shape}", vocab_size=VOCAB, hidden_size=hidden,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                         ffn_hidden_size=ffn, max_seq_len=2048)
    torch.manual_seed(0)
    save_hf(Transformer(config), folder, dtype="fp32")
    if not args.convert:
        return
    train = ("import sentencepiece as spm, sys; spm.SentencePieceTrainer.train("
             "sentence_iterator=iter(['tetrad against llama.cpp %d' % i for i in range(2000)]),"
             "model_prefix=sys.argv[1], vocab_size=320, model_type='bpe', byte_fallback=True,"
             "minloglevel=2)")
    subprocess.run([sys.executable, "-c", train, str(folder / "tokenizer")], check=True,
                   env=converter_env(args))


def converter_env(args) -> dict:
    paths = [str(Path(args.convert).parent / "gguf-py"), *args.converter_path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def convert(args, folder: Path, gguf_type: str) -> Path:
    out = folder / f"model-{gguf_type}.gguf"
    subprocess.run([sys.executable, args.convert, str(folder), "--outtype", gguf_type,
                    "--outfile", str(out)], check=True, env=converter_env(args),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def child(python: str, argv: list[str]) -> dict:
    result = subprocess.run([python, __file__, *argv], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "2"})
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def llamacpp_available(python: str | None) -> bool:
    if python is None:
        return False
    return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def compare(args) -> None:
    load = os.getloadavg()[0]
    print(f"shape {args.shape}, prompt {args.prompt}, {args.tokens} tokens, {args.threads} "
          f"threads, {args.rounds} rounds; load average {load:.1f}")
    has_llamacpp = llamacpp_available(args.llamacpp_python) and args.convert is not None
    if not has_llamacpp:
        print("llama.cpp side skipped: no --convert, or --llamacpp-python cannot import "
              "llama_cpp (install llama-cpp-python there; see this file's docstring)")
        args.convert = None
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        export(args, folder)
        if args.profile:
            print_profiles(folder, args)
            return
        ggufs = ({dtype: convert(args, folder, gguf) for dtype, gguf in GGUF_TYPES.items()
                  if dtype in args.dtypes} if has_llamacpp else {})
        common = ["--prompt", str(args.prompt), "--tokens", str(args.tokens),
                  "--threads", str(args.threads)]
        results: dict[tuple[str, str], list[dict]] = {}
        for round_index in range(args.rounds):
            for dtype in args.dtypes:
                sides = [("tetrad", sys.executable, ["--folder", str(folder), "--dtype", dtype])]
                if not args.skip_eager:
                    sides.append(("tetrad eager", sys.executable,
                                  ["--folder", str(folder), "--dtype", dtype, "--eager"]))
                if has_llamacpp:
                    sides.append(("llama.cpp", args.llamacpp_python, ["--gguf", str(ggufs[dtype])]))
                for name, python, extra in sides[::1 if round_index % 2 == 0 else -1]:
                    result = child(python, ["--side", name.split()[0], *extra, *common])
                    results.setdefault((dtype, name), []).append(result)
                    print(f"round {round_index + 1} {dtype} {name}: "
                          f"{result['decode_tok_s']:.1f} tokens/s, load average "
                          f"{os.getloadavg()[0]:.1f}", flush=True)
    report(results, args.dtypes)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def report(results: dict, dtypes: list[str]) -> None:
    print("| dtype | side | decode tokens/s (median, all) | first token ms | peak RSS MB "
          "| greedy tokens equal to llama.cpp's |")
    print("|---|---|---|---:|---:|---|")
    for dtype in dtypes:
        theirs = results.get((dtype, "llama.cpp"))
        for side in ("tetrad", "tetrad eager", "llama.cpp"):
            runs = results.get((dtype, side))
            if not runs:
                continue
            speeds = [run["decode_tok_s"] for run in runs]
            ratio = (f" ({median(speeds) / median([r['decode_tok_s'] for r in theirs]):.2f}x)"
                     if theirs and side != "llama.cpp" else "")
            agree = "-"
            if theirs and side != "llama.cpp":
                ours, ref = runs[0]["tokens"], theirs[0]["tokens"]
                same = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
                agree = f"first {same} of {len(ref)}"
            print(f"| {dtype} | {side} | {median(speeds):.1f}{ratio}, "
                  f"{', '.join(f'{s:.1f}' for s in speeds)} | "
                  f"{1e3 * median([r['ttft_s'] for r in runs]):.0f} | "
                  f"{max(r['peak_rss_mb'] for r in runs):.0f} | {agree} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="32m")
    parser.add_argument("--dtypes", nargs="+", default=list(GGUF_TYPES), choices=tuple(GGUF_TYPES))
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--convert", help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--converter-path", action="append", default=[],
                        help="a folder the converter imports from (sentencepiece)")
    parser.add_argument("--llamacpp-python", help="a python that imports llama_cpp")
    # A measurement's own process (what the parent runs).
    parser.add_argument("--side", choices=("tetrad", "llama.cpp"))
    parser.add_argument("--folder")
    parser.add_argument("--gguf")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--eager", action="store_true", help="tetrad: the model's own forward")
    parser.add_argument("--skip-eager", action="store_true",
                        help="leave out tetrad's eager forward (--enforce-eager) runs")
    parser.add_argument("--profile", action="store_true",
                        help="only profile tetrad's decode step, eager forward and fused")
    args = parser.parse_args()
    if args.side:
        run = profile_tetrad if args.profile else run_tetrad
        print(json.dumps(run(args) if args.side == "tetrad" else run_llamacpp(args)))
    else:
        compare(args)


if __name__ == "__main__":
    main()
