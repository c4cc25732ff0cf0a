"""The step-time cost of --offload params (and nvme) on this machine, measured against ZeRO-3
without offload, next to what the planner predicts for it.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_offload.py [--profile PROFILE.json]
        [--pairs 24] [--modes params nvme]

The host link is the calibrated profile's (`tetrad calibrate`, measured at the start unless
--profile gives one): the offload's own copies, a fixed cost per copy and a rate
(tetrad.calibrate.compute.host_copy_costs; tetrad.planner.offload_time). Since other jobs change
a shared machine's speed from minute to minute, the rank also reruns that measurement, and the
streaming bandwidth, between the pairs of steps; each row is predicted three ways: by the old
rule (every copy reading and writing each byte at the streaming bandwidth, no fixed cost), by
the profile's copy costs, and by the copy costs measured beside the steps. One spawned rank
(gloo, one thread) builds the same model under ZeRO-3 once per mode and runs the trainer's step
(microbatches, reduction, clipping, AdamW) on each in turn, --pairs times after a warm-up step:
every offload step is timed right beside a step without offload, so a drift of the machine's
load falls on both sides of each difference (in alternating order: the copy timings between
pairs leave the caches cold for the first). A mode's cost is the median of its differences
(their quartiles show the pairs' spread), set beside the planner's predicted step times'
difference on the same profile; and the same in CPU time (the rank's threads' seconds, which the
time slices other jobs take from a shared machine's cores do not stretch as they stretch the
wall clock: the offload's copies are CPU work of the rank's own). One rank leaves out the gloo
collectives, which on a CPU move each shard over loopback TCP far slower than the offload's copy
within memory and would bury its cost in their noise. The model is wide and the batch small, so
the shards' copies are a visible part of the step: 4 layers of width 512 (10.0M parameters), two
microbatches of one sequence of 8 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_time_prediction import calibrated, load
from tetrad.spec.model import ParallelConfig, TrainConfig

MODEL = {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 8,
         "ffn_hidden_size": 1408}
SEQ, BATCH, ACCUM = 8, 2, 2


def mode_config(mode: str, folder: str) -> TrainConfig:
    return TrainConfig(model="tiny", model_overrides=MODEL, seq_len=SEQ, batch_size=BATCH,
                       grad_accum=ACCUM, parallel=ParallelConfig(
                           zero=3, offload_mode=mode,
                           offload_dir=folder if mode == "nvme" else ""))


def rank(rank_index: int, world_size: int, modes: list[str], pairs: int, folder: str) -> dict:
    import torch

    from tetrad.calibrate import compute

    from tetrad.models.transformer import Transformer
    from tetrad.parallel.comm import Comm, CommCounter
    from tetrad.parallel.mesh import build_mesh
    from tetrad.spec.presets import resolve_model
    from tetrad.train.strategy import build_strategy

    def strategy(mode: str):
        config = mode_config(mode, folder)
        torch.manual_seed(0)
        model = Transformer(resolve_model("tiny", MODEL))
        mesh = build_mesh(config.parallel, rank_index, world_size)
        return build_strategy(model, config, torch.device("cpu"), mesh, Comm(CommCounter()))

    def step(run) -> tuple[float, float]:
        """(wall seconds, CPU seconds of the rank's threads) of one step."""
        batch = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
        started, cpu = time.perf_counter(), time.process_time()
        run.forward_backward(batch)
        run.finish_gradients()
        run.clip_grad_norm(1.0)
        run.step(1e-4)
        return time.perf_counter() - started, time.process_time() - cpu

    runs = {mode: strategy(mode) for mode in ["none", *modes]}
    for run in runs.values():
        step(run)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in runs}
    timer = compute.Timer(torch.device("cpu"), budget_s=0.05)
    copies, streams = [], []
    for pair in range(pairs):
        # Every other pair runs its steps in reverse: the copy timings between pairs leave the
        # caches cold for whichever step comes first, and a fixed order would put that on one side.
        for mode, run in (list(runs.items()) if pair % 2 == 0 else list(runs.items())[::-1]):
            times[mode].append(step(run))
        copies.append(compute.host_copy_costs(timer))
        streams.append(compute.stream_bandwidth(timer))
    return {"times": times, "copies": copies, "streams": streams}


