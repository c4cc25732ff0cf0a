"""Exposed communication with and without overlap (ParallelConfig.overlap / --no-overlap): tensor
parallelism tp=2 with sequence parallelism, and expert parallelism dp=2 x ep=2 on an MoE with a
shared expert, each trained by `tetrad train`'s own worker on 2 gloo ranks.

    .venv/bin/python benchmarks/bench_overlap.py [--repeats 3] [--steps 6]
        [--hardware PROFILE.json]

Per run the run report gives each rank's comm_exposed_s (seconds per step spent waiting on
communication, median over the steps after the first) and step_time_s; the table shows, per
layout and setting, the median over --repeats of the slowest rank's, and the planner's
prediction of comm_exposed_s for the same run when --hardware names a profile (e.g. the one
`tetrad calibrate` wrote for this machine). Overlap on and off alternate run by run, the first of
each pair swapped every repeat, so that a shared machine's load hits both alike. Bytes sent are
the same either way (tests/test_overlap.py); the script checks that the losses agree.
"""

from __future__ import annotations

import argparse
import statistics

from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.parallel.launch import spawn
from tetrad.train.launch import train_worker

MOE = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
       "ffn_hidden_size": 512, "moe_ffn_hidden_size": 512, "max_seq_len": 256}
CASES = {
    "TP: tp=2, sequence parallel, `small`": dict(model="small",
                                                 parallel=dict(tp=2, sequence_parallel=True)),
    "EP: dp=2 x ep=2, `tiny-moe` widened, 1 shared expert": dict(
        model="tiny-moe", model_overrides=MOE, parallel=dict(dp=2, ep=2)),
}


def config_of(case: dict, overlap: bool, args: argparse.Namespace) -> TrainConfig:
    case = dict(case)
    parallel = ParallelConfig(**case.pop("parallel"), overlap=overlap)
    return TrainConfig(**case, parallel=parallel, nproc=2, steps=args.steps, batch_size=8,
                       seq_len=256, warmup_steps=1, sample_tokens=0, hardware=args.hardware)


def run_all(rank: int, world_size: int, args: argparse.Namespace) -> list[dict] | None:
    """Every (repeat, case, setting) in the interleaved order; rank 0 returns the reports."""
    results = []
    for repeat in range(args.repeats):
        for name, case in CASES.items():
            order = (True, False) if repeat % 2 == 0 else (False, True)
            for overlap in order:
                result = train_worker(rank, world_size, config_of(case, overlap, args))
                if rank == 0:
                    results.append({"case": name, "overlap": overlap, "report": result.report})
    return results if rank == 0 else None


def summarize(results: list[dict]) -> list[str]:
    lines = ["| layout | overlap | exposed comm s/step, measured | predicted | step s | "
             "exposed share of step |", "|---|---|---|---|---|---|"]
    for name in CASES:
        losses = {}
        exposed_by_setting = {}
        for overlap in (True, False):
            runs = [r["report"] for r in results if r["case"] == name and r["overlap"] == overlap]
            exposed = statistics.median(max(e["comm_exposed_s"] for e in report["ranks"])
                                        for report in runs)
            step = statistics.median(max(e["step_time_s"] for e in report["ranks"])
                                     for report in runs)
            predicted = runs[0]["predicted"].get("comm_exposed_s")
            losses[overlap] = [s["loss"] for s in runs[0]["steps"]]
            exposed_by_setting[overlap] = exposed
            lines.append(f"| {name} | {'on' if overlap else 'off'} | {exposed:.3f} | "
                         f"{'-' if predicted is None else f'{predicted:.3f}'} | {step:.3f} | "
                         f"{exposed / step:.0%} |")
        ratio = exposed_by_setting[False] / max(exposed_by_setting[True], 1e-9)
        lines.append(f"| {name} | off ÷ on | {ratio:.2f}x | | | |")
        agree = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses[True], losses[False]))
        lines.append(f"<!-- {name}: losses with and without overlap agree to 1e-5: {agree} -->")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hardware", help="a hardware profile for the predictions")
    args = parser.parse_args()
    results = spawn(run_all, 2, (args,), timeout_s=3600)[0]
    for line in summarize(results):
        print(line)
    print(f"(median of {args.repeats} runs of {args.steps} steps each; a run's numbers are the "
          f"medians of its steps after the first)")


if __name__ == "__main__":
    main()
