"""The step-time cost of --offload params (and nvme) on this machine, measured against ZeRO-3
without offload, next to what the planner predicts for it.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_offload.py [--profile PROFILE.json]
        [--steps 10] [--rounds 3] [--modes params nvme]

The host link's bandwidth is the calibrated profile's (`tetrad calibrate`: on a CPU the streaming
bandwidth, a copy reading and writing every byte; tetrad.planner.offload_time), measured at the
start unless --profile gives one. Each round trains the same model for --steps steps on dp 2
ZeRO-3 (gloo, one thread per rank) with every offload mode in turn, so a drift of the machine's
load falls on all modes alike. A mode's measured time is the median over the rounds of the slower
rank's median step (the first step, warm-up, left out); its cost is that minus the no-offload
time, set beside the run reports' predicted totals' difference (the same planner, the same
profile). The model is wide and the batch small, so the shards' copies are a visible part of the
step: 4 layers of width 512 (12.9M parameters), one sequence of 8 tokens per microbatch, two
microbatches per rank.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tetrad.spec.model import ParallelConfig, TrainConfig

RUN = dict(model="tiny", model_overrides={"num_layers": 4, "hidden_size": 512,
                                          "num_heads": 8, "num_kv_heads": 8,
                                          "ffn_hidden_size": 1408},
           batch_size=4, grad_accum=2, seq_len=8, warmup_steps=1, sample_tokens=0,
           log_every=1000, nproc=2)


def mode_config(mode: str, steps: int, profile: Path, folder: Path) -> TrainConfig:
    parallel = ParallelConfig(dp=2, zero=3, offload_mode=mode,
                              offload_dir=str(folder) if mode == "nvme" else "")
    return TrainConfig(**RUN, steps=steps, hardware=str(profile),
                       report=str(folder / "run.json"), parallel=parallel)


def measured_and_predicted(config: TrainConfig) -> tuple[float, float]:
    from tetrad.train.launch import launch_training

    report = launch_training(config).report
    return (max(entry["step_time_s"] for entry in report["ranks"]),
            report["predicted"]["step_time_s"]["total"])


def calibrated(path: Path) -> Path:
    from tetrad.calibrate import calibrate
    from tetrad.hardware.profile import save_profile

    started = time.perf_counter()
    save_profile(calibrate("cpu"), path)
    print(f"calibrated in {time.perf_counter() - started:.0f} s: {path}", file=sys.stderr)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, help="a profile from tetrad calibrate")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="*", default=["params", "nvme"],
                        choices=("optimizer", "params", "nvme"))
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="tetrad-offload-bench-"))
    profile = args.profile or calibrated(folder / "profile.json")
    from tetrad.hardware.profile import load_profile
    bandwidth = load_profile(profile).host_memory_bandwidth
    print(f"host link: a copy at the profile's streaming bandwidth, {bandwidth / 1e9:.2f} GB/s",
          file=sys.stderr)
    modes = ["none", *args.modes]
    measured: dict[str, list[float]] = {mode: [] for mode in modes}
    predicted: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            seconds, total = measured_and_predicted(mode_config(mode, args.steps, profile,
                                                                folder))
            measured[mode].append(seconds)
            predicted[mode].append(total)
            print(f"round {round_ + 1}: {mode} {seconds * 1e3:.1f} ms (predicted "
                  f"{total * 1e3:.1f})", file=sys.stderr)
    base, base_predicted = (statistics.median(measured["none"]),
                            statistics.median(predicted["none"]))
    print("| offload | measured ms | predicted ms | cost measured ms | cost predicted ms | "
          "cost error |")
    print("|---|---|---|---|---|---|")
    for mode in modes:
        step, step_predicted = statistics.median(measured[mode]), statistics.median(
            predicted[mode])
        cost, cost_predicted = step - base, step_predicted - base_predicted
        error = f"{(cost_predicted - cost) / cost:+.1%}" if mode != "none" else ""
        print(f"| {mode} | {step * 1e3:.1f} | {step_predicted * 1e3:.1f} | "
              f"{cost * 1e3:.1f} | {cost_predicted * 1e3:.1f} | {error} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
