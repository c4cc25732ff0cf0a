"""Step time of tetrad's DDP and ZeRO-3 against torch's DistributedDataParallel and FSDP2
(fully_shard), on the same model, the same batches and the same ranks, as ratios.

    .venv/bin/python benchmarks/bench_data_parallel.py [--nproc 2] [--model small] [--steps 8]

Every rank builds all four at once and they alternate step by step, so that load from other
processes on a shared machine hits them alike. A step (forward, backward, gradient sync, clip,
AdamW) is timed between barriers; the median over --steps timed steps follows --warmup untimed
ones. Next to wall time it prints the rank's CPU time (user + system), which other processes'
load barely moves. Before timing, the first step's losses are checked to agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.launch import spawn
from tetrad.parallel.mesh import build_mesh
from tetrad.spec.presets import resolve_model
from tetrad.train.optim import build_optimizer, parameter_groups, set_learning_rate
from tetrad.train.strategy import MeshStrategy

ENGINES = ("tetrad DDP", "torch DDP", "tetrad ZeRO-3", "torch FSDP2")
BASELINE = {"tetrad DDP": "torch DDP", "tetrad ZeRO-3": "torch FSDP2"}


class TorchNative:
    """torch's DDP or FSDP2 behind the few strategy methods a step uses."""

    def __init__(self, model: torch.nn.Module, config: TrainConfig, kind: str):
        if kind == "torch DDP":
            self.model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard
            for layer in model.layers:
                fully_shard(layer)
            self.model = fully_shard(model)
        self.optimizer = build_optimizer(parameter_groups(model, config.weight_decay), config)

    def step(self, batch: torch.Tensor, lr: float) -> float:
        loss = F.cross_entropy(self.model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        set_learning_rate(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()


class Tetrad:
    def __init__(self, model: torch.nn.Module, config: TrainConfig, mesh, zero: int):
        config = dataclasses.replace(config, parallel=ParallelConfig(dp=mesh.dims.dp, zero=zero))
        self.strategy = MeshStrategy(model, config, torch.device("cpu"), mesh, Comm(CommCounter()))

    def step(self, batch: torch.Tensor, lr: float) -> float:
        strategy = self.strategy
        loss = F.cross_entropy(strategy.model(batch[:, :-1]).flatten(0, 1),
                               batch[:, 1:].flatten())
        strategy.backward(loss, is_last_microbatch=True)
        strategy.finish_gradients()
        strategy.clip_grad_norm(1.0)
        strategy.step(lr)
        return loss.item()


def worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    mesh = build_mesh(ParallelConfig(dp=world_size), rank, world_size)
    config = TrainConfig(model=args.model, batch_size=args.batch, seq_len=args.seq)
    model_config = resolve_model(args.model)

    def fresh_model() -> Transformer:
        torch.manual_seed(0)
        return Transformer(model_config)

    engines = {"tetrad DDP": Tetrad(fresh_model(), config, mesh, 0),
               "torch DDP": TorchNative(fresh_model(), config, "torch DDP"),
               "tetrad ZeRO-3": Tetrad(fresh_model(), config, mesh, 3),
               "torch FSDP2": TorchNative(fresh_model(), config, "torch FSDP2")}
    generator = torch.Generator().manual_seed(1)
    rows = args.batch // world_size
    return interleaved_steps(
        args, lambda: torch.randint(0, model_config.vocab_size, (args.batch, args.seq + 1),
                                    generator=generator)[rank * rows:(rank + 1) * rows],
        {name: (lambda batch, engine=engine: engine.step(batch, 1e-3))
         for name, engine in engines.items()})


def interleaved_steps(args: argparse.Namespace, next_batch, sides: dict) -> dict:
    """Each side's step on the same batches, sides interleaved step by step between barriers (a
    shared machine's load then falls on all alike): median wall and CPU seconds after --warmup
    steps, and each side's first loss. Shared with bench_compile.py."""
    wall = {name: [] for name in sides}
    cpu = {name: [] for name in sides}
    first_losses = {}
    for step in range(args.warmup + args.steps):
        batch = next_batch()
        for name, run_step in sides.items():
            dist.barrier()
            started, started_cpu = time.perf_counter(), time.process_time()
            loss = run_step(batch)
            dist.barrier()
            if step == 0:
                first_losses[name] = loss
            if step >= args.warmup:
                wall[name].append(time.perf_counter() - started)
                cpu[name].append(time.process_time() - started_cpu)
    return {"wall": {k: statistics.median(v) for k, v in wall.items()},
            "cpu": {k: statistics.median(v) for k, v in cpu.items()}, "losses": first_losses}


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The run's shape, shared with bench_compile.py: ranks, model, batch, steps, threads."""
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_flags(parser)
    args = parser.parse_args()
    results = spawn(worker, args.nproc, (args,))
    losses = results[0]["losses"]
    assert max(losses.values()) - min(losses.values()) < 1e-4, losses
    print(f"{args.model}, {args.nproc} ranks x {args.threads} thread(s), global batch "
          f"{args.batch} x {args.seq} tokens, median of {args.steps} steps (slowest rank)")
    print(f"{'engine':<15}{'wall ms':>10}{'cpu ms':>10}{'wall ratio':>12}{'cpu ratio':>11}")
    wall = {name: max(r["wall"][name] for r in results) for name in ENGINES}
    cpu = {name: max(r["cpu"][name] for r in results) for name in ENGINES}
    for name in ENGINES:
        base = BASELINE.get(name)
        ratios = (f"{wall[name] / wall[base]:>12.2f}{cpu[name] / cpu[base]:>11.2f}" if base
                  else f"{'(baseline)':>12}{'':>11}")
        print(f"{name:<15}{wall[name] * 1e3:>10.1f}{cpu[name] * 1e3:>10.1f}{ratios}")


if __name__ == "__main__":
    main()
