"""Pipeline step time: tetrad's executor against torch.distributed.pipelining on the same stages.

    .venv/bin/python benchmarks/bench_pipeline.py [--pp 2] [--microbatches 8] [--steps 6]
        [--schedules gpipe,1f1b,zbv,dualpipe]

Each rank builds the same Transformer, cuts it with tetrad's partitioner, and runs one forward
and backward of the global batch per step (no optimizer step: both would run the same AdamW),
once with tetrad's PipelineExecutor and once with torch's PipelineStage and ScheduleGPipe /
Schedule1F1B / ScheduleZBVZeroBubble / ScheduleDualPipeV on the very same stage modules (the V
schedules: two per rank, placed in a V), alternating step by step so load from other processes
hits both alike. Next to each rank's measured idle fraction, the simulator's bubble fraction for
the same schedule (forward 1, backward 2, split evenly into B and W), ideal and as the executor
runs it (a B whose W comes next takes the whole backward: simulate(..., as_executed=True)); and
"replayed": the simulation, as executed, of this run's own costs, read from the executor's events
of the timed steps (tetrad/parallel/pipeline/measured.py: every stage's F, B, W and whole B, the
time posting each send and receive holds a rank, a message's transfer, the step's head and tail
around the actions; the head and loss on the last stage are in its F and B). A loaded machine
moves every cost, and the replay with them; the gap measured - replayed is what the simulator
still misses. The costs are printed per schedule, with the load average. A step is timed
between two barriers; the median of --steps timed steps follows --warmup untimed ones. Before timing, the first losses are checked to agree.
Each rank's CPU time per step (time.process_time) is printed too, for both: the work done,
which load from other processes moves far less than the wall-clock ratio.
Ranks are gloo processes with --threads threads each (on a GPU machine: NCCL, one GPU per rank).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tetrad.spec.model import ModelConfig, ParallelConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm
from tetrad.parallel.launch import spawn
from tetrad.parallel.mesh import build_mesh
from tetrad.parallel.pipeline import PipelineExecutor
from tetrad.parallel.pipeline.measured import MeasuredCosts, measured_costs
from tetrad.schedules import simulate
from tetrad.schedules.generate import V_SHAPED
from timing import timed

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zbv": "ScheduleZBVZeroBubble",
             "dualpipe": "ScheduleDualPipeV"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated, of {', '.join(SCHEDULES)}")
    args = parser.parse_args()
    args.schedules = args.schedules.split(",")
    unknown = set(args.schedules) - set(SCHEDULES)
    if unknown:
        parser.error(f"unknown schedules {sorted(unknown)}: choose from {', '.join(SCHEDULES)}")
    return args


def bench_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    from torch.distributed import pipelining

    torch.set_num_threads(args.threads)
    config = ModelConfig(name="bench", vocab_size=args.vocab, hidden_size=args.hidden,
                         num_layers=args.layers, num_heads=args.heads,
                         ffn_hidden_size=args.ffn, max_seq_len=args.seq)
    mesh = build_mesh(ParallelConfig(pp=world_size), rank, world_size)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    results = {}
    for name in args.schedules:
        torch.manual_seed(0)
        vpp = 2 if name in V_SHAPED else 1
        executor = PipelineExecutor.from_model(Transformer(config), mesh, Comm(), name,
                                               args.microbatches, vpp, seq_len=args.seq)
        plan = executor.schedule
        stages = [pipelining.PipelineStage(module, index, plan.num_stages, executor.device,
                                           group=mesh["pp"].handle)
                  for index, module in sorted(executor.stages.items())]
        loss_fn = lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten())  # noqa: E731
        schedule = getattr(pipelining, SCHEDULES[name])(
            stages if vpp > 1 else stages[0], args.microbatches, loss_fn=loss_fn)
        first, last = rank == plan.rank_of(0), rank == plan.rank_of(plan.num_stages - 1)

        def torch_step() -> float:
            losses: list = []
            if first and last:
                schedule.step(inputs, target=targets, losses=losses)
            elif first:
                schedule.step(inputs)
            elif last:
                schedule.step(target=targets, losses=losses)
            else:
                schedule.step()
            return sum(loss.item() for loss in losses) / args.microbatches

        times = {"tetrad": [], "torch": []}
        cpu = {"tetrad": [], "torch": []}
        idle, events, compute = [], [], []
        for step in range(args.warmup + args.steps):
            seconds, (cpu_seconds, stats) = timed(lambda: on_cpu(lambda: executor.step(tokens)))
            executor.module.zero_grad(set_to_none=True)
            torch_seconds, (torch_cpu_seconds, torch_loss) = timed(lambda: on_cpu(torch_step))
            executor.module.zero_grad(set_to_none=True)
            if step == 0 and last and abs(torch_loss - stats.loss) > 1e-4 * abs(stats.loss):
                raise AssertionError(f"{name}: losses differ, tetrad {stats.loss} vs torch "
                                     f"{torch_loss}")
            if step >= args.warmup:
                times["tetrad"].append(seconds)
                times["torch"].append(torch_seconds)
                cpu["tetrad"].append(cpu_seconds)
                cpu["torch"].append(torch_cpu_seconds)
                idle.append(stats.idle_fraction)
                events.append(stats.events)
                compute.append(stats.compute_s)
        results[name] = {"tetrad_s": statistics.median(times["tetrad"]),
                         "torch_s": statistics.median(times["torch"]),
                         "tetrad_cpu_s": statistics.median(cpu["tetrad"]),
                         "torch_cpu_s": statistics.median(cpu["torch"]),
                         "idle_fraction": statistics.median(idle),
                         "simulated": simulate(plan).bubble_fraction,
                         "as_executed": simulate(plan, as_executed=True).bubble_fraction,
                         "events": events, "compute_s": compute, "plan": plan}
    return results


def on_cpu(fn) -> tuple[float, object]:
    """(this process's CPU seconds in fn, fn's value): the work a step did, which other
    processes' load on a shared machine moves far less than its wall-clock time."""
    started = time.process_time()
    value = fn()
    return time.process_time() - started, value


