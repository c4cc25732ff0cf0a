"""In-process time of the training layout search, as `tetrad plan train` runs it.

    python benchmarks/bench_plan_search.py --model llama3-405b --gpu h100 --num-gpus 16384

The command line is `tetrad plan train`'s; the search it would run (plan_training) is timed
`--repeat` times with time.perf_counter and the best and median times printed, each run from
cold caches so that the figure is that of a single `tetrad plan` invocation; the process's CPU
time beside (time.process_time: what a loaded machine's other jobs take from the wall clock
shows there less). `--profile N` then runs the search once more under cProfile and prints its N
costliest functions by cumulative time, with their call counts.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tetrad.planner as planner  # noqa: E402
from tetrad.cli.main import main as tetrad_main  # noqa: E402


def _clear_caches() -> None:
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("tetrad."):
            continue
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    known, plan_args = parser.parse_known_args()
    search = planner.plan_training
    times: list[float] = []
    cpu_times: list[float] = []
    profiles: list[cProfile.Profile] = []

    def timed(*args, **kwargs):
        for _ in range(known.repeat):
            _clear_caches()
            start, cpu_start = time.perf_counter(), time.process_time()
            result = search(*args, **kwargs)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        if known.profile:
            _clear_caches()
            profile = cProfile.Profile()
            profile.runcall(search, *args, **kwargs)
            profiles.append(profile)
        return result

    planner.plan_training = timed
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            tetrad_main(["plan", "train", *plan_args])
        except SystemExit:
            pass
        finally:
            sys.stdout = stdout
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"{' '.join(plan_args)}: best {min(times):.3f} s of {len(times)}, median "
          f"{statistics.median(times):.3f} s (all: {', '.join(f'{t:.3f}' for t in times)}); "
          f"CPU median {statistics.median(cpu_times):.3f} s; load average {load}")
    for profile in profiles:
        pstats.Stats(profile).sort_stats("cumtime").print_stats(known.profile)


if __name__ == "__main__":
    main()
