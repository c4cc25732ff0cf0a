"""Predicted against measured step time of tetrad's trainer on this machine, layout by layout.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_time_prediction.py [--profile PROFILE.json]
        [--steps 12] [--rounds 3] [--only NAME ...]

`tetrad calibrate` measures the machine (microbenchmarks only: matmuls, attention, streaming
bandwidth, eager operators, the optimizer step, gloo collectives by group size), unless --profile
gives a profile already measured. Then every layout below trains a small model for --steps steps
on 1-8 gloo ranks (one thread each) and its run report's predicted step time (the planner on
that profile) is set beside the measured time. No layout's time enters the profile: the
prediction is out of sample. Prints a markdown table and the count of layouts within 15%, with
the load average at the start and the end.

The measurement: --rounds rounds, each calibrating the machine again (unless --profile) and then
running every layout once in turn, so that a drift of the machine's load falls on all layouts
alike, and on the calibration beside them, rather than on the few that ran during it. A layout's
measured time is the median over the rounds of its slowest rank's median step (the first step of
each run, warm-up, left out), its prediction the median of the rounds' predictions.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_time_prediction.py --replay LOG FOLDER

re-predicts a run already measured, with the time model as it is now and no training: LOG is
what that run printed to stderr (its "round N: NAME X ms" lines), FOLDER the folder it named
in its "calibrated in" lines, which holds each round's profile (profile-N.json).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tetrad.spec.model import ParallelConfig, TrainConfig
from tetrad.hardware.profile import save_profile

MOE = {"model": "tiny-moe", "model_overrides": {"num_layers": 4, "hidden_size": 128,
                                                 "ffn_hidden_size": 256,
                                                 "moe_ffn_hidden_size": 128}}
# name -> (TrainConfig fields beyond RUN, ParallelConfig fields); world = product of degrees.
LAYOUTS: dict[str, tuple[dict, dict]] = {
    "dp2": ({}, dict(dp=2)),
    "dp2 zero1": ({}, dict(dp=2, zero=1)),
    "dp2 zero2": ({}, dict(dp=2, zero=2)),
    "dp2 zero3": ({}, dict(dp=2, zero=3)),
    "tp2": ({}, dict(tp=2)),
    "tp2 sp": ({}, dict(tp=2, sequence_parallel=True)),
    "cp2": ({}, dict(cp=2)),
    "dp2 ep2 moe": (MOE, dict(dp=2, ep=2)),
    "pp2 gpipe": ({}, dict(pp=2, schedule="gpipe", microbatches=4)),
    "pp2 1f1b": ({}, dict(pp=2, schedule="1f1b", microbatches=4)),
    "pp2 interleaved": ({}, dict(pp=2, schedule="interleaved", vpp=2, microbatches=4)),
    "pp2 zb": ({}, dict(pp=2, schedule="zb", microbatches=4)),
    "dp4": ({}, dict(dp=4)),
    "dp2 tp2 pp2 (3D)": ({}, dict(dp=2, tp=2, pp=2, microbatches=2)),
    "dp2 tp2 pp2 ep2 moe (4D)": (MOE, dict(dp=2, tp=2, pp=2, ep=2, microbatches=2)),
}
RUN = dict(model="tiny", model_overrides={"num_layers": 4, "hidden_size": 128,
                                          "ffn_hidden_size": 352},
           batch_size=8, seq_len=64, warmup_steps=1, sample_tokens=0, log_every=1000)


def layout_config(name: str, steps: int, profile: Path, report: Path) -> TrainConfig:
    extra, parallel = LAYOUTS[name]
    fields = {**RUN, **extra, "steps": steps, "hardware": str(profile), "report": str(report)}
    config = ParallelConfig(**parallel)
    world = config.dp * config.tp * config.pp * config.cp
    return TrainConfig(**fields, nproc=world, parallel=config)


def run_layout(config: TrainConfig) -> dict:
    from tetrad.train.launch import launch_training

    return launch_training(config).report


def compare(report: dict) -> tuple[float, float, dict]:
    """(predicted total, the slowest rank's median step, predicted parts)."""
    predicted = report["predicted"]["step_time_s"]
    measured = max(entry["step_time_s"] for entry in report["ranks"])
    return predicted["total"], measured, predicted


def predicted_on(name: str, profile: Path) -> dict:
    """The run report's predicted step time of `name` on `profile`, computed as the trainer
    computes it (tetrad.train.prediction.predict) but without training."""
    from tetrad.hardware.profile import load_profile
    from tetrad.train.launch import check_layout, with_overlap_decided
    from tetrad.train.prediction import predict

    config = with_overlap_decided(layout_config(name, 12, profile, profile), "cpu")
    layout = check_layout(config, config.nproc)
    return predict(layout, config, load_profile(profile))["step_time_s"]


def replayed(log: Path, folder: Path) -> tuple[dict, dict]:
    """(measured, predicted) per layout and round from a run's stderr and saved profiles."""
    measured: dict[str, list[float]] = {}
    predicted: dict[str, list[tuple[float, dict]]] = {}
    for line in log.read_text().splitlines():
        found = re.match(r"round (\d+): (.+) ([\d.]+) ms \(predicted", line)
        if found:
            parts = predicted_on(found[2], folder / f"profile-{found[1]}.json")
            measured.setdefault(found[2], []).append(float(found[3]) / 1e3)
            predicted.setdefault(found[2], []).append((parts["total"], parts))
    return measured, predicted


def calibrated(path: Path) -> Path:
    from tetrad.calibrate import calibrate

    started = time.perf_counter()
    save_profile(calibrate("cpu"), path)
    print(f"calibrated in {time.perf_counter() - started:.0f} s: {path}", file=sys.stderr)
    return path


def load() -> str:
    return "load average " + " ".join(f"{value:.1f}" for value in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, help="a profile from tetrad calibrate")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=list(LAYOUTS), metavar="NAME")
    parser.add_argument("--replay", nargs=2, type=Path, metavar=("LOG", "FOLDER"),
                        help="re-predict a measured run (module doc); nothing is trained")
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"started {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {load()}",
          file=sys.stderr)
    folder = args.replay[1] if args.replay else Path(tempfile.mkdtemp(prefix="tetrad-time-"))
    names = args.only or list(LAYOUTS)
    measured: dict[str, list[float]] = {name: [] for name in names}
    predicted: dict[str, list[tuple[float, dict]]] = {name: [] for name in names}
    if args.replay:
        measured, predicted = replayed(*args.replay)
        names = [name for name in names if name in measured]
        args.rounds = len(measured[names[0]])
    for round_ in range(0 if args.replay else args.rounds):
        profile = args.profile or calibrated(folder / f"profile-{round_ + 1}.json")
        for name in names:
            config = layout_config(name, args.steps, profile, folder / "run.json")
            total, slowest, parts = compare(run_layout(config))
            predicted[name].append((total, parts))
            measured[name].append(slowest)
            print(f"round {round_ + 1}: {name} {slowest * 1e3:.1f} ms (predicted "
                  f"{total * 1e3:.1f})", file=sys.stderr)
    rows, errors = [], []
    for name in names:
        # The round whose prediction is the median (its parts add up to it).
        total, parts = sorted(predicted[name], key=lambda pair: pair[0])[args.rounds // 2]
        median = statistics.median(measured[name])
        error = (total - median) / median
        errors.append(abs(error))
        ranks = layout_config(name, args.steps, folder, folder / "run.json").nproc
        rows.append(f"| {name} | {ranks} | {median * 1e3:.1f} | {total * 1e3:.1f} | "
                    f"{parts['compute'] * 1e3:.1f} | {parts['communication_exposed'] * 1e3:.1f} | "
                    f"{parts['bubble'] * 1e3:.1f} | {error:+.1%} |")
    print("| layout | ranks | measured ms | predicted ms | compute | communication | bubble "
          "| error |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    within = sum(error <= 0.15 for error in errors)
    print(f"\n{within} of {len(errors)} layouts within 15%; mean |error| "
          f"{statistics.fmean(errors):.1%}, largest {max(errors):.1%} "
          f"({time.perf_counter() - started:.0f} s, {args.rounds} rounds; at the end {load()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
