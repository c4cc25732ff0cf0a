"""Pipeline timeline as a PNG, drawn like the GPipe / Megatron / zero-bubble papers' figures:
one row per rank, one box per action with its microbatch number, bubbles left blank."""

from __future__ import annotations

from pathlib import Path

from tetrad.schedules.simulate import Timeline
from tetrad.viz.save import save_figure

COLOURS = {"F": "#4e79a7", "B": "#59a14f", "W": "#f28e2b"}  # forward blue, backward green, W orange


def _shade(colour: str, chunk: int, vpp: int) -> tuple[float, float, float]:
    """Later model chunks of an interleaved rank get lighter, as in Megatron's figure 4."""
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = 0.55 * chunk / max(vpp - 1, 1)
    return tuple(c + (1 - c) * mix for c in rgb)


def draw_pipeline(timeline: Timeline, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    schedule = timeline.schedule
    makespan = float(timeline.makespan)
    width_inches = min(max(6.0, 0.38 * makespan), 40.0)
    figure, axes = plt.subplots(figsize=(width_inches, 0.55 * schedule.pp + 1.5))
    # Size the microbatch numbers to the narrowest box (72 points per inch).
    shortest = min((float(s.end - s.start) for spans in timeline.spans for s in spans),
                   default=1.0)
    font_size = max(4.0, min(10.0, 0.5 * 72 * shortest * width_inches / max(makespan, 1.0)))
    for rank, spans in enumerate(timeline.spans):
        for span in spans:
            start, width = float(span.start), float(span.end - span.start)
            chunk = schedule.chunk_of(span.action.stage)
            axes.barh(rank, width, left=start, height=0.8, edgecolor="black", linewidth=0.6,
                      color=_shade(COLOURS[span.action.kind], chunk, schedule.vpp))
            axes.text(start + width / 2, rank, str(span.action.microbatch), ha="center",
                      va="center", fontsize=font_size,
                      color="white" if chunk == 0 else "black")
    axes.set_yticks(range(schedule.pp), [f"rank {rank}" for rank in range(schedule.pp)])
    axes.set_ylim(schedule.pp - 0.5, -0.5)  # rank 0 on top, as in the papers
    axes.set_xlim(0, makespan)
    axes.set_xlabel("time (forward of one stage = 1)")
    for side in ("top", "right", "left"):
        axes.spines[side].set_visible(False)
    names = {"F": "forward", "B": "backward for inputs" if schedule.split_backward
             else "backward", "W": "backward for weights"}
    kinds = "FBW" if schedule.split_backward else "FB"
    handles = [Patch(facecolor=COLOURS[k], edgecolor="black", label=names[k]) for k in kinds]
    if schedule.vpp > 1:
        handles.append(Patch(facecolor=_shade("#808080", schedule.vpp - 1, schedule.vpp),
                             edgecolor="black", label="later model chunk (lighter)"))
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False,
                  fontsize=8)
    axes.set_title(f"{schedule.name}: pp={schedule.pp}, vpp={schedule.vpp}, "
                   f"microbatches={schedule.microbatches}, bubble "
                   f"{timeline.bubble_fraction:.1%}", fontsize=10)
    figure.tight_layout(rect=(0, 0.1, 1, 1))  # the bottom strip holds the legend
    save_figure(figure, path)
