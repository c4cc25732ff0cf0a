"""Alpha-beta fits of every collective by group size, and of point-to-point sends, measured on
spawned ranks of this machine (gloo on CPU, NCCL with a GPU per rank).

For each group size n (2, 4, ... up to the ranks started) the first n ranks form a group and time
each collective at a few message sizes while the others wait; time = alpha + beta * bytes is fitted
by least squares on the medians (bytes: the full tensor the call is handed, as the planner's
ledger counts its payload). Rank 0 draws the progress bar.
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from tetrad.parallel.comm import all_gather_single, reduce_scatter_single

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")
MESSAGE_BYTES = (256, 64 * 1024, 1024 * 1024)  # latency-bound to bandwidth-bound
REPS = 12


def group_sizes(world_size: int) -> list[int]:
    sizes, size = [], 2
    while size <= world_size:
        sizes.append(size)
        size *= 2
    if world_size >= 2 and world_size not in sizes:
        sizes.append(world_size)
    return sizes


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of seconds = alpha + beta * bytes over (bytes, seconds), both kept >= 0."""
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    beta = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread) if spread \
        else 0.0
    alpha = max(0.0, mean_y - beta * mean_x)
    return alpha, beta


def collective_call(kind: str, size: int, tensor: torch.Tensor, group) -> Callable[[], None]:
    """One call of `kind` handed `tensor` whole (the input of reduce-scatter, the output of
    all-gather), its other buffers made beforehand so only the call is timed."""
    shard = torch.empty(tensor.numel() // size, device=tensor.device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(tensor, group=group)
    if kind == "reduce_scatter":
        return lambda: reduce_scatter_single(shard, tensor, group=group)
    if kind == "all_gather":
        return lambda: all_gather_single(tensor, shard, group=group)
    if kind == "all_to_all":
        received = torch.empty_like(tensor)
        return lambda: dist.all_to_all_single(received, tensor, group=group)
    return lambda: dist.broadcast(tensor, src=0, group=group)


def _median_time(fn, device: torch.device, group) -> float:
    times = []
    for rep in range(REPS + 2):
        dist.barrier(group=group)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep >= 2:  # the first calls set up connections and buffers
            times.append(time.perf_counter() - started)
    # The slowest rank decides when a collective is over.
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest)


ROUNDS = 3  # the shared-machine measurements below, repeated in turn; each point their median


