"""Fit the catalog GPUs' efficiency profiles on published runs, with leave-one-source-out cross
validation, and print (or write into docs/planner.md) the error per source.

    PYTHONPATH=. .venv/bin/python benchmarks/planner_cross_validation.py [--write docs/planner.md]
        [--without SOURCE ...]

The rows are benchmarks/published_runs.py. Each architecture's profile (Ampere: the A100s;
Hopper: H100 and H800) has a few fitted fractions - matmul efficiency; on Ampere also
FlashAttention-2's, on Hopper fp8 GEMMs' - and everything else fixed from measurements,
datasheets and papers (tetrad/hardware/catalog.py). A fit is a coordinate descent over grids of those
fractions that minimizes the mean over sources of each source's mean |error| (so 35 rows of one
publisher weigh as much as 3 of another). Cross validation refits without one source and
predicts that source's rows: the error a reader should expect on a run nobody tuned on.

Whole-run GPU-hours add what a step time cannot see - restarts, failures, evaluation,
checkpoints - as one stated goodput factor (GOODPUT), never by bending kernel efficiency.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

from benchmarks.published_runs import Run, all_runs, known_gaps, predict
from benchmarks.published_serving import predict_serving, serve_runs, serving_row
from tetrad.hardware.efficiency import EfficiencyProfile
from tetrad.hardware.catalog import AMPERE, HOPPER, gpu

# Llama 3 (Dubey et al. 2024, section 3.3.4): "higher than 90% effective training time" on the
# 16K-GPU cluster, counting restarts, failures and the other interruptions.
GOODPUT = 0.9
ARCHITECTURES = {"ampere": AMPERE, "hopper": HOPPER}
# What is fitted per architecture and over which grid: only physically measured ranges, so a fit
# cannot hide a missing mechanism in an impossible efficiency. Ampere's vendor attention stays at
# FlashAttention-2's measured 0.6 (no Megatron run of the time used flash attention) and its
# FlashAttention-2 class kernels stay in that paper's 50-73% of peak; it has no fp8 units. On
# Hopper both attention kernels are measured, not fitted (benchmarks/gpu_attention_efficiency.py:
# the causal forward of long calls, cuDNN 0.62 and FlashAttention-2 0.34 of peak).
GRIDS = {
    "ampere": {"matmul": [x / 100 for x in range(50, 86)],
               "portable_attention": [x / 100 for x in range(50, 74, 2)]},
    "hopper": {"matmul": [x / 100 for x in range(45, 81)],
               "fp8_matmul": [x / 100 for x in range(30, 81, 2)]},
}
MARK_BEGIN, MARK_END = "<!-- cross-validation:begin -->", "<!-- cross-validation:end -->"


@dataclasses.dataclass(frozen=True)
class GpuHours:
    """A whole training run: tokens, the GPU-hours its authors report, and the step-time row
    whose layout ran most of it."""

    name: str
    citation: str
    tokens: float
    gpu_hours: float
    layout_run: Run


def architecture(run: Run) -> str:
    profile = gpu(run.gpu).efficiency
    return next(name for name, catalog in ARCHITECTURES.items() if catalog == profile)


def errors(runs: list[Run], profiles: dict[str, EfficiencyProfile]) -> list[float]:
    """predicted / measured - 1 of each run's step time under `profiles`."""
    out = []
    for run in runs:
        catalog = gpu(run.gpu)
        predicted = predict(run, dataclasses.replace(
            catalog, efficiency=profiles[architecture(run)]))
        out.append(predicted / run.measured_step_s - 1)
    return out


def _objective(runs: list[Run], profiles: dict[str, EfficiencyProfile]) -> float:
    by_source: dict[str, list[float]] = {}
    for run, error in zip(runs, errors(runs, profiles)):
        by_source.setdefault(run.source, []).append(abs(error))
    return statistics.mean(statistics.mean(group) for group in by_source.values())


