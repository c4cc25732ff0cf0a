"""One training step (forward, backward, gradient clipping, AdamW) of tetrad's Transformer against
transformers' LlamaForCausalLM of the same shape and the same weights, on the same batch, in one
process.

    .venv/bin/python benchmarks/bench_vs_hf.py [--steps 5] [--threads 2] [--compile] [--profile 15]
                                               [--dtype fp32|bf16]

The two models alternate step by step, so that load from other processes on a shared machine
hits both alike; the median of --steps timed steps follows --warmup untimed ones. Next to wall
time it prints process CPU time (user + system, all threads), which other processes' load barely
moves: on a busy machine, compare those. Before timing, the first losses are checked to agree,
which shows that both models compute the same thing.

Each side takes its own library's training step. tetrad's is the trainer's: the single-process
strategy `tetrad train` builds (tetrad.train.strategy.build_strategy: its loss, gradient
clipping and optimizer). transformers' is what its Trainer does by default: cross-entropy on the
logits, `clip_grad_norm_` to 1.0 and `torch.optim.AdamW(fused=True)` ("adamw_torch_fused", the
default optim with torch >= 2.8). Both use the same learning rate, betas, eps and weight decay.

With --dtype bf16 both sides train in bf16 mixed precision over fp32 parameters, each its own
library's way: tetrad's trainer under `--dtype bf16` (torch.autocast), transformers as its
Trainer does with `bf16=True` (torch.autocast around the forward; its causal-LM loss upcasts the
logits to fp32 first, as here). bf16 rounds the two models' different operation orders apart, so
their first losses are checked to agree within BF16_LOSS_TOLERANCE instead of FP32_LOSS_TOLERANCE.

With --compile tetrad's blocks are compiled (`tetrad train --compile`, tetrad.parallel.compile)
and transformers' model stays eager; the compiling happens in the first warm-up step, and its
time is printed apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tetrad.spec.model import ModelConfig, TrainConfig
from tetrad.spec.hf import hf_from_model_config
from tetrad.models.hf import to_hf_state_dict
from tetrad.models.transformer import Transformer
from tetrad.parallel.compile import CompileClock
from tetrad.train.optim import parameter_groups
from tetrad.train.strategy import build_strategy

LR = 1e-4
FP32_LOSS_TOLERANCE = 1e-4
# bf16: measured 1.0e-4 apart eager (2026-11-26 22:32 UTC); a wrong model misses by far more.
BF16_LOSS_TOLERANCE = 2e-3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1376)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="both sides in fp32, or both in bf16 mixed precision (autocast)")
    parser.add_argument("--compile", action="store_true",
                        help="compile tetrad's transformer blocks (transformers stays eager)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, profile one more step of each side (torch.profiler) "
                             "and print its N operators with the most CPU time")
    return parser.parse_args()


def tetrad_step(strategy, config: TrainConfig, tokens: torch.Tensor) -> float:
    """The trainer's step (tetrad.train.trainer.train) at a fixed learning rate."""
    loss, _ = strategy.forward_backward(tokens)
    strategy.finish_gradients()
    strategy.clip_grad_norm(config.grad_clip)
    strategy.step(LR)
    return loss


def transformers_step(model, optimizer, config: TrainConfig, tokens: torch.Tensor) -> float:
    """transformers' Trainer step: loss from the logits (upcast to fp32, as its causal-LM loss
    does), backward, clip, step, zero; under bf16 the forward in autocast, as `bf16=True`."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.dtype == "bf16"):
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    args = parse_args()
    if args.compile and args.warmup < 1:
        raise SystemExit("--compile needs --warmup 1 or more: the first step compiles")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ModelConfig(name="bench", vocab_size=args.vocab, hidden_size=args.hidden,
                         num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                         ffn_hidden_size=args.ffn, max_seq_len=args.seq)
    tetrad_model = Transformer(config).train()
    hf_model = LlamaForCausalLM(LlamaConfig(**hf_from_model_config(config), attention_dropout=0.0,
                                            attn_implementation="sdpa")).train()
    hf_model.load_state_dict(to_hf_state_dict(tetrad_model), strict=True)
    clock = CompileClock() if args.compile else None
    config = TrainConfig(batch_size=args.batch, seq_len=args.seq, lr=LR, compile=args.compile,
                         dtype=args.dtype)
    strategy = build_strategy(tetrad_model, config, torch.device("cpu"))
    # Weight decay on matrices only, as tetrad's and transformers' Trainer both group it.
    hf_optimizer = torch.optim.AdamW(parameter_groups(hf_model, config.weight_decay), lr=LR,
                                     betas=(config.beta1, config.beta2), eps=1e-8, fused=True)

    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    runs = {"tetrad": lambda: tetrad_step(strategy, config, tokens),
            "transformers": lambda: transformers_step(hf_model, hf_optimizer, config, tokens)}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.warmup + args.steps):
        for name, run_step in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            losses[name].append(run_step())
            if step >= args.warmup:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)

    first = {name: values[0] for name, values in losses.items()}
    tolerance = BF16_LOSS_TOLERANCE if args.dtype == "bf16" else FP32_LOSS_TOLERANCE
    assert abs(first["tetrad"] - first["transformers"]) < tolerance, f"models differ: {first}"
    print(f"shape: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / "
          f"{args.kv_heads} kv, ffn {args.ffn}, vocab {args.vocab}, batch {args.batch} x seq "
          f"{args.seq}, {args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"first-step loss: tetrad {first['tetrad']:.6f}, "
          f"transformers {first['transformers']:.6f}")
    if clock is not None:
        print(f"tetrad compiled ({clock.seconds:.1f} s of compiling in the warm-up steps)")
    median = {name: statistics.median(values) for name, values in wall.items()}
    median_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    for name, values in wall.items():
        print(f"{name:>12}: median {median[name] * 1e3:8.1f} ms/step wall (min "
              f"{min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f}, n={len(values)}), "
              f"{median_cpu[name] * 1e3:8.1f} ms/step CPU")
    print(f"ratio tetrad / transformers: {median['tetrad'] / median['transformers']:.3f} wall, "
          f"{median_cpu['tetrad'] / median_cpu['transformers']:.3f} CPU; tokens/s tetrad / "
          f"transformers: {median['transformers'] / median['tetrad']:.3f} wall, "
          f"{median_cpu['transformers'] / median_cpu['tetrad']:.3f} CPU")
    for name, run_step in runs.items() if args.profile else ():
        print_profile(name, run_step, args.profile)


def print_profile(name: str, run_step, rows: int) -> None:
    """One step under torch.profiler: each operator's share of the step's CPU time (inductor's
    generated kernels are one "CompiledFxGraph" call per block and direction, matmuls and SDPA
    apart)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step()
    events = sorted(prof.key_averages(), key=lambda event: -event.self_cpu_time_total)
    total = sum(event.self_cpu_time_total for event in events)
    print(f"{name}: {total / 1e3:.1f} ms of CPU time in one profiled step")
    for event in events[:rows]:
        print(f"  {100 * event.self_cpu_time_total / total:5.1f}%  {event.count:4d} calls  "
              f"{event.key[:70]}")


if __name__ == "__main__":
    main()
