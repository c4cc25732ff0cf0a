"""DeepSeek-V3's pre-training GPU-hours as the planner predicts them, schedule by schedule.

    .venv/bin/python benchmarks/deepseek_v3_dualpipe.py

The published layout (benchmarks/published_runs.py: 2048 H800s, pp 16, ep 64, ZeRO-1, FP8,
batch 15360 x 4096) with the micro batch and recomputation searched, under ZB-H1, ZB-V and
DualPipeV, each with and without DeepSeek's node-limited dispatch, against the report's 2.664M
H800 GPU-hours for 14.8T tokens (180K per trillion). No fitted constant: DualPipe's gain is what
its overlapped pairs hide of the expert all-to-all (tetrad.planner.training._hidden_by_pairing),
the dispatch's what a token no longer sends to more than topk_expert_groups nodes.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.published_runs import known_gaps, workload  # noqa: E402
from tetrad.hardware.profile import cluster  # noqa: E402
from tetrad.planner.search import TrainSpace, search_training  # noqa: E402

TOKENS = 14.8e12
PUBLISHED_GPU_HOURS = 2.664e6


def main() -> None:
    run = next(run for run, _ in known_gaps() if run.name.startswith("DeepSeek-V3"))
    world = cluster(run.gpu, run.num_gpus)
    fixed = {k: v for k, v in run.layout.items() if k not in ("schedule", "vpp")}
    print(f"{'schedule':<10}{'node-limited dispatch':>22}{'step s':>9}{'GPU-hours':>11}"
          f"{'vs 2.664M':>11}  micro batch, recompute; compute / exposed comm / bubble s")
    for schedule in ("zb", "zbv", "dualpipe"):
        for limited in (False, True):
            variant = dataclasses.replace(run, workload={**run.workload,
                                                         "node_limited_dispatch": limited})
            space = TrainSpace(**fixed, schedule=schedule,
                               vpp=2 if schedule in ("zbv", "dualpipe") else None)
            best = search_training(run.config, world, workload(variant), run.global_batch,
                                   space, top=1).ranked[0]
            hours = TOKENS / (run.global_batch * run.seq_len) * best.step.total \
                * run.num_gpus / 3600
            step = best.step
            print(f"{schedule:<10}{'yes' if limited else 'no':>22}{step.total:>9.2f}"
                  f"{hours / 1e6:>10.3f}M{hours / PUBLISHED_GPU_HOURS - 1:>+11.1%}  "
                  f"{best.layout.micro_batch}, {best.layout.recompute}; {step.compute:.2f} / "
                  f"{step.communication_exposed:.2f} / {step.bubble:.2f}")
    print(f"published: {run.measured_step_s:.2f} s per step, {PUBLISHED_GPU_HOURS / 1e6:.3f}M "
          f"GPU-hours")


if __name__ == "__main__":
    main()
