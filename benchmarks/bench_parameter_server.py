"""Parameter server (sync, S servers) against ring all-reduce DDP (--zero 0 --collectives ring)
as the workers grow: step time and the bytes on the busiest link, measured next to the
planner's prediction (tetrad/planner/parameter_server.py).

    .venv/bin/python benchmarks/bench_parameter_server.py [--workers 2 3 4] [--model small]

Per layout one spawn; every worker runs the same steps on the same batches, and the first
step's losses must agree between the two strategies (sync PS is data-parallel SGD). Step time is
the median over --steps timed steps after --warmup, slowest worker. "compute" is the same
forward, backward and AdamW on the worker's slice with no communication, timed on the same
ranks at the same time (so under the same load); "comm" is step minus compute. Bytes are per
step from the byte counters: a worker's link carries what it sends plus what it receives, a
server's likewise, a ring rank sends and receives 2(W-1)/W of the gradient. The planner's times
use the loopback link measured first (ping-pong between two ranks): on one machine every
"link" is memory copies on shared cores, so read the times for their trend, the bytes exactly.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tetrad.calibrate.collectives import ping_pong
from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.launch import spawn
from tetrad.parallel.mesh import Group, build_mesh
from tetrad.parallel.ps import KeyLayout, ParameterServer, PSOptions
from tetrad.planner.parameter_server import compare
from tetrad.spec.presets import resolve_model
from tetrad.train.optim import build_optimizer, parameter_groups
from tetrad.train.ps_strategy import ParameterServerStrategy
from tetrad.train.strategy import MeshStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from reference import whole_gradient_step  # noqa: E402

LR = 1e-3
MB = 1e6


def fresh_model(args: argparse.Namespace) -> Transformer:
    torch.manual_seed(0)
    return Transformer(resolve_model(args.model))


def batches(args: argparse.Namespace) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    vocab = resolve_model(args.model).vocab_size
    return [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=generator)
            for _ in range(args.warmup + args.steps)]


def run_steps(strategy, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """The trainer's step, timed: (losses, seconds per step)."""
    losses, times = [], []
    for batch in batches(args):
        started = time.perf_counter()
        local = strategy.local_batch(batch)
        loss = F.cross_entropy(strategy.model(local[:, :-1]).flatten(0, 1),
                               local[:, 1:].flatten())
        strategy.backward(loss, is_last_microbatch=True)
        mean = strategy.global_mean(loss.item())
        strategy.finish_gradients()
        strategy.clip_grad_norm(1.0)
        strategy.step(LR)
        times.append(time.perf_counter() - started)
        losses.append(mean)
    return losses, times[args.warmup:]


def compute_only(args: argparse.Namespace, rows: int, rank: int) -> float:
    """Median seconds of forward, backward, clip and AdamW on this worker's slice, alone."""
    model = fresh_model(args)
    optimizer = build_optimizer(parameter_groups(model, 0.1), TrainConfig())
    times = []
    for batch in batches(args):
        local = batch[rank * rows:(rank + 1) * rows]
        started = time.perf_counter()
        whole_gradient_step(model, optimizer, local, LR)
        times.append(time.perf_counter() - started)
    return statistics.median(times[args.warmup:])


