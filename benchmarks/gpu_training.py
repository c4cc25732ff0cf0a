"""Training on one GPU: tetrad's training step in bf16 eager, bf16 compiled and FP8 compiled,
against transformers' LlamaForCausalLM on the same shape, one command.

    python benchmarks/gpu_training.py                  # one H100, under 8 minutes
    python benchmarks/gpu_training.py --device cpu --tiny    # a tiny scale, to check it runs

A ~1B Llama shape (TinyLlama's: hidden 2048, 22 layers, 32 heads / 4 KV heads, FFN 5632, vocab
32000, 1.1B parameters), random initialization, batch 8 x seq 2048 (16,384 tokens a step),
AdamW over fp32 master weights, global-norm clipping. Rows:

  tetrad-bf16-eager      `tetrad train --dtype bf16`: autocast bf16, eager PyTorch
  tetrad-bf16-compiled   `--compile` (TrainConfig.compile)
  tetrad-fp8-compiled    `--dtype fp8 --compile` (FP8 matmuls, DeepSeek-V3's 128x128 blocks)
  tetrad-fp8-tensor-compiled   `--dtype fp8 --fp8-recipe tensor --compile` (one scale per tensor)
  hf-bf16-eager          LlamaForCausalLM (attn_implementation="sdpa"), fp32 weights under bf16
                         autocast, torch's AdamW, the same clipping: the step HF's Trainer runs

Each row runs in a process of its own (a fresh allocator, no compile cache carried over; a row
that fails or times out is reported and the others go on). A row whose option this tetrad lacks
is skipped with a message. tetrad's rows go through `tetrad.train.trainer.train`, the code
`tetrad train` runs, so the row's run report supplies the measured step time (median after
--warmup steps), the CUDA allocator's peaks (`cuda_memory`), the bytes counted from the tensors,
and the planner's prediction of both for --gpu (the report's `predicted` block). The corpus is
seeded random words, short enough that no validation split is held out (no evaluation
pass after the timed steps).

MFU = model FLOPs per step / step time / the GPU's dense bf16 peak (tetrad.hardware.catalog; FP8 rows
too, so the rows compare). Model FLOPs per step: 6 N T for the N parameters that take part in
matmuls (all but the input embedding table, a lookup; the output head counts) over T tokens,
plus causal attention, 6 L s h T (the score and value matmuls over the lower triangle: half of
PaLM's 12 L s h T, appendix B).

Prints a markdown table last and writes every number as JSON (--out; default
$OUT/gpu_training.json where OUT is set, else runs/gpu_training.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tetrad.spec.model import DTYPES, ModelConfig, TrainConfig
from tetrad.hardware.catalog import gpu, gpu_from_device_name
from tetrad.models.transformer import Transformer
from tetrad.viz.report import device_bytes

SHAPES = {  # (hidden, layers, heads, kv heads, ffn, vocab)
    "1b": (2048, 22, 32, 4, 5632, 32000),
    "tiny": (128, 2, 4, 2, 344, 512),
}
ROWS = ("tetrad-bf16-eager", "tetrad-bf16-compiled", "tetrad-fp8-compiled",
        "tetrad-fp8-tensor-compiled", "hf-bf16-eager")
# row -> (--dtype, --compile, --fp8-recipe)
TETRAD_ROWS = {"tetrad-bf16-eager": ("bf16", False, "block"),
               "tetrad-bf16-compiled": ("bf16", True, "block"),
               "tetrad-fp8-compiled": ("fp8", True, "block"),
               "tetrad-fp8-tensor-compiled": ("fp8", True, "tensor")}
CORPUS_WINDOWS = 40  # under 50 windows, 2% of the corpus is less than one: no validation split


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny shape at batch 4 x seq 128 (default on cpu)")
    parser.add_argument("--batch", type=int, help="sequences per step (default 8; tiny 4)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 2048; tiny 128)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=int, help="timed steps (default 10; tiny 3)")
    parser.add_argument("--gpu", help="catalog GPU of the MFU peak and the planner's "
                                      "prediction (default: the one found, else h100)")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=ROWS)
    parser.add_argument("--row-timeout", type=float, default=150.0, help="seconds per row")
    parser.add_argument("--out", help="JSON of every number")
    parser.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # a child's one row
    parser.add_argument("--row-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.tiny = args.tiny or args.device == "cpu"
    args.batch = args.batch or (4 if args.tiny else 8)
    args.seq = args.seq or (128 if args.tiny else 2048)
    args.steps = args.steps or (3 if args.tiny else 10)
    if args.gpu is None:
        found = (gpu_from_device_name(torch.cuda.get_device_name())
                 if args.device == "cuda" and torch.cuda.is_available() else None)
        args.gpu = found.name if found else "h100"
    return args


def model_config(args) -> ModelConfig:
    hidden, layers, heads, kv_heads, ffn, vocab = SHAPES["tiny" if args.tiny else "1b"]
    return ModelConfig(name=f"llama-{'tiny' if args.tiny else '1b'}", vocab_size=vocab,
                       hidden_size=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, ffn_hidden_size=ffn, max_seq_len=args.seq)


def model_flops_per_step(config: ModelConfig, tokens: int, seq: int) -> tuple[float, int]:
    """(FLOPs of one training step as the docstring counts them, N in matmuls)."""
    with torch.device("meta"):
        model = Transformer(config)
    # The input embedding is a lookup, no matmul; tied, the same matrix is the output head's.
    lookup = 0 if config.tie_embeddings else model.embed.weight.numel()
    in_matmuls = sum(p.numel() for p in model.parameters()) - lookup
    attention = 6 * config.num_layers * seq * config.hidden_size * tokens
    return 6 * in_matmuls * tokens + attention, in_matmuls


def unsupported(row: str) -> str | None:
    """Why this tetrad cannot run `row`, or None."""
    if row not in TETRAD_ROWS:
        return None
    dtype, compiled, recipe = TETRAD_ROWS[row]
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if recipe != "block" and "fp8_recipe" not in fields:
        return "this tetrad's TrainConfig has no `fp8_recipe` option"
    if compiled and "compile" not in fields:
        return "this tetrad's TrainConfig has no `compile` option (issue 14.1 not merged)"
    if dtype not in DTYPES:
        return f"this tetrad has no --dtype {dtype} (issue 14.2 not merged)"
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_corpus(args, folder: Path) -> str:
    """Seeded random words (a step's time does not depend on the text): enough windows to
    train on, too few to hold any out for validation."""
    import random

    rng = random.Random(0)
    words, size = [], 0
    while size < CORPUS_WINDOWS * (args.seq + 1):
        words.append("".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(1, 9))))
        size += len(words[-1]) + 1
    path = folder / "corpus.txt"
    path.write_text(" ".join(words)[:CORPUS_WINDOWS * (args.seq + 1)])
    return str(path)


def run_tetrad(args, row: str, device: torch.device) -> dict:
    from tetrad.train.trainer import train

    dtype, compiled, recipe = TETRAD_ROWS[row]
    config = model_config(args)
    shape = {key: value for key, value in config.to_dict().items()
             if key in ("name", "vocab_size", "hidden_size", "num_layers", "num_heads",
                        "num_kv_heads", "ffn_hidden_size", "max_seq_len")}
    with tempfile.TemporaryDirectory() as folder:
        settings = dict(model="tiny", model_overrides=shape, data=write_corpus(args, Path(folder)),
                        steps=args.warmup + args.steps, batch_size=args.batch, seq_len=args.seq,
                        lr=3e-4, warmup_steps=1, dtype=dtype, device=device.type,
                        hardware=args.gpu if device.type == "cuda" else "", sample_tokens=0)
        if compiled:
            settings["compile"] = True
        if recipe != "block":
            settings["fp8_recipe"] = recipe
        report = train(TrainConfig(**settings), show_progress=False).report
    rank, predicted = report["ranks"][0], report["predicted"]
    step_time = predicted.get("step_time_s")
    return {"step_s": statistics.median(s["time_s"] for s in report["steps"][args.warmup:]),
            "losses": [s["loss"] for s in report["steps"]],
            "cuda_memory": rank["cuda_memory"], "counted_bytes": device_bytes(rank["bytes"]),
            "predicted_bytes": device_bytes(predicted["bytes"]) if "bytes" in predicted else None,
            "predicted_step_s": step_time.get("total") if isinstance(step_time, dict) else None,
            "predicted_hardware": predicted.get("hardware")}


def run_hf(args, device: torch.device) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tetrad.spec.hf import hf_from_model_config

    config = model_config(args)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**hf_from_model_config(config),
                                             attn_implementation="sdpa"))
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": [p for p in model.parameters() if p.dim() < 2],
                                    "weight_decay": 0.0}], lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    generator = torch.Generator().manual_seed(0)
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        batch = torch.randint(config.vocab_size, (args.batch, args.seq + 1),
                              generator=generator).to(device)
        synchronize(device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        synchronize(device)
        times.append(time.perf_counter() - started)
    cuda_memory = None
    if device.type == "cuda":
        cuda_memory = {"allocated_peak": torch.cuda.max_memory_allocated(device),
                       "reserved_peak": torch.cuda.max_memory_reserved(device)}
    return {"step_s": statistics.median(times[args.warmup:]), "losses": losses,
            "cuda_memory": cuda_memory}


def run_row(args) -> None:
    """In a child process: one row, its numbers as JSON into --row-out."""
    device = torch.device(args.device)
    if args.row == "hf-bf16-eager":
        result = run_hf(args, device)
    else:
        result = run_tetrad(args, args.row, device)
    Path(args.row_out).write_text(json.dumps(result))


def run_in_child(args, row: str, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "row.json"
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS":
               os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "1" if args.tiny else "16")}
        started = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, __file__, *argv, "--row", row,
                                   "--row-out", str(out)], env=env, capture_output=True,
                                  text=True, timeout=args.row_timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.row_timeout:.0f} s"}
        wall = time.perf_counter() - started
        if done.returncode != 0 or not out.is_file():
            lines = (done.stderr or done.stdout).strip().splitlines()
            # The traceback's tail travels in the JSON: a GPU session reads it after the machine
            # is gone.
            return {"error": lines[-1] if lines else f"exit status {done.returncode}",
                    "log_tail": lines[-40:]}
        return {**json.loads(out.read_text()), "wall_s": wall}


def add_rates(result: dict, flops: float, tokens: int, peak: float | None) -> None:
    """tokens/s, and MFU against `peak` (None on the CPU: a GPU's peak would mean nothing)."""
    if "step_s" in result:
        result["tokens_per_s"] = tokens / result["step_s"]
        result["mfu"] = None if peak is None else flops / result["step_s"] / peak


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def table(results: dict, args) -> list[str]:
    lines = ["| row | step s | tokens/s | MFU | CUDA allocated peak GiB | reserved peak GiB | "
             "counted GiB | predicted GiB | predicted step s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row, result in results.items():
        if "step_s" not in result:
            lines.append(f"| {row} | {result.get('skipped') or result.get('error')} "
                         f"| | | | | | | |")
            continue
        cuda = result.get("cuda_memory") or {}
        predicted_step = result.get("predicted_step_s")
        lines.append(
            f"| {row} | {result['step_s']:.4f} | {result['tokens_per_s']:,.0f} | "
            f"{percent(result['mfu'])} | {gib(cuda.get('allocated_peak'))} | "
            f"{gib(cuda.get('reserved_peak'))} | {gib(result.get('counted_bytes'))} | "
            f"{gib(result.get('predicted_bytes'))} | "
            f"{'-' if predicted_step is None else f'{predicted_step:.4f}'} |")
    return lines


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.row:
        return run_row(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --tiny to check the script")
    config = model_config(args)
    tokens = args.batch * args.seq
    flops, in_matmuls = model_flops_per_step(config, tokens, args.seq)
    peak = gpu(args.gpu).peak("bf16") if args.device == "cuda" else None
    device_name = (torch.cuda.get_device_name() if args.device == "cuda"
                   else f"cpu ({os.cpu_count()} cores)")
    print(f"{config.name}: {in_matmuls / 1e6:,.1f}M parameters in matmuls, batch {args.batch} x "
          f"seq {args.seq}, {args.warmup} warm-up + {args.steps} timed steps on {device_name}; "
          f"{flops / 1e12:.4g} TFLOP a step; MFU against "
          + (f"{args.gpu} bf16 dense {peak / 1e12:.0f} TFLOP/s" if peak else "none on the CPU"),
          flush=True)
    results = {}
    for row in args.rows:
        reason = unsupported(row)
        results[row] = {"skipped": reason} if reason else run_in_child(args, row, argv)
        add_rates(results[row], flops, tokens, peak)
        print(f"{row}: " + (f"{results[row]['step_s']:.4f} s a step, MFU "
                            f"{percent(results[row]['mfu'])}" if "step_s" in results[row]
                            else results[row].get("skipped") or results[row]["error"]),
              flush=True)
    goals = {}
    bf16 = results.get("tetrad-bf16-compiled", {})
    if bf16.get("mfu") is not None:
        goals["bf16_compiled_mfu"] = bf16["mfu"]
    for recipe, row in (("block", "tetrad-fp8-compiled"), ("tensor", "tetrad-fp8-tensor-compiled")):
        if "tokens_per_s" in bf16 and "tokens_per_s" in results.get(row, {}):
            goals[f"fp8_{recipe}_over_bf16_tokens_per_s"] = (results[row]["tokens_per_s"]
                                                            / bf16["tokens_per_s"])
    out = Path(args.out or Path(os.environ.get("OUT") or "runs") / "gpu_training.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device_name, "gpu_for_peak": args.gpu,
                               "model": config.to_dict(), "batch": args.batch, "seq": args.seq,
                               "warmup": args.warmup, "steps": args.steps,
                               "flops_per_step": flops, "params_in_matmuls": in_matmuls,
                               "peak_flops": peak, "rows": results, "goals": goals}, indent=2))
    print()
    print("\n".join(table(results, args)))
    if goals:
        print("\ngoals: " + ", ".join(
            f"bf16 compiled MFU {value:.1%} (goal >= 50%)" if key == "bf16_compiled_mfu"
            else f"FP8 ({key.split('_')[1]} recipe) / bf16 compiled tokens/s {value:.2f}x "
                 f"(goal >= 1.3x)"
            for key, value in goals.items()))
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
