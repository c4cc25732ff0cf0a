"""Step time of tetrad training with its blocks compiled (`--compile`) against the same layout
eager, under data, tensor and pipeline parallelism, as ratios.

    .venv/bin/python benchmarks/bench_compile.py [--nproc 2] [--model small] [--steps 8]

For each layout every rank builds the eager and the compiled strategy at once, and they alternate
step by step, so that load from other processes on a shared machine hits both alike. A step
(forward, backward, gradient reduction, clip, AdamW: the trainer's calls) is timed between
barriers; the median over --steps timed steps follows --warmup untimed ones, the first of which
compiles (its compile time is printed apart). Next to wall time it prints the rank's CPU time
(user + system). Before timing, the first step's losses are checked to agree.
"""

from __future__ import annotations

import argparse

import torch

from bench_data_parallel import add_run_flags, interleaved_steps

from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.compile import CompileClock
from tetrad.parallel.launch import spawn
from tetrad.parallel.mesh import build_mesh
from tetrad.planner.rules import resolve_layout
from tetrad.spec.presets import resolve_model
from tetrad.train.strategy import MeshStrategy

LAYOUTS = {"DDP dp2": dict(dp=2), "TP tp2": dict(tp=2),
           "pipeline pp2 1f1b": dict(pp=2, schedule="1f1b", microbatches=4)}


def step(strategy: MeshStrategy, batch: torch.Tensor) -> float:
    loss, _ = strategy.forward_backward(batch)
    strategy.finish_gradients()
    strategy.clip_grad_norm(1.0)
    strategy.step(1e-3)
    return loss


def time_layout(rank: int, world_size: int, args: argparse.Namespace, layout: dict) -> dict:
    model_config = resolve_model(args.model)
    parallel = resolve_layout(model_config, ParallelConfig(**layout), args.seq).parallel
    mesh = build_mesh(parallel, rank, world_size)
    strategies = {}
    for compiled in (False, True):
        config = TrainConfig(model=args.model, batch_size=args.batch, seq_len=args.seq,
                             parallel=parallel, compile=compiled)
        torch.manual_seed(0)
        strategies["compiled" if compiled else "eager"] = MeshStrategy(
            Transformer(model_config), config, torch.device("cpu"), mesh, Comm(CommCounter()))
    generator = torch.Generator().manual_seed(1)
    clock = CompileClock()
    timings = interleaved_steps(
        args, lambda: torch.randint(0, model_config.vocab_size, (args.batch, args.seq + 1),
                                    generator=generator),
        {name: (lambda batch, strategy=strategy: step(strategy, batch))
         for name, strategy in strategies.items()})
    clock.close()
    return {**timings, "compile_s": clock.seconds}


def worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    return {name: time_layout(rank, world_size, args, layout)
            for name, layout in LAYOUTS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_flags(parser)
    args = parser.parse_args()
    if args.nproc != 2:
        raise SystemExit("the layouts are for 2 ranks: --nproc 2")
    # A rank waits in a collective while another compiles: a long timeout.
    results = spawn(worker, args.nproc, (args,), timeout_s=3600, collective_timeout_s=1800)
    print(f"{args.model}, {args.nproc} ranks x {args.threads} thread(s), global batch "
          f"{args.batch} x {args.seq} tokens, fp32, median of {args.steps} steps (slowest rank)")
    print(f"{'layout':<20}{'eager ms':>10}{'compiled ms':>13}{'wall ratio':>12}{'cpu ratio':>11}"
          f"{'compile s':>11}")
    for name in LAYOUTS:
        per_rank = [r[name] for r in results]
        losses = per_rank[0]["losses"]
        assert abs(losses["eager"] - losses["compiled"]) < 1e-4, (name, losses)
        wall = {k: max(r["wall"][k] for r in per_rank) for k in ("eager", "compiled")}
        cpu = {k: max(r["cpu"][k] for r in per_rank) for k in ("eager", "compiled")}
        compile_s = max(r["compile_s"] for r in per_rank)
        print(f"{name:<20}{wall['eager'] * 1e3:>10.1f}{wall['compiled'] * 1e3:>13.1f}"
              f"{wall['compiled'] / wall['eager']:>12.2f}{cpu['compiled'] / cpu['eager']:>11.2f}"
              f"{compile_s:>11.1f}")


if __name__ == "__main__":
    main()
