"""tetrad's engine against llama.cpp (llama-cpp-python, the engine inside Ollama) on a CPU: the
same weights (a Llama shape with random weights, saved as an HF folder and converted to GGUF by
llama.cpp's own convert_hf_to_gguf.py), the same token-id prompts, greedy, 2 threads each, each
measurement in a process of its own (so peak RSS is that side's alone), the sides interleaved
round after round so that a change in the machine's load hits both.

Rows: fp32 / bf16 against the GGUF f32 / bf16 file; tetrad's int8 against the GGUF converted
with `--outtype q8_0`, and int4 against the f32 GGUF quantized to Q4_0 by llama.cpp's
llama_model_quantize (llama-quantize's defaults: its output matrix goes to Q6_K, as in Ollama's
Q4_0 files; tetrad keeps its LM head and embeddings in bf16). Both sides quantize before they are
measured, as Ollama's models come: tetrad's int8 / int4 folder is stored quantized
(tetrad.models.quant_store, what `tetrad create --quantize` writes); `--quantize-at-load` serves
the 16-bit folder with `--quantization` instead, calibrating in the measured process. Each with one
request and with 32 batched (llama.cpp's batched decoding: one llama_batch holding a token per
sequence per step). Per row: the decode tokens/s of all requests together, the time until every
request has its first token, the greedy tokens both sides agree on, the peak RSS (VmHWM) of the
measuring process, and the 1-minute load average at each measurement.

Set-up (nothing of it is a tetrad dependency; the llama.cpp side is skipped when
--llamacpp-python cannot import llama_cpp):

    python3 -m venv /tmp/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llamacpp-venv/bin/pip install llama-cpp-python
    pip download --no-binary :all: --no-deps llama-cpp-python   # its sdist: the converter
    pip install --target /tmp/llamacpp-pydeps sentencepiece     # the converter's tokenizer

    .venv/bin/python benchmarks/cpu_vs_llamacpp.py --shape 32m \\
        --convert SDIST/vendor/llama.cpp/convert_hf_to_gguf.py \\
        --converter-path /tmp/llamacpp-pydeps --llamacpp-python /tmp/llamacpp-venv/bin/python

The measurements themselves are in cpu_vs_llamacpp_sides.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cpu_vs_llamacpp_sides import (TETRAD_SETTINGS, VOCAB, profile_tetrad, quantize_gguf,
                                   run_llamacpp, run_tetrad)

# (hidden, layers, heads, kv heads, ffn): Llama shapes of ~34M and ~300M parameters, 8k vocabulary.
SHAPES = {"32m": (512, 8, 8, 8, 1408), "300m": (1024, 22, 16, 16, 2816)}
# Per tetrad row: the converter's --outtype, then the llama_model_quantize type (if any).
GGUF_TYPES = {"fp32": ("f32", None), "bf16": ("bf16", None), "int8": ("q8_0", None),
              "int4": ("f32", "Q4_0")}


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


def made(target: Path, make) -> Path:
    """`target` (a file or a folder), made by `make(path)` at a scratch name beside it and renamed
    once complete: a run interrupted while making it leaves nothing that a later --keep run
    would take for finished."""
    if not target.exists():
        partial = target.with_name(target.name + ".partial")
        if partial.is_dir():
            shutil.rmtree(partial)
        partial.unlink(missing_ok=True)
        make(partial)
        partial.rename(target)
    return target


def converter_env(args) -> dict:
    paths = [str(Path(args.convert).parent / "gguf-py"), *args.converter_path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}



def gguf_file(args, hf: Path, dtype: str) -> Path:
    """The GGUF file llama.cpp's side serves for `dtype`, made from the HF folder `hf` (beside
    it)."""
    outtype, quantized = GGUF_TYPES[dtype]

    def convert(path: Path) -> None:
        subprocess.run([sys.executable, args.convert, str(hf), "--outtype", outtype,
                        "--outfile", str(path)], check=True, env=converter_env(args),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    source = made(hf.parent / f"model-{outtype}.gguf", convert)
    if quantized is None:
        return source
    return made(hf.parent / f"model-{quantized}.gguf", lambda path: subprocess.run(
        [args.llamacpp_python, __file__, "--quantize-gguf", str(source), str(path), quantized],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def tetrad_folder(args, hf: Path, dtype: str) -> Path:
    """The folder tetrad's side serves: the exported HF one, or for int8 / int4 (without
    --quantize-at-load) the same model stored quantized (beside it)."""
    method = TETRAD_SETTINGS[dtype].get("quantization")
    if method is None or args.quantize_at_load:
        return hf
    import torch

    from tetrad.models.quant_store import quantize_folder

    torch.set_num_threads(args.threads)

    def quantize(path: Path) -> None:
        path.mkdir()
        quantize_folder(hf, path, method)

    return made(hf.parent / f"tetrad-{method}", quantize)


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


def print_profiles(folder: Path, args) -> None:
    for dtype in args.dtypes:
        for name, extra in (("eager forward", ["--eager"]), ("fused step", [])):
            result = child(sys.executable, ["--side", "tetrad", "--profile", "--folder",
                                            str(folder), "--dtype", dtype, "--prompt",
                                            str(args.prompt), "--threads", str(args.threads),
                                            "--requests", str(args.requests[0]), *extra])
            top = "; ".join(f"{key} x{count} {ms:.2f} ms" for key, count, ms in result["top"])
            print(f"{dtype} {name}: {result['ops_per_step']:.0f} profiled ops per decode step "
                  f"({result['outer_ops_per_step']:.0f} called from Python), "
                  f"{result['step_ms']:.1f} ms per step (profiled); most self time: {top}")


def compare(args) -> None:
    print(f"shape {args.shape}, prompt {args.prompt}, {args.tokens} tokens, {args.threads} "
          f"threads, {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    has_llamacpp = llamacpp_available(args.llamacpp_python) and args.convert is not None
    if not has_llamacpp:
        print("llama.cpp side skipped: no --convert, or --llamacpp-python cannot import "
              "llama_cpp (install llama-cpp-python there; see this file's docstring)")
        args.convert = None
    with tempfile.TemporaryDirectory() as scratch:
        kept = Path(scratch) if args.keep is None else Path(args.keep) / args.shape
        kept.mkdir(parents=True, exist_ok=True)
        hf = made(kept / "hf", lambda path: export(args, path))
        if args.profile:
            print_profiles(hf, args)
            return
        ggufs = ({dtype: gguf_file(args, hf, dtype) for dtype in args.dtypes}
                 if has_llamacpp else {})
        folders = {dtype: tetrad_folder(args, hf, dtype) for dtype in args.dtypes}
        common = ["--prompt", str(args.prompt), "--tokens", str(args.tokens),
                  "--threads", str(args.threads)]
        results: dict[tuple[str, int, str], list[dict]] = {}
        for round_index in range(args.rounds):
            for dtype in args.dtypes:
                for requests in args.requests:
                    tetrad = ["--folder", str(folders[dtype]), "--dtype", dtype]
                    sides = [("tetrad", sys.executable, tetrad)]
                    if not args.skip_eager:
                        sides.append(("tetrad eager", sys.executable, [*tetrad, "--eager"]))
                    if has_llamacpp:
                        sides.append(("llama.cpp", args.llamacpp_python,
                                      ["--gguf", str(ggufs[dtype])]))
                    for name, python, extra in sides[::1 if round_index % 2 == 0 else -1]:
                        result = child(python, ["--side", name.split()[0], *extra, *common,
                                                "--requests", str(requests)])
                        result["load"] = os.getloadavg()[0]
                        results.setdefault((dtype, requests, name), []).append(result)
                        print(f"round {round_index + 1} {dtype} x{requests} {name}: "
                              f"{result['decode_tok_s']:.1f} tokens/s, first token "
                              f"{1e3 * result['ttft_s']:.0f} ms, peak RSS "
                              f"{result['peak_rss_mb']:.0f} MB, load average "
                              f"{result['load']:.1f}", flush=True)
    report(results, args)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """Greedy tokens equal to llama.cpp's before each request's first difference, all requests."""
    same = sum(next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), len(ref))
               for mine, ref in zip(ours, theirs))
    return f"{same} of {sum(map(len, theirs))}"


def report(results: dict, args) -> None:
    print("| dtype | requests | side | decode tokens/s (median, all) | first token ms "
          "| peak RSS MB | greedy tokens equal to llama.cpp's | load averages |")
    print("|---|---:|---|---|---:|---:|---|---|")
    for dtype in args.dtypes:
        for requests in args.requests:
            theirs = results.get((dtype, requests, "llama.cpp"))
            for side in ("tetrad", "tetrad eager", "llama.cpp"):
                runs = results.get((dtype, requests, side))
                if not runs:
                    continue
                speed, ttft = (median([run[key] for run in runs])
                               for key in ("decode_tok_s", "ttft_s"))
                rss = max(run["peak_rss_mb"] for run in runs)
                speed_ratio = ttft_ratio = rss_ratio = ""
                agree = "-"
                if theirs and side != "llama.cpp":
                    speed_ratio = f" ({speed / median([r['decode_tok_s'] for r in theirs]):.2f}x)"
                    ttft_ratio = f" ({ttft / median([r['ttft_s'] for r in theirs]):.2f}x)"
                    rss_ratio = f" ({rss / max(r['peak_rss_mb'] for r in theirs):.2f}x)"
                    agree = agreement(runs[0]["tokens"], theirs[0]["tokens"])
                speeds = ", ".join(f"{run['decode_tok_s']:.1f}" for run in runs)
                loads = ", ".join(f"{run['load']:.1f}" for run in runs)
                print(f"| {dtype} | {requests} | {side} | {speed:.1f}{speed_ratio}, {speeds} | "
                      f"{1e3 * ttft:.0f}{ttft_ratio} | {rss:.0f}{rss_ratio} | {agree} | "
                      f"{loads} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="32m")
    parser.add_argument("--dtypes", nargs="+", default=list(GGUF_TYPES), choices=tuple(GGUF_TYPES))
    parser.add_argument("--requests", nargs="+", type=int, default=[1, 32],
                        help="requests decoded together, one row each")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", help="a folder to keep the model, its GGUF files and its "
                        "quantized folders in (under the shape's name) and reuse them from")
    parser.add_argument("--quantize-at-load", action="store_true",
                        help="tetrad's int8 / int4: --quantization on the 16-bit folder (GPTQ in "
                             "the measured process) instead of a folder stored quantized")
    parser.add_argument("--convert", help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--converter-path", action="append", default=[],
                        help="a folder the converter imports from (sentencepiece)")
    parser.add_argument("--llamacpp-python", help="a python that imports llama_cpp")
    parser.add_argument("--skip-eager", action="store_true",
                        help="leave out tetrad's eager forward (--enforce-eager) runs")
    parser.add_argument("--profile", action="store_true",
                        help="only profile tetrad's decode step, eager forward and fused")
    # A measurement's own process (what the parent runs).
    parser.add_argument("--side", choices=("tetrad", "llama.cpp"))
    parser.add_argument("--folder")
    parser.add_argument("--gguf")
    parser.add_argument("--dtype", default="fp32", choices=tuple(TETRAD_SETTINGS))
    parser.add_argument("--eager", action="store_true", help="tetrad: the model's own forward")
    parser.add_argument("--quantize-gguf", nargs=3, metavar=("SOURCE", "TARGET", "TYPE"))
    args = parser.parse_args()
    if args.quantize_gguf:
        quantize_gguf(*args.quantize_gguf)
    elif args.side:
        args.requests = args.requests[0]
        run = profile_tetrad if args.profile else run_tetrad
        print(json.dumps(run(args) if args.side == "tetrad" else run_llamacpp(args)))
    else:
        compare(args)


if __name__ == "__main__":
    main()
