"""Tensor-parallel step time: tetrad's TP against torch's DTensor TP on the same model.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--tp 2] [--steps 6] [--threads 1]

Each rank builds the same Transformer twice: once split by tetrad.parallel.tensor_parallel, once
by DTensor's parallelize_module (ColwiseParallel on qkv / up / the head, RowwiseParallel on out /
down / the embedding, SequenceParallel on the norms with --sequence-parallel, loss_parallel for the
loss). DTensor splits a weight's rows evenly, so the fused qkv and gate/up rows are first laid out
rank by rank in tetrad's order and attention gets the local head counts, as torchtitan does. A
step is one forward, loss and backward of the batch (no optimizer: both would run the same
AdamW); the two alternate step by step so that load from other processes hits both alike, each
timed between two barriers; the median of --steps timed steps follows --warmup untimed ones.
Before timing, the first losses are checked to agree. Both modes run: without and with sequence
parallelism. Ranks are gloo processes with --threads threads each (NCCL, one GPU per rank, when
there are enough GPUs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tetrad.spec.model import ModelConfig, ParallelConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm
from tetrad.parallel.launch import spawn
from tetrad.parallel.mesh import build_mesh
from tetrad.parallel.tensor_parallel import apply_tensor_parallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from peers import dtensor_tensor_parallel  # noqa: E402
from timing import timed  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    return parser.parse_args()


def dtensor_model(config: ModelConfig, tp: int, sequence_parallel: bool, device: torch.device
                  ) -> nn.Module:
    torch.manual_seed(0)
    return dtensor_tensor_parallel(Transformer(config).to(device), config, tp, sequence_parallel,
                                   device.type)


def bench_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    from torch.distributed.tensor.parallel import loss_parallel

    torch.set_num_threads(args.threads)
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    config = ModelConfig(name="bench", vocab_size=args.vocab, hidden_size=args.hidden,
                         num_layers=args.layers, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, ffn_hidden_size=args.ffn,
                         max_seq_len=args.seq)
    mesh = build_mesh(ParallelConfig(tp=world_size), rank, world_size)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    results = {}
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        tetrad = Transformer(config).to(device)
        split = apply_tensor_parallel(tetrad, mesh, Comm(), sequence_parallel, args.seq)
        reference = dtensor_model(config, world_size, sequence_parallel, device)

        def tetrad_step() -> float:
            loss = split.loss(tetrad(inputs), targets)
            loss.backward()
            # What the data-parallel engine does before reducing (here: the only bucket).
            split.sum_partial_gradients({id(p): p.grad for p in tetrad.parameters()})
            return loss.item()

        def dtensor_step() -> float:
            with loss_parallel():
                loss = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
                loss.backward()
            return loss.full_tensor().item()

        times: dict[str, list[float]] = {"tetrad": [], "dtensor": []}
        for step in range(args.warmup + args.steps):
            seconds, loss = timed(tetrad_step)
            tetrad.zero_grad(set_to_none=True)
            dtensor_seconds, dtensor_loss = timed(dtensor_step)
            reference.zero_grad(set_to_none=True)
            if step == 0 and abs(loss - dtensor_loss) > 1e-4 * abs(loss):
                raise AssertionError(f"losses differ: tetrad {loss} vs DTensor {dtensor_loss}")
            if step >= args.warmup:
                times["tetrad"].append(seconds)
                times["dtensor"].append(dtensor_seconds)
        results[sequence_parallel] = {name: statistics.median(t) for name, t in times.items()}
    return results


def main() -> None:
    args = parse_args()
    per_rank = spawn(bench_rank, args.tp, (args,), timeout_s=3600, collective_timeout_s=600)
    tokens = args.batch * args.seq
    print(f"tp={args.tp} batch={args.batch}x{args.seq} hidden={args.hidden} "
          f"layers={args.layers} heads={args.heads}/{args.kv_heads} ffn={args.ffn} "
          f"vocab={args.vocab} threads/rank={args.threads}; forward+loss+backward per step, "
          f"median of {args.steps}")
    print(f"{'mode':<6}{'tetrad s':>10}{'DTensor s':>11}{'tetrad/DTensor':>16}{'tok/s tetrad':>14}")
    for sequence_parallel in (False, True):
        tetrad = max(r[sequence_parallel]["tetrad"] for r in per_rank)
        dtensor = max(r[sequence_parallel]["dtensor"] for r in per_rank)
        mode = "TP+SP" if sequence_parallel else "TP"
        print(f"{mode:<6}{tetrad:>10.3f}{dtensor:>11.3f}{tetrad / dtensor:>16.2f}"
              f"{tokens / tetrad:>14,.0f}")


if __name__ == "__main__":
    main()