def concurrent_steps(rank: int, sizes: list[int]) -> list[tuple[int, float]]:
    """(n, seconds) of the calibration model's training step (tetrad.calibrate.step) while the
    first n ranks run it at once, each on its own, the others waiting: the slowest rank's
    median, so the step of 1 rank alone is the reference. ROUNDS rounds over every n in turn,
    so that a change of the machine's load mid-way falls on every n alike."""
    from tetrad.calibrate.step import step_seconds, training_step

    step = training_step()
    rounds: dict[int, list[float]] = {n: [] for n in [1, *sizes]}
    for _ in range(ROUNDS):
        for n in rounds:
            dist.barrier()
            seconds = torch.tensor([step_seconds(step) if rank < n else 0.0],
                                   dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            rounds[n].append(float(seconds))
    return [(n, statistics.median(times)) for n, times in rounds.items()]


SYNC_CALLS = 20


def cpu_seconds() -> float:
    """CPU time of this process so far, all its threads (the backend's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def sync_waits(rank: int, world_size: int, sizes: list[int]
               ) -> list[tuple[int, float, float, float]]:
    """(n, wait, back-to-back wait, CPU): with the first n ranks each alternating the calibration
    model's forward and a 256-byte all-reduce with its neighbour (ranks 0-1, 2-3, ...), what a
    call costs beyond the compute (the same loop without the calls, run by the same ranks at
    once); what it costs with no compute between the calls (their own latency included in
    both); and the CPU time a call adds to its rank's process in the first loop (the mean over
    the ranks). The waits are the slowest rank's; each value the median of ROUNDS rounds over
    every n in turn. The compute between the calls lasts as long as a training step's between
    two of its collectives (milliseconds), long enough for a waiting rank's threads to be put to
    sleep and to need waking again. Beyond the cores the waits move by 1.5-3x between
    repeats; the CPU time much less (docs/planner.md), which is what prices calls there."""
    from tetrad.calibrate.step import forward_pass

    pairs = [dist.new_group([first, first + 1]) for first in range(0, world_size - 1, 2)]
    forward = forward_pass()
    message = torch.ones(64)

    def loop(compute: bool, calls: bool) -> tuple[float, float]:
        """(wall, CPU) seconds per iteration."""
        started, cpu = time.perf_counter(), cpu_seconds()
        for _ in range(SYNC_CALLS):
            if compute:
                forward()
            if calls:
                dist.all_reduce(message, group=pairs[rank // 2])
        return ((time.perf_counter() - started) / SYNC_CALLS,
                (cpu_seconds() - cpu) / SYNC_CALLS)

    rounds: dict[int, list[tuple[float, ...]]] = {n: [] for n in sizes}
    for _ in range(ROUNDS):
        for n in sizes:
            measured, cpu = (0.0, 0.0), 0.0
            if rank < n:
                loop(True, True)
                (with_calls, cpu_with), (without, cpu_without) = loop(True, True), loop(True, False)
                measured = (with_calls - without, loop(False, True)[0])
                cpu = (cpu_with - cpu_without) / n
            slowest = torch.tensor(measured, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            mean_cpu = torch.tensor([cpu], dtype=torch.float64)
            dist.all_reduce(mean_cpu)
            rounds[n].append(tuple(max(0.0, float(value)) for value in (*slowest, *mean_cpu)))
    return [(n, *(statistics.median(values) for values in zip(*measured)))
            for n, measured in rounds.items()]


CALL_STEPS = 10


def call_compute(rank: int) -> float:
    """Seconds of a rank's time outside the wait that one collective call between computations
    costs: ranks 0 and 1 each run the calibration model's forward and backward with a 256-byte
    all-reduce through tetrad's call layer (tetrad.parallel.comm.Comm) after every attention and
    MLP, in the forward and again in the backward (where tensor parallelism's calls sit), and
    the same steps without the calls; the extra time less the waits Comm times, per call. It is
    the call layer's own host work and the compute after a wait running slower (its caches taken
    meanwhile, gloo's threads on the same cores). The slowest rank's, the median of ROUNDS
    rounds; the other ranks wait."""
    from tetrad.calibrate.step import calibration_model
    from tetrad.parallel.comm import Comm, CommCounter
    from tetrad.parallel.mesh import Group

    pair = dist.new_group([0, 1])
    if rank > 1:
        dist.barrier()
        slowest = torch.zeros(1, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest)
    _, model, batch = calibration_model()
    group = Group("calibration pair", (0, 1), rank, pair)
    message = torch.ones(64)
    calling = [False]
    comm = Comm(CommCounter())

    def call() -> None:
        if calling[0]:
            comm.all_reduce(message, group, "calibration")

    def between(module, inputs, output):
        call()
        if output.requires_grad:
            output.register_hook(lambda grad: call())
        return output

    for block in model.layers:
        block.attn.register_forward_hook(between)
        block.mlp.register_forward_hook(between)
    calls_per_step = 4 * len(model.layers)

    def steps(calls: bool) -> tuple[float, float]:
        """(median step, median waits of a step) over CALL_STEPS steps after a warm-up one."""
        calling[0] = calls
        comm.counter.reset()
        times = []
        for _ in range(CALL_STEPS + 1):
            started = time.perf_counter()
            model.zero_grad(set_to_none=True)
            model(batch[:, :-1]).mean().backward()
            times.append(time.perf_counter() - started)
            comm.counter.end_step()
        exposed = comm.counter.exposed_per_step()
        return statistics.median(times[1:]), exposed[0] if calls and exposed else 0.0

    per_call = []
    for _ in range(ROUNDS):
        dist.barrier(group=pair)
        alone, _ = steps(False)
        dist.barrier(group=pair)
        with_calls, waits = steps(True)
        per_call.append((with_calls - alone - waits) / calls_per_step)
    dist.barrier()
    slowest = torch.tensor([statistics.median(per_call)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return max(0.0, float(slowest))


def measure(rank: int, world_size: int, show_progress: bool, rounds: int = ROUNDS
            ) -> tuple[list[tuple[str, int, float, float]], list[tuple[int, float]],
                       list[tuple[int, float, float, float]], float]:
    """Every rank runs this (tetrad.train.launch.spawn); returns (kind, n, alpha, beta) fits
    (each point the median of `rounds` rounds), the concurrent steps' (n, seconds), the
    collective calls' waits (sync_waits) and their compute outside the wait (call_compute)."""
    from tqdm import tqdm

    from tetrad.train.launch import local_device

    device = local_device(rank, world_size)  # what the spawned rank's backend was chosen for
    sizes = group_sizes(world_size)
    tasks = [(n, kind) for n in sizes for kind in KINDS] + [(2, "p2p")]
    progress = tqdm(total=len(tasks) * rounds, desc="calibrate collectives",
                    disable=not (show_progress and rank == 0), dynamic_ncols=True, leave=False)
    groups = {n: dist.new_group(list(range(n))) for n in sizes}
    # Rounds over every task in turn, each point the median of its rounds: one round's
    # fits moved by 2x between calibrations of a quiet machine (an all-reduce over 2 ranks at
    # 1 MiB: 0.87-1.73 ms), more than the layouts it prices did.
    seconds: dict[tuple[int, str], list[list[float]]] = {
        task: [[] for _ in MESSAGE_BYTES] for task in tasks}
    for _ in range(rounds):
        for n, kind in tasks:
            progress.set_postfix_str(f"{kind} over {n}")
            for index, nbytes in enumerate(MESSAGE_BYTES):
                if rank < n:
                    tensor = torch.ones(_numel(nbytes, n), device=device)
                    seconds[n, kind][index].append(
                        _p2p_time(rank, tensor, device, groups[2]) if kind == "p2p" else
                        _median_time(collective_call(kind, n, tensor, groups[n]), device,
                                     groups[n]))
            dist.barrier()
            progress.update()
    fits = [(kind, n, *fit_alpha_beta([(_numel(nbytes, n) * 4.0, statistics.median(times))
                                       for nbytes, times in zip(MESSAGE_BYTES, seconds[n, kind],
                                                                strict=True)]))
            for n, kind in tasks] if rank == 0 else []
    progress.close()
    if device.type != "cpu":
        return fits, [], [], 0.0
    even = [n for n in sizes if n % 2 == 0]
    return (fits, concurrent_steps(rank, sizes), sync_waits(rank, world_size, even),
            call_compute(rank))


def _numel(nbytes: int, n: int) -> int:
    """fp32 elements of a message of about `nbytes`, a multiple of the group size."""
    return max(n, nbytes // 4 // n * n)


def ping_pong(rank: int, tensor: torch.Tensor) -> None:
    """`tensor` from rank 0 to rank 1 and back (the other ranks take no part)."""
    if rank == 0:
        dist.send(tensor, 1)
        dist.recv(tensor, 1)
    elif rank == 1:
        dist.recv(tensor, 0)
        dist.send(tensor, 0)


def _p2p_time(rank: int, tensor: torch.Tensor, device: torch.device, group) -> float:
    """One message from rank 0 to rank 1: half a round trip."""
    return _median_time(lambda: ping_pong(rank, tensor), device, group) / 2