def beside_steps(profile: Path, measured: dict):
    """The profile with the copy costs and the streaming bandwidth measured between the steps
    (medians), and the same under the old rule (no copy costs). On a CPU the host's memory is the
    device's (calibrate sets both bandwidths from one measurement): both take the new streaming
    rate, or the optimizer, priced at the host's with the shards there and at the device's
    without, would differ between the two steps of a pair by the two rates' gap."""
    from dataclasses import replace

    from tetrad.hardware.profile import load_profile

    gpu = load_profile(profile)
    latency = statistics.median(latency for latency, _ in measured["copies"])
    rate = statistics.median(rate for _, rate in measured["copies"])
    stream = statistics.median(measured["streams"])
    beside = replace(gpu, host_memory_bandwidth=stream, memory_bandwidth=stream,
                     efficiency=replace(gpu.efficiency, host_copy_s=latency,
                                        host_copy_bandwidth=rate))
    old_rule = replace(beside, efficiency=replace(beside.efficiency, host_copy_s=0.0,
                                                  host_copy_bandwidth=0.0))
    return beside, old_rule


def predicted_totals(modes: list[str], gpu, folder: str) -> dict[str, float]:
    from tetrad.planner import predict_training
    from tetrad.spec.presets import resolve_model

    config = resolve_model("tiny", MODEL)
    return {mode: predict_training(config, mode_config(mode, folder).parallel, BATCH // ACCUM,
                                   SEQ, num_microbatches=ACCUM, gpu=gpu)["step_time_s"]["total"]
            for mode in ["none", *modes]}


def main() -> int:
    from tetrad.hardware.profile import load_profile
    from tetrad.parallel.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, help="a profile from tetrad calibrate")
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--modes", nargs="*", default=["params", "nvme"],
                        choices=("optimizer", "params", "nvme"))
    args = parser.parse_args()
    if args.pairs < 2:
        parser.error("--pairs: at least 2 (the cost's quartiles need two pairs)")
    folder = Path(tempfile.mkdtemp(prefix="tetrad-offload-bench-"))
    profile = args.profile or calibrated(folder / "profile.json")
    gpu = load_profile(profile)
    print(f"{load()}; profile: streaming {gpu.host_memory_bandwidth / 1e9:.2f} GB/s, a copy "
          f"{gpu.efficiency.host_copy_s * 1e6:.1f} us + bytes at "
          f"{gpu.efficiency.host_copy_bandwidth / 1e9:.2f} GB/s", file=sys.stderr)
    measured = spawn(rank, 1, (args.modes, args.pairs, str(folder)), timeout_s=3600)[0]
    times = measured["times"]
    beside, old_rule = beside_steps(profile, measured)
    print(f"{load()}; beside the steps: streaming {beside.host_memory_bandwidth / 1e9:.2f} GB/s, "
          f"a copy {beside.efficiency.host_copy_s * 1e6:.1f} us + bytes at "
          f"{beside.efficiency.host_copy_bandwidth / 1e9:.2f} GB/s")
    print("| offload | host link | step ms (median) | predicted ms | cost ms (median of pairs) | "
          "quartiles | predicted cost ms | error | CPU cost ms (median of pairs) | quartiles | "
          "error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rule, device in (("old rule (streaming, beside)", old_rule), ("profile", gpu),
                         ("copy costs beside", beside)):
        predicted = predicted_totals(args.modes, device, str(folder))
        for mode in args.modes:
            cost_predicted = predicted[mode] - predicted["none"]
            cells = [mode, rule, f"{statistics.median(t for t, _ in times[mode]) * 1e3:.1f}",
                     f"{predicted[mode] * 1e3:.1f}"]
            for clock in (0, 1):  # wall, then CPU time
                differences = [a[clock] - b[clock] for a, b in zip(times[mode], times["none"])]
                cost = statistics.median(differences)
                low, _, high = statistics.quantiles(differences, n=4)
                cells += [f"{cost * 1e3:.1f}", f"{low * 1e3:.1f}-{high * 1e3:.1f}"]
                cells += [f"{cost_predicted * 1e3:.1f}"] if clock == 0 else []
                cells.append(f"{(cost_predicted - cost) / cost:+.1%}")
            print("| " + " | ".join(cells) + " |")
    print(f"none: {statistics.median(t for t, _ in times['none']) * 1e3:.1f} ms measured, "
          f"{predicted['none'] * 1e3:.1f} ms predicted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