def fit(runs: list[Run], passes: int = 3) -> dict[str, EfficiencyProfile]:
    """Per architecture, the grid values that minimize the source-balanced mean |error|. The
    descent starts from each grid's middle, not from the catalog, so the fit does not depend on
    what the catalog held before."""
    profiles = {name: dataclasses.replace(ARCHITECTURES[name], **{
        key: values[len(values) // 2] for key, values in GRIDS[name].items()})
        for name in ARCHITECTURES}
    for name, grid in GRIDS.items():
        mine = [run for run in runs if architecture(run) == name]
        if not mine:
            continue
        for _ in range(passes):
            for field_name, values in grid.items():
                scored = [(_objective(mine, {**profiles, name: dataclasses.replace(
                    profiles[name], **{field_name: value})}), value) for value in values]
                profiles[name] = dataclasses.replace(profiles[name],
                                                     **{field_name: min(scored)[1]})
    return profiles


def gpu_hours_rows() -> list[GpuHours]:
    llama_layout = next(run for run in all_runs() if run.name == "Llama3 405B 16384 GPUs")
    return [GpuHours("Llama 3.1 405B pre-training", "meta-llama/llama-models, "
                     "models/llama3_1/MODEL_CARD.md (30.84M H100-80GB GPU-hours); tokens: "
                     "Dubey et al. 2024 (15.6T)", 15.6e12, 30.84e6, llama_layout)]


def predicted_gpu_hours(row: GpuHours, profiles: dict[str, EfficiencyProfile]) -> float:
    run = row.layout_run
    step = predict(run, dataclasses.replace(gpu(run.gpu),
                                            efficiency=profiles[architecture(run)]))
    gpu_seconds_per_token = step * run.num_gpus / (run.global_batch * run.seq_len)
    return row.tokens * gpu_seconds_per_token / 3600 / GOODPUT


def _pct(values: list[float]) -> str:
    return f"{statistics.mean(abs(v) for v in values):.1%}"


def report(without: tuple[str, ...] = ()) -> str:
    runs = [run for run in all_runs() if run.source not in without]
    sources = list(dict.fromkeys(run.source for run in runs))
    full = fit(runs)
    in_sample = dict(zip((run.name for run in runs), errors(runs, full)))
    cross: dict[str, float] = {}
    held_out_profiles = {}
    for source in sources:
        profiles = fit([run for run in runs if run.source != source])
        held_out_profiles[source] = profiles
        mine = [run for run in runs if run.source == source]
        cross.update(zip((run.name for run in mine), errors(mine, profiles)))
    lines = ["| source | rows | GPUs | in-sample step time | cross-validated step time | "
             "cross-validated MFU | worst (cross-validated) |", "|---|---|---|---|---|---|---|"]
    for source in sources:
        mine = [run for run in runs if run.source == source]
        step_errors = [cross[run.name] for run in mine]
        mfu_errors = [1 / (1 + e) - 1 for e in step_errors]
        worst = max(mine, key=lambda run: abs(cross[run.name]))
        gpus = ", ".join(sorted({run.gpu for run in mine}))
        lines.append(f"| {source} | {len(mine)} | {gpus} | {_pct([in_sample[r.name] for r in mine])}"
                     f" | {_pct(step_errors)} | {_pct(mfu_errors)} | {worst.name}: "
                     f"{cross[worst.name]:+.0%} |")
    all_cross = list(cross.values())
    per_source = [statistics.mean(abs(cross[r.name]) for r in runs if r.source == s)
                  for s in sources]
    lines.append(f"| all | {len(runs)} | | {_pct(list(in_sample.values()))} | "
                 f"{_pct(all_cross)} (sources weighted equally: "
                 f"{statistics.mean(per_source):.1%}) | "
                 f"{_pct([1 / (1 + e) - 1 for e in all_cross])} | |")
    stale = [f"{name}.{key}" for name, grid in GRIDS.items() for key in grid
             if getattr(full[name], key) != getattr(ARCHITECTURES[name], key)]
    lines += ["", "Fitted on all rows (tetrad/hardware/catalog.py holds these): " + "; ".join(
        f"{name} " + ", ".join(f"{key} {getattr(full[name], key):.2f}" for key in grid)
        for name, grid in GRIDS.items()) + "." + (
            f" The catalog differs in {', '.join(stale)}: copy the fit into tetrad/hardware/catalog.py."
            if stale else ""), "",
        f"Whole-run GPU-hours, goodput {GOODPUT:.0%} (Llama 3's reported effective training "
        "time), cross-validated (the Llama 3 paper's rows held out):", "",
        "| run | reported GPU-hours | predicted | error |", "|---|---|---|---|"]
    for row in gpu_hours_rows():
        predicted = predicted_gpu_hours(row, held_out_profiles[row.layout_run.source])
        lines.append(f"| {row.name} ({row.citation}) | {row.gpu_hours / 1e6:.2f}M | "
                     f"{predicted / 1e6:.2f}M | {predicted / row.gpu_hours - 1:+.1%} |")
    lines += ["", "Serving, against TensorRT-LLM's tables (not fitted: the catalog profiles, a check "
              "outside the calibration set):", "",
              "| run | measured | predicted | error |", "|---|---|---|---|"]
    lines += [serving_row(run, predict_serving(run)) for run in serve_runs()]
    lines += ["", "Known gaps, left out of the fit and the means (in-sample profile):", ""]
    for run, why in known_gaps():
        error = errors([run], full)[0]
        lines.append(f"- {run.name} ({run.citation}): {error:+.0%}. {why}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="DOC", help="replace the marked block in DOC")
    parser.add_argument("--without", metavar="SOURCE", action="append", default=[],
                        help="leave a source's rows out altogether (what it adds to the fit)")
    args = parser.parse_args()
    text = report(tuple(args.without))
    print(text)
    if args.write:
        path = Path(args.write)
        doc = path.read_text()
        start, end = doc.index(MARK_BEGIN) + len(MARK_BEGIN), doc.index(MARK_END)
        path.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


if __name__ == "__main__":
    main()
