"""A run report read back: the planner's prediction next to what each rank measured, as a table
(`tetrad report RUN.json`) and a picture (`--png`: the loss curve and the memory breakdown).
matplotlib is imported inside `draw_report` only."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from tetrad.errors import ConfigError, read_json_file
from tetrad.viz.report_check import check_report
from tetrad.viz.save import save_figure

COMM_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "p2p")
# Bottom to top of a memory bar (and the table's order); host_* are CPU memory (offload).
PARTS = ("params", "params_gathered_peak", "grads", "optimizer", "activations_peak",
         "host_optimizer", "host_grads")
COLORS = {"params": "#4c72b0", "params_gathered_peak": "#8fa8d6", "grads": "#dd8452",
          "optimizer": "#55a868", "activations_peak": "#c44e52", "host_optimizer": "#55a868",
          "host_grads": "#dd8452"}


def load_report(path: str | Path) -> dict[str, Any]:
    report = read_json_file(path, "run report", "tetrad train --report")
    if not isinstance(report, dict) or report.get("schema") != 1 or "ranks" not in report:
        raise ConfigError(f"{path} is not a schema-1 run report (the JSON tetrad train --report "
                          f"writes)")
    check_report(report, str(path))
    return report


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; 0 when both are 0, None when it has no meaning."""
    if predicted is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return (predicted - measured) / measured


def rank_kinds(report: dict[str, Any]) -> list[tuple[list[int], dict[str, Any]]]:
    """Ranks grouped by what they hold and send (data-parallel replicas are one kind), each kind
    as (its ranks, the entry of its first rank with the largest idle fraction and exposed
    communication time of the kind)."""
    kinds: dict[str, tuple[list[int], dict[str, Any]]] = {}
    for entry in report["ranks"]:
        key = json.dumps([entry["bytes"], entry["comm_bytes"], entry["coords"].get("pp", 0)],
                         sort_keys=True)
        if key not in kinds:
            kinds[key] = ([], dict(entry))
        ranks, first = kinds[key]
        ranks.append(entry["rank"])
        for field in ("idle_fraction", "comm_exposed_s"):
            if entry.get(field) is not None:
                first[field] = max(first.get(field) or 0.0, entry[field])
        if entry.get("cuda_memory") and first.get("cuda_memory"):  # the kind's largest peaks
            first["cuda_memory"] = {key: max(value, entry["cuda_memory"][key])
                                    for key, value in first["cuda_memory"].items()}
    return list(kinds.values())


def device_bytes(held: dict[str, int]) -> int:
    """Bytes a rank holds in device memory: every counted part but the host_* ones."""
    return sum(value for part, value in held.items() if not part.startswith("host_"))


def cuda_rows(predicted_bytes: dict[str, int], entry: dict[str, Any]) -> list[dict[str, Any]]:
    """On a GPU: the counted device bytes (and the prediction's) beside what the CUDA caching
    allocator measured at its peak. Allocated exceeds counted by the temporaries inside forward
    and backward, which the count leaves out (the CUDA context's own memory is in neither);
    reserved adds the allocator's cached, unused blocks."""
    cuda = entry.get("cuda_memory")
    if not cuda:
        return []
    predicted = device_bytes(predicted_bytes) if predicted_bytes else None
    counted = device_bytes(entry["bytes"])
    return [{"section": "cuda", "field": "counted total", "predicted": predicted,
             "measured": counted, "error": relative_error(predicted, counted)},
            {"section": "cuda", "field": "allocated_peak", "predicted": predicted,
             "measured": cuda["allocated_peak"],
             "error": relative_error(predicted, cuda["allocated_peak"])},
            {"section": "cuda", "field": "reserved_peak", "predicted": None,
             "measured": cuda["reserved_peak"], "error": None}]


def shared_coords(report: dict[str, Any], ranks: list[int]) -> dict[str, int]:
    """The coordinates on split axes that every rank of a kind has in common (a kind can span
    several tensor-parallel or data-parallel ranks that hold the same bytes)."""
    parallel = report.get("config", {}).get("parallel", {})
    members = [entry["coords"] for entry in report["ranks"] if entry["rank"] in ranks]
    return {axis: index for axis, index in members[0].items()
            if parallel.get(axis, 1) > 1 and all(m.get(axis) == index for m in members)}