def replayed(per_rank: list[dict], name: str) -> tuple[MeasuredCosts, list[float]]:
    """The executor's own action costs of this run, and per rank the idle fraction that the
    simulation of those costs (as executed) predicts for a step of head + makespan + tail."""
    measured = measured_costs(list(zip(*(r[name]["events"] for r in per_rank))))
    timeline = simulate(per_rank[0][name]["plan"], as_executed=True, costs=measured.costs)
    step = measured.head_s + float(timeline.makespan) + measured.tail_s
    return measured, [1 - sum(float(s.end - s.start) for s in spans) / step
                      for spans in timeline.spans]


def bookkeeping(per_rank: list[dict], name: str) -> float:
    """Mean share of a step that computes' actions spent outside the executor's compute timer
    and outside their waits (the measured idle fraction counts it idle; the replay, busy)."""
    shares = []
    for result in per_rank:
        for events, compute_s in zip(result[name]["events"], result[name]["compute_s"]):
            step = next(end - start for kind, *_, start, end in events if kind == "STEP")
            actions = sum(end - start for kind, *_, start, end in events
                          if kind in ("F", "B", "BW", "W"))
            waits = sum(end - start for kind, *_, start, end in events if kind.startswith("WAIT"))
            shares.append((actions - waits - compute_s) / step)
    return statistics.fmean(shares)


def describe(measured: MeasuredCosts) -> str:
    by_kind: dict[str, list[str]] = {}
    for (kind, stage), seconds in sorted(measured.costs.seconds.items(),
                                         key=lambda item: (item[0][0], item[0][1])):
        by_kind.setdefault(kind, []).append(f"{seconds * 1e3:.2f}")
    return ("ms per stage: " + "; ".join(f"{kind} {' '.join(v)}" for kind, v in by_kind.items())
            + f"; transfer {measured.costs.transfer * 1e3:.2f} ({measured.transfer_samples} "
            f"messages); head {measured.head_s * 1e3:.2f}, tail {measured.tail_s * 1e3:.2f}")


def main() -> None:
    args = parse_args()
    per_rank = spawn(bench_rank, args.pp, (args,), timeout_s=3600, collective_timeout_s=600)
    tokens = args.batch * args.seq
    print(f"pp={args.pp} microbatches={args.microbatches} batch={args.batch}x{args.seq} "
          f"hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
          f"threads/rank={args.threads}; forward+backward per step, median of {args.steps}")
    print(f"{'schedule':<9}{'tetrad s':>10}{'torch s':>10}{'tetrad/torch':>14}{'tok/s tetrad':>14}"
          f"  idle fraction: measured per rank (tetrad), mean; simulated, as executed; "
          f"replayed per rank (the run's own action costs), mean, measured - replayed")
    for name in args.schedules:
        tetrad = max(r[name]["tetrad_s"] for r in per_rank)
        reference = max(r[name]["torch_s"] for r in per_rank)
        idle = [r[name]["idle_fraction"] for r in per_rank]
        replay = replayed(per_rank, name)[1]
        print(f"{name:<9}{tetrad:>10.3f}{reference:>10.3f}{tetrad / reference:>14.2f}"
              f"{tokens / tetrad:>14,.0f}  {' '.join(f'{x:.2f}' for x in idle)}, "
              f"{statistics.mean(idle):.3f}; {per_rank[0][name]['simulated']:.3f}, "
              f"{per_rank[0][name]['as_executed']:.3f}; {' '.join(f'{x:.2f}' for x in replay)}, "
              f"{statistics.mean(replay):.3f}, {statistics.mean(idle) - statistics.mean(replay):+.3f}")
    for name in args.schedules:
        print(f"{name:<9}{describe(replayed(per_rank, name)[0])}; inside computes, outside "
              f"the compute timer: {bookkeeping(per_rank, name):.3f} of the step")
    for name in args.schedules:
        work = {side: [r[name][f"{side}_cpu_s"] for r in per_rank] for side in ("tetrad", "torch")}
        print(f"{name:<9}CPU s per step per rank (median): tetrad "
              f"{' '.join(f'{x:.3f}' for x in work['tetrad'])}, torch "
              f"{' '.join(f'{x:.3f}' for x in work['torch'])}; tetrad/torch, summed over the "
              f"ranks: {sum(work['tetrad']) / sum(work['torch']):.2f}")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
