"""Memory-breakdown picture: one stacked bar per layout, the GPU's usable memory as a line.
matplotlib is imported here only, so the planner itself never needs it."""

from __future__ import annotations

from tetrad.hardware.catalog import GiB
from tetrad.viz.save import save_figure

PARTS = ("params", "grads", "optimizer", "activations", "kv_cache")
COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868",
          "activations": "#c44e52", "kv_cache": "#8172b3"}


def save_memory_breakdown(path: str, bars: list[tuple[str, dict[str, float], float]],
                          title: str) -> None:
    """bars: (label, bytes by part, usable bytes) per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(bars) + 3), 4.8))
    positions = range(len(bars))
    bottoms = [0.0] * len(bars)
    for part in PARTS:
        heights = [values.get(part, 0.0) / GiB for _, values, _ in bars]
        if not any(heights):
            continue
        ax.bar(positions, heights, bottom=bottoms, color=COLORS[part], label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for position, (_, _, usable) in zip(positions, bars):
        ax.hlines(usable / GiB, position - 0.4, position + 0.4, colors="black",
                  linestyles="dashed")
    ax.set_xticks(list(positions), [label for label, _, _ in bars], rotation=20, ha="right",
                  fontsize=8)
    ax.set_ylabel("GiB per GPU (fullest rank)")
    ax.set_title(title + "  (dashed: usable memory)", fontsize=10)
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1.0), loc="upper left")
    fig.tight_layout()
    save_figure(fig, path)
