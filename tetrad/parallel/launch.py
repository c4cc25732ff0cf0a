"""Starting the processes of a distributed job, for training and serving alike.

`WorkerProcesses` starts ranks on this machine (the spawn start method) around a rendezvous store
this process hosts on a free port (no port guessing, no races). Each rank joins the one process
group (NCCL on a GPU of its own, gloo otherwise), runs its function, and puts its outcome on one
queue: its return value, or its error (one line for a TetradError, the traceback otherwise).
`spawn` runs a function on N such ranks and waits for them (`tetrad train --nproc N`, the
multi-rank tests); a tensor-parallel LLM is itself rank 0 and starts ranks 1..tp-1. Under torchrun
(one node or many) the same worker code runs in the processes torchrun started (`init_worker`).

A failing rank takes the whole job down at once: its report reaches the parent, which stops the
other ranks (they would otherwise sit in a collective waiting for the dead one) and raises an
error naming the rank. Collectives time out too, so nothing waits forever. The one exception:
ranks the caller calls expendable (parameter-server workers in async and ssp mode), which the
job goes on without (docs/parameter_server.md). With `forward_signals` (`tetrad train`), the
first SIGINT or SIGTERM the launcher receives goes on to every rank, which stop together after a
step and save it (tetrad.train.stop); a second one stops the ranks and the launcher at once.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from tetrad.errors import ConfigError, TetradError

HOST = "127.0.0.1"
COLLECTIVE_TIMEOUT_S = 300.0  # a collective waiting longer than this means a rank is gone
STARTED_KEY = "tetrad/started"  # set by each started rank once torch is imported


class WorkerFailed(TetradError):
    """A worker raised or died; the message names its rank and carries its error."""


def local_device(local_rank: int, local_world_size: int, requested: str = "auto"
                 ) -> torch.device:
    """The device of local rank `local_rank` of `local_world_size` on this machine. "auto":
    cuda:local_rank when every local rank can have a GPU of its own, else the CPU for all of them
    (one backend per job: gloo cannot talk to NCCL); "cpu": the CPU even beside GPUs; "cuda": a
    GPU of its own, or a ConfigError saying why there is none."""
    if requested == "cpu":
        return torch.device("cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= local_world_size:
        return torch.device("cuda", local_rank)
    if requested == "cuda" and gpus == 0:
        raise ConfigError("--device cuda needs a GPU and torch sees none: use --device cpu")
    if requested == "cuda":
        raise ConfigError(f"--device cuda needs one GPU per local rank: {local_world_size} ranks "
                          f"on this machine but {gpus} GPUs: lower --nproc to {gpus}, or use "
                          f"--device cpu")
    return torch.device("cpu")


def rank_device() -> torch.device:
    """The device this rank computes on: the GPU its NCCL process group was set up on
    (init_worker's torch.cuda.set_device), the CPU under gloo or without a process group."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_worker(rank: int, world_size: int, local_rank: int, local_world_size: int,
                timeout_s: float, store: dist.Store | None = None, threads: int = 1,
                device: torch.device | None = None) -> torch.device:
    """Join the job's process group: `threads` threads (the cores are shared), NCCL on a GPU of
    its own, gloo otherwise; `device` overrides local_device's choice."""
    torch.set_num_threads(threads)
    device = device or local_device(local_rank, local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if store is None:  # started by torchrun: rendezvous from its MASTER_ADDR / MASTER_PORT
        dist.init_process_group(backend, init_method="env://", rank=rank,
                                world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    return device


def started_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def torchrun_ranks() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) as torchrun sets them."""
    world_size = int(os.environ["WORLD_SIZE"])
    return (int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def error_report(error: BaseException) -> str:
    """What a rank tells the parent: one line for a user error, else the whole traceback."""
    return (f"{type(error).__name__}: {error}" if isinstance(error, TetradError)
            else traceback.format_exc().strip())


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, timeout_s: float,
               args: tuple, reports: multiprocessing.Queue, threads: int,
               device_type: str | None, ignore_interrupts: bool) -> None:
    if ignore_interrupts:  # Ctrl-C reaches the terminal's whole process group; the parent decides
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        store = dist.TCPStore(HOST, port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        store.set(f"{STARTED_KEY}/{rank}", "1")
        device = None if device_type is None else torch.device(
            device_type, rank if device_type == "cuda" else None)
        init_worker(rank, world_size, rank, world_size, timeout_s, store, threads, device)
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)  # tensors travel as bytes, not as shared-memory handles
        reports.put((rank, "ok", buffer.getvalue()))
    except BaseException as error:  # noqa: BLE001 - everything must reach the parent
        reports.put((rank, "error", error_report(error)))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerProcesses:
    """Ranks `ranks` of a `world_size` job, started by this process: each runs
    `fn(rank, world_size, *args)` and reports on `reports` as (rank, "ok", value bytes) or
    (rank, "error", message). This process hosts the rendezvous `store`; when it is a rank
    itself (rank 0 of a tensor-parallel engine) it joins with `init_worker(..., store=store)`.
    `device_type` None lets each rank pick (local_device); "cpu" or "cuda" (rank r on cuda:r)
    decides for all."""

    def __init__(self, fn: Callable, ranks: Iterable[int], world_size: int, args: tuple = (),
                 threads: int = 1, device_type: str | None = None,
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 ignore_interrupts: bool = False):
        context = multiprocessing.get_context("spawn")
        self.store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=collective_timeout_s))
        self.reports = context.Queue()
        self.ranks = list(ranks)
        self.processes = [
            context.Process(target=_rank_main, name=f"tetrad-rank{rank}", daemon=True,
                            args=(fn, rank, world_size, self.store.port, collective_timeout_s,
                                  args, self.reports, threads, device_type, ignore_interrupts))
            for rank in self.ranks]
        for process in self.processes:
            process.start()

    def exit_codes(self) -> dict[int, int | None]:
        return {rank: process.exitcode for rank, process in zip(self.ranks, self.processes)}

    def wait_started(self, timeout_s: float) -> None:
        """Until every rank has imported torch and reached the rendezvous. One that dies first (a
        bad environment) fails the start here, not after the process group's timeout."""
        keys = [f"{STARTED_KEY}/{rank}" for rank in self.ranks]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if any(code is not None for code in self.exit_codes().values()):
                raise WorkerFailed("a rank exited while starting")
            if time.monotonic() > deadline:
                raise WorkerFailed(f"ranks did not start within {timeout_s:.0f} s")
            time.sleep(0.05)

    def first_failure(self, wait_s: float) -> str | None:
        """The first error a rank reported, waiting up to `wait_s` for one to arrive; else a
        rank that died without one; None when every rank is alive and silent."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                rank, status, payload = self.reports.get(timeout=0.05)
                if status == "error":
                    return f"rank {rank} failed: {payload}"
            except queue.Empty:
                if time.monotonic() > deadline:
                    break
        for rank, code in self.exit_codes().items():
            if code is not None:
                return f"rank {rank} died with exit code {code} and no error report"
        return None

    def stop(self, grace_s: float) -> None:
        """Let the ranks exit for `grace_s`, terminate what is still running (after a failure:
        the ranks stuck waiting for the failed one), then reap."""
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


@contextlib.contextmanager
def forwarding_stop_signals(processes: list) -> Iterator[None]:
    """While the ranks run: the first SIGINT or SIGTERM is sent on to each of them; a second
    raises here (KeyboardInterrupt, or SystemExit with 128 + the signal), which stops them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def forward(signum: int, frame) -> None:
        if received:
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
        received.append(signum)
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    previous = {signum: signal.signal(signum, forward)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def spawn(fn: Callable, nprocs: int, args: tuple = (), timeout_s: float | None = None,
          collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
          expendable: frozenset[int] = frozenset(), device_type: str | None = None,
          forward_signals: bool = False) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `nprocs` fresh processes joined in one process group,
    and return each rank's return value in rank order. `fn` must be importable by name. Raises
    WorkerFailed as soon as one worker fails, and after `timeout_s` (None: no limit on the whole
    job; the collective timeout still catches a hang). The ranks in `expendable` may fail or
    die: their error goes to stderr, their value is None, and the job returns once every other
    rank has returned. `device_type` as WorkerProcesses'; `forward_signals`: the ranks get this
    process's SIGINT and SIGTERM (forwarding_stop_signals)."""
    workers = WorkerProcesses(fn, range(nprocs), nprocs, args, device_type=device_type,
                              collective_timeout_s=collective_timeout_s)
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with (forwarding_stop_signals(workers.processes) if forward_signals
              else contextlib.nullcontext()):
            values = _collect(workers.processes, workers.reports, deadline, expendable)
    except BaseException:
        workers.stop(grace_s=0)
        raise
    workers.stop(grace_s=10)  # they are tearing their process groups down
    return values


def _collect(workers: list, results: multiprocessing.Queue, deadline: float | None,
             expendable: frozenset[int]) -> list[Any]:
    values: dict[int, Any] = {}
    needed = [rank for rank in range(len(workers)) if rank not in expendable]
    while any(rank not in values for rank in needed):
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            # An expendable rank that exits with code 0 and no result (os._exit) is dead too.
            dead = [rank for rank, worker in enumerate(workers)
                    if rank not in values and worker.exitcode not in (None, 0)
                    or rank in expendable and rank not in values and worker.exitcode == 0]
            if dead:
                # Its error report may still be in flight: give it a moment to arrive.
                try:
                    rank, status, payload = results.get(timeout=2.0)
                except queue.Empty:
                    message = (f"rank {dead[0]} died with exit code {workers[dead[0]].exitcode} "
                               f"and no error report")
                    if dead[0] not in expendable:
                        raise WorkerFailed(message) from None
                    rank, status, payload = dead[0], "error", message
            elif deadline is not None and time.monotonic() > deadline:
                missing = [rank for rank in needed if rank not in values]
                raise WorkerFailed(f"timed out waiting for ranks {missing}")
            else:
                continue
        if status == "error":
            if rank not in expendable:
                dead = _silently_dead(workers, values, expendable, rank)
                if dead is not None:  # the root cause; `rank` only lost its peer
                    raise WorkerFailed(
                        f"rank {dead} died with exit code {workers[dead].exitcode} and no error "
                        f"report (then rank {rank} failed: {payload.strip()})")
                raise WorkerFailed(f"rank {rank} failed: {payload.strip()}")
            print(f"rank {rank} stopped, the run goes on without it: {payload.strip()}",
                  file=sys.stderr)
            values[rank] = None
            continue
        values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    # Expendable ranks still running are stopped by the caller's _stop.
    return [values.get(rank) for rank in range(len(workers))]


def _silently_dead(workers: list, values: dict[int, Any], expendable: frozenset[int],
                   reporting: int, grace_s: float = 0.2) -> int | None:
    """A needed rank other than `reporting` that died without a report (killed by a signal, say):
    when a rank's collective fails because its peer vanished, the peer is what to name. Waits up
    to `grace_s` for such a death to be seen."""
    deadline = time.monotonic() + grace_s
    while True:
        for rank, worker in enumerate(workers):
            if (rank != reporting and rank not in values and rank not in expendable
                    and worker.exitcode not in (None, 0, 1)):
                return rank
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)