def predicted_for(report: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any] | None:
    """The prediction for this rank's pipeline stage: each stage's own where the planner gives
    them ("stages", the `tetrad` runtime profile), else only the fullest stage has one."""
    predicted = report.get("predicted") or {}
    if "bytes" not in predicted:
        return None
    stage = entry["coords"].get("pp", 0)
    if "stages" in predicted:
        return {**predicted, **predicted["stages"][stage]}
    return predicted if stage == predicted.get("fullest_stage", 0) else None


def comparison(report: dict[str, Any], entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows {section, field, predicted, measured, error} for one rank: every byte field either
    side has, then every collective kind either side used (bytes, then calls), then the idle
    fraction and the times."""
    predicted = predicted_for(report, entry) or {}
    rows = []
    predicted_bytes = predicted.get("bytes", {})
    fields = [f for f in PARTS if f in entry["bytes"] or f in predicted_bytes]
    fields += [f for f in {**entry["bytes"], **predicted_bytes} if f not in PARTS]
    for field in fields:
        p, m = predicted_bytes.get(field), entry["bytes"].get(field)
        rows.append({"section": "bytes", "field": field, "predicted": p, "measured": m,
                     "error": relative_error(p, m)})
    rows += cuda_rows(predicted_bytes, entry)
    predicted_comm = predicted.get("comm_bytes", {})
    for kind in COMM_KINDS:
        p, m = predicted_comm.get(kind), entry["comm_bytes"].get(kind, 0)
        if p or m:
            rows.append({"section": "comm", "field": kind, "predicted": p, "measured": m,
                         "error": relative_error(p, m)})
    # The calls, each of which the time model prices (reports before they were counted have
    # none).
    predicted_calls, measured_calls = predicted.get("comm_calls", {}), entry.get("comm_calls")
    for kind in COMM_KINDS if measured_calls is not None else ():
        p, m = predicted_calls.get(kind), measured_calls.get(kind, 0)
        if p or m:
            rows.append({"section": "calls", "field": kind, "predicted": p, "measured": m,
                         "error": relative_error(p, m)})
    rows.append({"section": "idle", "field": "idle_fraction",
                 "predicted": predicted.get("idle_fraction"),
                 "measured": entry.get("idle_fraction"), "error": None})
    step_time = predicted_step_time(report)
    if step_time is not None or entry.get("step_time_s") is not None:
        p, m = step_time, entry.get("step_time_s")
        rows.append({"section": "time", "field": "step_time_s", "predicted": p, "measured": m,
                     "error": relative_error(p, m)})
    # Seconds per step waiting on communication (reports before it was measured have none).
    p, m = predicted.get("comm_exposed_s"), entry.get("comm_exposed_s")
    if p is not None or m is not None:
        rows.append({"section": "time", "field": "comm_exposed_s", "predicted": p,
                     "measured": m, "error": relative_error(p, m)})
    return rows


def predicted_step_time(report: dict[str, Any]) -> float | None:
    """The predicted step time's total (a whole step: every rank spends it), or None."""
    step_time = (report.get("predicted") or {}).get("step_time_s")
    return step_time.get("total") if isinstance(step_time, dict) else None


def _ranks_label(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _number(value: float | None, section: str) -> str:
    if value is None:
        return "-"
    if section == "time":
        return f"{value:.4f} s"
    return f"{value:.3f}" if section == "idle" else f"{round(value):,}"


def _error(error: float | None, row: dict[str, Any]) -> str:
    if row["section"] == "idle" or row["predicted"] is None or row["measured"] is None:
        return ""
    if row["section"] == "time":
        return f"{error:+.1%}"
    if round(row["predicted"]) == round(row["measured"]):
        return "exact"
    return "n/a" if error is None else f"{error:+.2%}"


def _layout(config: dict[str, Any]) -> str:
    parallel = config.get("parallel", {})
    degrees = [f"{axis} {parallel[axis]}" for axis in ("dp", "tp", "pp", "cp", "ep")
               if parallel.get(axis, 1) > 1]
    if parallel.get("dp", 1) > 1 or parallel.get("zero", 0):
        degrees.append(f"zero {parallel.get('zero', 0)}" + (" offload" if parallel.get("offload")
                                                           else ""))
    return ", ".join(degrees) or "one process"


def summary_lines(report: dict[str, Any]) -> list[str]:
    config, steps = report.get("config", {}), report.get("steps", [])
    predicted = report.get("predicted") or {}
    name = config.get("model_config", {}).get("name") or config.get("model", "?")
    params = report.get("num_parameters")
    lines = [f"run: {name}" + (f" ({params / 1e6:.2f}M parameters)" if params else "")
             + f", {len(report['ranks'])} rank{'s' if len(report['ranks']) > 1 else ''}: "
             f"{_layout(config)}; "
             f"{config.get('dtype', '?')}, batch {config.get('batch_size', '?')} x seq "
             f"{config.get('seq_len', '?')}, grad accum {config.get('grad_accum', 1)}; "
             f"device {(report.get('device') or {}).get('type', '?')}"]
    if steps:
        first, last = steps[0], steps[-1]
        loss = (f"loss: first {first['loss']:.4f} (step {first['step']}), last "
                f"{last['loss']:.4f} (step {last['step']})")
        if report.get("validation_loss") is not None:
            loss += f", validation {report['validation_loss']:.4f}"
        lines.append(loss)
        # The first step pays for warm-up (allocations, kernel selection): leave it out.
        timed = [s["time_s"] for s in (steps[1:] or steps)]
        measured = statistics.median(timed)
        step_time = f"step time: measured {measured:.4f} s (median of {len(timed)})"
        total = predicted_step_time(report)
        if total is not None:
            parts = predicted["step_time_s"]
            step_time += (f", predicted {total:.4f} s ({relative_error(total, measured):+.1%}) "
                          f"on {predicted.get('hardware', '?')}: compute "
                          f"{parts['compute']:.4f}, communication "
                          f"{parts['communication_exposed']:.4f}, bubble {parts['bubble']:.4f}")
        else:
            step_time += (", predicted - (no hardware profile: run tetrad calibrate, or pass "
                          "--hardware)")
        lines.append(step_time)
    if "error" in predicted:  # the planner refused the layout; the run went ahead
        lines.append(f"prediction: none (the planner: {predicted['error']})")
    elif predicted:
        if "stages" in predicted:
            ranks = "bytes of every pipeline stage"
        elif config.get("parallel", {}).get("pp", 1) == 1:
            ranks = "bytes of a rank"  # without a pipeline every rank holds alike
        else:
            ranks = (f"bytes of the fullest rank (pipeline stage "
                     f"{predicted.get('fullest_stage', 0)})")
        lines.append(f"prediction: the {predicted.get('runtime', 'megatron')} runtime's tensors; "
                     f"{ranks}, comm bytes sent per step")
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The text `tetrad report` prints."""
    out = summary_lines(report)
    for ranks, entry in rank_kinds(report):
        rows = comparison(report, entry)
        coords = ", ".join(f"{axis} {index}"
                           for axis, index in shared_coords(report, ranks).items())
        out += ["", f"{_ranks_label(ranks)} ({coords})" if coords else _ranks_label(ranks)]
        table = [("", "predicted", "measured", "error")]
        table += [(f"{row['section']} {row['field']}" if row["section"] not in ("idle", "time")
                   else row["field"],
                   _number(row["predicted"], row["section"]),
                   _number(row["measured"], row["section"]), _error(row["error"], row))
                  for row in rows]
        widths = [max(len(line[i]) for line in table) for i in range(4)]
        for line in table:
            out.append("  " + line[0].ljust(widths[0]) + "".join(
                "  " + cell.rjust(width) for cell, width in zip(line[1:], widths[1:])))
    errors = [abs(row["error"]) for _, entry in rank_kinds(report)
              for row in comparison(report, entry)
              if row["section"] in ("bytes", "comm") and row["error"] is not None]
    if errors:
        out += ["", f"largest |error| over bytes and comm: {max(errors):.2%}"]
    return "\n".join(out)


def _unit(largest: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= scale:
            return scale, name
    return 1, "bytes"


TIME_PARTS = (("compute", "#4c72b0"), ("communication_exposed", "#dd8452"),
              ("bubble", "#8c8c8c"))


def _draw_step_time(report: dict[str, Any], ax) -> None:
    """The predicted step time (stacked: compute, exposed communication, bubble) beside each
    rank kind's measured median."""
    parts = (report.get("predicted") or {}).get("step_time_s")
    labels, bottom = [], 0.0
    if isinstance(parts, dict):
        for part, color in TIME_PARTS:
            ax.bar(0, parts[part] * 1e3, bottom=bottom, color=color, width=0.6,
                   label=part.replace("_", " "))
            bottom += parts[part] * 1e3
        labels.append("predicted")
    for ranks, entry in rank_kinds(report):
        if entry.get("step_time_s") is not None:
            ax.bar(len(labels), entry["step_time_s"] * 1e3, color="#55a868", width=0.6,
                   label="measured (median)" if len(labels) == bool(parts) else None)
            labels.append(f"{_ranks_label(ranks)}\nmeasured")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("ms per step")
    hardware = (report.get("predicted") or {}).get("hardware")
    ax.set_title("step time: predicted" + (f" ({hardware})" if hardware else " (no profile)")
                 + " vs measured", fontsize=10)
    if labels:
        ax.legend(fontsize=8)


def draw_report(report: dict[str, Any], path: str | Path) -> None:
    """Loss per step (and the validation loss) on the left; per rank kind, the predicted and
    the measured memory as stacked bars side by side in the middle (host memory hatched); the
    predicted step time and each rank kind's measured one on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (loss_ax, memory_ax, time_ax) = plt.subplots(
        1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [1, 1.2, 0.9]})
    steps = report.get("steps", [])
    loss_ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], color="#4c72b0",
                 marker="o" if len(steps) < 30 else None, markersize=3, label="training loss")
    if report.get("validation_loss") is not None:
        loss_ax.axhline(report["validation_loss"], color="#c44e52", linestyle="--",
                        label=f"validation loss {report['validation_loss']:.3f}")
    loss_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("loss", fontsize=10)
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=8)

    bars: list[tuple[str, dict[str, float]]] = []
    allocated: dict[int, int] = {}  # bar position -> the CUDA allocator's peak (GPU runs)
    for ranks, entry in rank_kinds(report):
        predicted = predicted_for(report, entry)
        label = _ranks_label(ranks)
        if predicted:
            bars.append((f"{label}\npredicted", predicted["bytes"]))
        if entry.get("cuda_memory"):
            allocated[len(bars)] = entry["cuda_memory"]["allocated_peak"]
        bars.append((f"{label}\nmeasured", entry["bytes"]))
    largest = max([sum(values.get(part, 0) for part in PARTS) for _, values in bars]
                  + list(allocated.values()))
    scale, unit = _unit(largest)
    bottoms = [0.0] * len(bars)
    for part in PARTS:
        heights = [values.get(part, 0) / scale for _, values in bars]
        if not any(heights):
            continue
        host = part.startswith("host_")
        memory_ax.bar(range(len(bars)), heights, bottom=bottoms, color=COLORS[part], width=0.6,
                      label=f"{part} (CPU)" if host else part, hatch="//" if host else None,
                      alpha=0.55 if host else 1.0, edgecolor="white")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for position, total in enumerate(bottoms):
        memory_ax.annotate(f"{total:.2f}", (position, total), ha="center", va="bottom",
                           fontsize=8, xytext=(0, 2), textcoords="offset points")
    for index, (position, peak) in enumerate(allocated.items()):
        memory_ax.hlines(peak / scale, position - 0.3, position + 0.3, colors="black",
                         linestyles="--", label=None if index else "CUDA allocated peak")
    memory_ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    memory_ax.set_ylabel(f"{unit} per rank")
    memory_ax.set_ylim(0, max(bottoms + [peak / scale for peak in allocated.values()]) * 1.12)
    memory_ax.set_title("memory: predicted vs measured", fontsize=10)
    memory_ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1.0), loc="upper left")
    _draw_step_time(report, time_ax)
    name = report.get("config", {}).get("model_config", {}).get("name", "")
    fig.suptitle(f"run report: {name}, {_layout(report.get('config', {}))}", fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)
