"""Microbenchmarks -> a hardware profile (tetrad.hardware.catalog.GPU with a measured EfficiencyProfile).

On CPU the peaks are what this machine measured (one thread per rank, as tetrad's trainer runs):
its largest GEMM's FLOP/s, its streaming bandwidth, gloo's links. On a GPU the datasheet peaks of
the catalog entry the device name matches stay the reference, so the measured efficiencies read
against the catalog's; a GPU the catalog lacks takes its measured peaks.
"""

from __future__ import annotations

import os
import platform
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from tetrad.calibrate import compute
from tetrad.calibrate.collectives import ROUNDS, measure
from tetrad.calibrate.step import predicted_step_seconds, step_seconds, training_step
from tetrad.errors import ConfigError
from tetrad.hardware.efficiency import EfficiencyProfile
from tetrad.hardware.catalog import GPU, gpu_from_device_name

ATTENTION_SHAPES = {"cpu": ((1, 4, 64, 16), (2, 4, 128, 32)),
                    "cuda": ((1, 16, 1024, 128), (4, 32, 4096, 128))}
PEAK_SIZES = {"cpu": 512, "cuda": 8192}
# The dtype a rank's matmuls run in: fp32 on CPU (tetrad's default), bf16 tensor cores on a GPU.
CURVE_DTYPES = {"cpu": "fp32", "cuda": "bf16"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def calibrate(device_type: str = "cpu", nproc: int = 0, show_progress: bool = True,
              budget_s: float = 0.05, rounds: int = ROUNDS) -> GPU:
    """Measure this machine; `nproc` ranks for the collectives (0: up to 8 on CPU, every GPU on
    CUDA; 1: none). `budget_s` is the time spent repeating one measurement, `rounds` the rounds
    over every collective (tetrad.calibrate.collectives.measure)."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible (use --device cpu)")
    if nproc < 0:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise ConfigError(f"--nproc {nproc} needs a GPU per rank; {torch.cuda.device_count()} "
                          f"visible")
    ranks = nproc or (torch.cuda.device_count() if device_type == "cuda" else 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank of tetrad's trainer runs
    try:
        device = torch.device(device_type)
        timer = compute.Timer(device, budget_s)
        single = _single_device(timer, device_type, show_progress)
    finally:
        torch.set_num_threads(threads)
    fits, concurrent, waits, call = (_collectives(ranks, device_type, show_progress, rounds)
                                     if ranks > 1 else ([], [], [], 0.0))
    device = _with_whole_step(_profile(device_type, single, fits), single.get("step"), concurrent)
    # The loop's calls took their own latency too, which the all-reduce fit already counts.
    pair = device.efficiency.collective_fit("all_reduce", 2)
    own = pair[0] if pair else 0.0
    return replace(device, efficiency=replace(
        device.efficiency,
        sync_wait=tuple((n, max(0.0, wait - own)) for n, wait, _, _ in waits),
        sync_wait_back_to_back=tuple((n, max(0.0, calls - own)) for n, _, calls, _ in waits),
        call_cpu=tuple((n, max(0.0, cpu - own)) for n, _, _, cpu in waits),
        call_compute_s=call))


def _with_whole_step(device: GPU, measured_step: float | None,
                     concurrent: list[tuple[int, float]]) -> GPU:
    """The calibration model's measured step against the time model's sum of parts on the
    profile measured so far (tetrad.calibrate.step), and how ranks at once slow it down."""
    if measured_step is None:
        return device
    predicted = predicted_step_seconds(device)
    alone = dict(concurrent).get(1)
    efficiency = replace(
        device.efficiency, step_scale=measured_step / predicted,
        concurrent_slowdown=tuple((n, seconds / alone) for n, seconds in concurrent
                                  if n > 1) if alone else ())
    return replace(device, efficiency=efficiency)


def _single_device(timer: compute.Timer, device_type: str, show_progress: bool) -> dict:
    steps = ["peaks", "matmul curve", "attention", "bandwidth", "operators", "optimizer",
             "host copies"]
    if device_type == "cpu":  # the calibration model trains on CPU only
        steps.append("training step")
    progress = tqdm(steps, desc="calibrate compute", disable=not show_progress,
                    dynamic_ncols=True, leave=False)
    out: dict = {}
    for step in progress:
        progress.set_postfix_str(step)
        if step == "peaks":
            out["peaks"] = {name: compute.peak_matmul(timer, dtype, PEAK_SIZES[device_type])
                            for name, dtype in DTYPES.items()}
        elif step == "matmul curve":
            out["matmul"] = compute.matmul_points(timer, DTYPES[CURVE_DTYPES[device_type]])
        elif step == "attention":
            out["attention"] = compute.attention_points(
                timer, ATTENTION_SHAPES[device_type], DTYPES[CURVE_DTYPES[device_type]])
        elif step == "bandwidth":
            out["bandwidth"] = compute.stream_bandwidth(timer)
        elif step == "operators":
            out["operators"] = compute.operator_costs(timer)
        elif step == "optimizer":
            out["optimizer"] = compute.optimizer_costs(timer, out["bandwidth"])
        elif step == "host copies":
            out["host_copy"] = compute.host_copy_costs(timer)
        else:
            out["step"] = step_seconds(training_step())
    progress.close()
    return out


def _collectives(ranks: int, device_type: str, show_progress: bool, rounds: int
                 ) -> tuple[list, list, list, float]:
    """gloo on CPU, NCCL with a GPU per rank: spawned ranks pick their backend by the GPUs they
    see, so a CPU calibration hides them."""
    from tetrad.train.launch import spawn

    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device_type == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        return spawn(measure, ranks, (show_progress, rounds), timeout_s=600)[0]
    finally:
        if hidden is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden


def matmul_curve(points: list[tuple[float, float]], peak: float, device_type: str = "cpu"
                 ) -> tuple[tuple[float, float], ...]:
    """Efficiency per GEMM size from (FLOPs, seconds); the first point, a 1x1x1 product, is the
    call's fixed cost, which the planner counts per operator instead. On a GPU, products that
    took less than twice that cost are left out: they are all launch, and what remains of them
    after it is noise (an H100 read 0.995 of peak off a 1 GFLOP product so)."""
    fixed = points[0][1]
    shortest = 2 * fixed if device_type == "cuda" else 0.0
    curve = []
    for flops, seconds in points[1:]:
        if seconds < shortest:
            continue
        work = max(seconds - fixed, seconds * 0.05)
        curve.append((flops, min(1.0, flops / work / peak)))
    return tuple(curve)


def _profile(device_type: str, single: dict, fits: list) -> GPU:
    peaks = single["peaks"]
    bandwidth = single["bandwidth"]
    forward_op, backward_op = single["operators"]
    per_tensor, optimizer_rate = single["optimizer"]
    attention_flops, attention_s = single["attention"][-1]
    p2p = next(((alpha, beta) for kind, _, alpha, beta in fits if kind == "p2p"), None)
    catalog = gpu_from_device_name(torch.cuda.get_device_name()) if device_type == "cuda" \
        else None
    reference = dict(catalog.peak_flops) if catalog else {
        name: value for name, value in peaks.items()}
    curve_dtype = CURVE_DTYPES[device_type]
    curve = matmul_curve(single["matmul"], reference.get(curve_dtype, peaks[curve_dtype]),
                         device_type)
    attention = min(1.0, attention_flops / attention_s / reference["bf16"])
    # A catalog GPU keeps its datasheet bandwidths: the measured rates become its fractions.
    nominal = catalog.memory_bandwidth if catalog else bandwidth
    links = catalog.efficiency if catalog and not fits else None
    efficiency = EfficiencyProfile(
        matmul=max(value for _, value in curve),
        # The planner prices attention against the bf16 peak (compute.attention_times); SDPA is
        # both the fused kernel and the portable one here.
        attention=attention, portable_attention=attention,
        memory=min(1.0, bandwidth / nominal), kernel_overhead_s=0.0,
        intra_link=links.intra_link if links else 1.0,
        inter_link=links.inter_link if links else 1.0,
        intra_latency_s=links.intra_latency_s if links else (p2p[0] if p2p else 0.0),
        inter_latency_s=links.inter_latency_s if links else (p2p[0] if p2p else 0.0),
        matmul_curve=curve, op_forward_s=forward_op, op_backward_s=backward_op,
        optimizer_tensor_s=per_tensor, optimizer_memory=min(1.0, optimizer_rate / nominal),
        host_copy_s=single["host_copy"][0], host_copy_bandwidth=single["host_copy"][1],
        collectives=tuple(fits),
        concurrent_ranks=_cores() if device_type == "cpu" else 0)
    if catalog:
        return replace(catalog, name=f"{catalog.name}-calibrated", efficiency=efficiency,
                       aliases=(), source=f"tetrad calibrate on {torch.cuda.get_device_name()}")
    # gloo between processes of one machine: the links are its memory, at the p2p fit's rate.
    link = 1.0 / p2p[1] if p2p and p2p[1] > 0 else bandwidth
    if device_type == "cpu":
        memory, described = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), _cpu_name()
    else:
        memory = torch.cuda.get_device_properties(0).total_memory
        described = torch.cuda.get_device_name()
    return GPU(name=f"{device_type}-{platform.node() or 'local'}", peak_flops=reference,
               memory_bytes=float(memory), memory_bandwidth=bandwidth, nvlink_bandwidth=0.0,
               pcie_bandwidth=link, nic_bandwidth=0.0, host_memory_bandwidth=bandwidth,
               efficiency=efficiency,
               source=f"tetrad calibrate on {described} ({_cores()} cores)")