def link_rank(rank: int, world_size: int, size: int) -> tuple[float, float]:
    """Loopback bandwidth (bytes/s one way) and latency (s) between two ranks: ping-pong."""
    def round_trips(tensor: torch.Tensor, count: int) -> float:
        dist.barrier()
        started = time.perf_counter()
        for _ in range(count):
            ping_pong(rank, tensor)
        return (time.perf_counter() - started) / count / 2

    latency = round_trips(torch.zeros(1), 200)
    one_way = round_trips(torch.zeros(size // 4), 10)
    return size / max(one_way - latency, 1e-9), latency


def ring_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    mesh = build_mesh(ParallelConfig(dp=world_size), rank, world_size)
    compute_s = compute_only(args, args.batch // world_size, rank)
    config = TrainConfig(model=args.model, batch_size=args.batch, seq_len=args.seq,
                         parallel=ParallelConfig(dp=world_size, collectives=args.collectives))
    counter = CommCounter()
    strategy = MeshStrategy(fresh_model(args), config, torch.device("cpu"), mesh,
                                    Comm(counter, args.collectives))
    counter.reset()  # the initial broadcast is setup, not a step
    losses, times = run_steps(strategy, args)
    sent = counter.totals(("grads",))["all_reduce"] / counter.steps
    return {"losses": losses, "step_s": statistics.median(times), "compute_s": compute_s,
            "link": {"out": float(sent), "in": float(sent)}}


def ps_rank(rank: int, world_size: int, args: argparse.Namespace, num_servers: int) -> dict:
    world = Group("world", tuple(range(world_size)), rank, dist.group.WORLD)
    options = PSOptions(num_servers=num_servers)
    roles = options.roles(world_size)
    comm = Comm(CommCounter())
    config = TrainConfig(model=args.model, batch_size=args.batch, seq_len=args.seq)
    if roles.is_server(rank):
        model = fresh_model(args)
        server = ParameterServer(model, parameter_groups(model, config.weight_decay), world,
                                 comm, options, (config.beta1, config.beta2))
        entry = server.serve()["entry"]
        return {"role": "server", "sent": entry["parameter_server"]["sent_per_step"],
                "received": entry["parameter_server"]["received_per_step"]}
    compute_s = compute_only(args, args.batch // roles.num_workers, rank)
    strategy = ParameterServerStrategy(fresh_model(args), config, torch.device("cpu"), world,
                                     comm, options)
    losses, times = run_steps(strategy, args)
    layout = KeyLayout.from_model(strategy.model, num_servers)
    entry = strategy.gather({"rank": rank})[rank]["parameter_server"]
    return {"role": "worker", "losses": losses, "step_s": statistics.median(times),
            "compute_s": compute_s, "sent": entry["pushed_per_step"],
            "received": entry["pulled_per_step"], "dense_bytes": 4 * layout.dense_numel,
            "row_bytes": 4 * layout.row_numel, "table_bytes": 4 * layout.num_rows
            * layout.row_numel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=12, help="global batch, in sequences")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--collectives", choices=("ring", "backend"), default="ring",
                        help="the all-reduce: tetrad's ring on send/recv, or gloo's own")
    args = parser.parse_args()

    probe = fresh_model(args)
    bandwidth, latency = spawn(link_rank, 2, (sum(p.numel() for p in probe.parameters()) * 4,))[0]
    print(f"{args.model}, global batch {args.batch} x {args.seq} tokens, median of "
          f"{args.steps} steps (slowest worker); loopback link {bandwidth / 1e9:.2f} GB/s, "
          f"latency {latency * 1e6:.0f} us")
    header = (f"{'W':>2}{'S':>3}  {'strategy':<10}{'step ms':>9}{'compute':>9}{'comm':>8}"
              f"{'pred comm':>11}{'busiest link MB/step':>22}{'predicted':>11}")
    print(header)
    for workers in args.workers:
        ring = spawn(ring_rank, workers, (args,))
        for servers in [1, 2] if workers >= 4 else [1]:
            ps = spawn(ps_rank, workers + servers, (args, servers))
            ps_workers = [r for r in ps if r["role"] == "worker"]
            first = ps_workers[0]
            for result in ps_workers[1:] + ring:  # sync PS is --zero 0's SGD, step for step
                for loss, expected in zip(result["losses"], first["losses"]):
                    assert abs(loss - expected) <= 1e-5 * abs(expected), (loss, expected)
            rows = statistics.mean(w["sent"].get("grad_rows", 0) / first["row_bytes"]
                                   for w in ps_workers)
            predicted = compare(workers, servers, first["dense_bytes"], bandwidth, latency,
                                table_bytes=first["table_bytes"], touched_rows=rows,
                                row_bytes=first["row_bytes"])

            def link(result: dict) -> float:
                data = ("control",)  # headers are not in the model
                return max(sum(v for k, v in result[d].items() if k not in data)
                           for d in ("sent", "received"))

            rows_out = [("PS", ps_workers, max(link(r) for r in ps),
                         predicted["parameter_server"])]
            if servers == 1:
                rows_out.append(("ring AR", ring, max(max(r["link"].values()) for r in ring),
                                 predicted["ring_all_reduce"]))
            for name, ranks, busiest, model in rows_out:
                step = max(r["step_s"] for r in ranks)
                compute_s = max(r["compute_s"] for r in ranks)
                print(f"{workers:>2}{servers if name == 'PS' else '-':>3}  {name:<10}"
                      f"{step * 1e3:>9.1f}{compute_s * 1e3:>9.1f}"
                      f"{(step - compute_s) * 1e3:>8.1f}{model['comm_time_s'] * 1e3:>11.1f}"
                      f"{busiest / MB:>22.2f}{model['busiest_link_bytes'] / MB:>11.2f}")


if __name__ == "__main__":
    main()
