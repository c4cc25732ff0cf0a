"""Tensor-parallel decoding (`LLM(path, tp=2)`, `tetrad serve PATH --tp 2`): the engine's model
split over tp ranks with the training code's layers (tetrad.parallel.tensor_parallel: attention by
heads, the MLP by hidden units, embedding and head by vocabulary rows), each rank holding 1/tp of
the weights and a KV pool of its own kv heads (a kv head is replicated on tp / num_kv_heads ranks
when there are fewer kv heads than ranks).

Rank 0 is the process that made the LLM: the scheduler, block manager and sampler run there only,
unchanged. Each step:
  1. rank 0 broadcasts the step (runner.StepPlan: a header of sizes, then one int64 row of token
     ids, starts, token counts, sample flags, block tables and block copies) on the control group;
  2. every rank does the block copies on its own pool and runs the same forward in lockstep: the
     embedding and each layer's attention and MLP end in an all-reduce over mesh["tp"];
  3. every other rank sends its vocabulary slice of the logits [samples, vocab / tp] to rank 0,
     which concatenates them (rank order is vocabulary order) and samples.

The control group is gloo on the CPU (a step is host data), with a timeout that never fires: the
other ranks wait there for as long as the engine is idle. The model's collectives run on
mesh["tp"] (NCCL on GPUs) under the collective timeout. A rank that dies closes its sockets, so
the others' next collective fails at once; rank 0 then reports the dead rank's traceback (workers
send it on a queue), stops the rest and refuses further steps.

Started without a process group, LLM starts ranks 1..tp-1 itself with the launcher `tetrad train`
uses too (tetrad.parallel.launch: spawn start method, rank 0 hosts the rendezvous store, errors
come back on one queue) and owns the process group; each worker loads the model folder itself
(a model object travels to it pickled). Inside a process group of exactly tp ranks (torchrun, the
tests) LLM runs on rank 0 and every other rank runs `TensorParallelWorker(model).serve()`.
"""

from __future__ import annotations

import datetime
import multiprocessing
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from tetrad.config import ParallelConfig
from tetrad.errors import ConfigError, TetradError
from tetrad.inference.kv_cache import TORCH_DTYPES, KVPlan
from tetrad.inference.runner import StepPlan, load_runner
from tetrad.models.hf import load_pretrained
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.launch import COLLECTIVE_TIMEOUT_S, WorkerProcesses, init_worker
from tetrad.parallel.mesh import Group, build_mesh
from tetrad.parallel.tensor_parallel import apply_tensor_parallel, check_tensor_parallel

if TYPE_CHECKING:
    from tetrad.inference.config import EngineConfig

IDLE_TIMEOUT = datetime.timedelta(days=365)  # the control group's: an idle engine waits forever
REPORT_WAIT_S = 2.0  # after a failed collective, how long rank 0 waits for a worker's traceback
STOP_GRACE_S = 10.0  # how long closed workers get to exit before they are terminated
STOP, STEP = 0, 1
HEADER_SIZE = 7  # [STOP or STEP, *StepPlan.sizes()]
# Comm tags: the step broadcast, the logits sent to rank 0, the start-up exchanges. The model's
# all-reduces carry tensor parallelism's own tag, "activations".
STEP_TAG, LOGITS_TAG, SETUP_TAG = "step", "logits", "setup"


class TensorParallelError(TetradError):
    """A tensor-parallel rank failed: the message names it and carries its error."""


def device_type(device: str, tp: int) -> str:
    """Where the ranks compute: "cuda" (rank r on cuda:r) when the machine has a GPU per rank,
    "cpu" when it has none or --device cpu says so."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.startswith("cuda:"):
        raise ConfigError(f"--device {device} names one GPU, but with --tp {tp} rank r runs on "
                          f"cuda:r: use --device cuda")
    if device == "cpu" or (device == "auto" and gpus == 0):
        return "cpu"
    if gpus < tp:
        raise ConfigError(f"--tp {tp} needs {tp} GPUs (one per rank), torch sees {gpus}: lower "
                          f"--tp or use --device cpu")
    return "cuda"


class TensorParallelRanks:
    """This rank's place in a process group that spans exactly the engine's tp ranks: the mesh
    of the distributed core (ParallelConfig(tp=world size); mesh["tp"] carries the model's
    collectives and the logits), the control group (the step messages), the Comm that counts
    every byte, and the device. Collective: every rank constructs it, in the same order."""

    def __init__(self, device: torch.device | None = None):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.mesh = build_mesh(ParallelConfig(tp=world), rank, world)
        ranks = list(range(world))
        self.control = Group("control", tuple(ranks), rank,
                             dist.new_group(ranks, timeout=IDLE_TIMEOUT, backend="gloo"))
        self.comm = Comm(CommCounter())
        if device is None:  # in a process group someone else started: its backend decides
            device = (torch.device("cuda", torch.cuda.current_device())
                      if dist.get_backend() == "nccl" else torch.device("cpu"))
        self.device = device

    @property
    def group(self) -> Group:
        return self.mesh["tp"]

    @property
    def size(self) -> int:
        return self.group.size

    def share(self, value):
        """Rank 0's `value` on every rank (the others pass None)."""
        return self.comm.all_gather_object(value, self.control, SETUP_TAG)[0]

    def shard(self, model: nn.Module) -> nn.Module:
        """This rank's share of the whole `model`, whose layers are replaced in place."""
        apply_tensor_parallel(model, self.mesh, self.comm)
        return model

    def agree(self, plan: KVPlan) -> KVPlan:
        """Every rank's pool gets the blocks the tightest rank can hold (on GPUs each rank sized
        its pool from its own free memory): the block ids rank 0 hands out must exist on all."""
        blocks = self.comm.all_gather_object(plan.num_blocks, self.control, SETUP_TAG)
        return plan.with_blocks(min(blocks))

    def close(self) -> None:
        dist.destroy_process_group(self.control.handle)


class TensorParallelDriver:
    """Rank 0 of a tensor-parallel engine: starts the other ranks (or joins the process group
    they are in), holds its share of the model and KV pool (`runner`, `kv_plan`), and runs every
    step on all ranks. After a failure it stops the other ranks and refuses to step again: the
    ranks may have been left inside different collectives."""

    # The process group a driver of this process started, while it is open: torch.distributed
    # has one default group per process, so a second engine could only join the first's ranks.
    _spawned_world: ClassVar[TensorParallelDriver | None] = None

    def __init__(self, model: nn.Module, source: nn.Module | str, config: EngineConfig,
                 max_model_len: int):
        """`model`: the whole model, split in place; `source`: what spawned workers load (a
        folder) or receive pickled (a model object)."""
        check_tensor_parallel(model.config, config.tp)
        if model.config.attention == "mla" and config.tp > 1:  # training splits it (issue 16.2)
            raise ConfigError("tensor-parallel serving does not split multi-head latent "
                              "attention (MLA) yet: serve this model with tp 1")
        self.workers: list[multiprocessing.Process] = []
        self._started: WorkerProcesses | None = None
        self._owns_world = False
        self.ranks: TensorParallelRanks | None = None
        self.failure: BaseException | None = None
        self.closed = False
        if dist.is_initialized():
            self._check_joinable(config.tp)
            device = None
        else:
            device = torch.device(device_type(config.device, config.tp), 0)
            self._spawn(config.tp, source, device)
        try:
            self.ranks = TensorParallelRanks(device)
            self.ranks.share((config, max_model_len))
            self.runner, self.kv_plan = load_runner(model, config, max_model_len,
                                                    self.ranks.device, self.ranks)
        except BaseException as error:
            self._fail(error)

    def _check_joinable(self, tp: int) -> None:
        if TensorParallelDriver._spawned_world is not None:
            raise ConfigError("this process already runs a tensor-parallel LLM that started its "
                              "own ranks: close() it (or use it in a with block) before starting "
                              "another")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != tp:
            raise ConfigError(f"torch.distributed runs {world} ranks but tp is {tp}: a "
                              f"tensor-parallel engine spans its whole process group; start "
                              f"{tp} ranks, or create the LLM without a process group and it "
                              f"starts its own")
        if rank != 0:
            raise ConfigError(f"this is rank {rank}: the LLM runs on rank 0; the other ranks run "
                              f"tetrad.inference.tp.TensorParallelWorker(model).serve()")

    def _spawn(self, tp: int, source: nn.Module | str, device: torch.device) -> None:
        threads = torch.get_num_threads()
        if device.type == "cpu":  # the ranks share the cores
            threads = max(1, threads // tp)
            torch.set_num_threads(threads)
        self._started = WorkerProcesses(_serve_rank, range(1, tp), tp, (source,), threads,
                                        device.type, ignore_interrupts=True)
        self.workers = self._started.processes
        try:
            self._started.wait_started(COLLECTIVE_TIMEOUT_S)
            init_worker(0, tp, 0, tp, COLLECTIVE_TIMEOUT_S, self._started.store, threads, device)
        except BaseException as error:
            self._fail(error)
        self._owns_world = True
        TensorParallelDriver._spawned_world = self

    # ---- steps ---------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run `plan` on every rank; the whole logits [samples, vocab] (rank 0 samples)."""
        if self.failure is not None or self.closed:
            raise TensorParallelError(
                "the tensor-parallel engine is closed" if self.failure is None else
                f"the tensor-parallel engine stopped after an error: {self.failure}")
        if any(worker.exitcode is not None for worker in self.workers):
            self._fail(None)
        try:
            with _interrupts_held(), torch.inference_mode():
                self._send(STEP, plan.sizes(), plan.payload())
                return self._gather(self.runner.execute(plan))
        except Exception as error:
            self._fail(error)

    def _send(self, kind: int, sizes: list[int], payload: list[int]) -> None:
        comm, control = self.ranks.comm, self.ranks.control
        comm.broadcast(torch.tensor([kind, *sizes], dtype=torch.long), 0, control, STEP_TAG)
        if kind == STEP:
            comm.broadcast(torch.tensor(payload, dtype=torch.long), 0, control, STEP_TAG)

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """local: this rank's logits [samples, vocab / tp] -> [samples, vocab]."""
        if not local.shape[0]:  # nothing samples this step: the workers send nothing either
            return local.new_empty((0, local.shape[1] * self.ranks.size))
        pieces = [local] + [torch.empty_like(local) for _ in range(1, self.ranks.size)]
        handles = [self.ranks.comm.recv(piece, rank, self.ranks.group)
                   for rank, piece in enumerate(pieces) if rank]
        for handle in handles:
            handle.wait()
        return torch.cat(pieces, dim=-1)  # ranks hold consecutive vocabulary slices in order

    # ---- failure and shutdown ------------------------------------------------------------------

    def _fail(self, error: BaseException | None) -> NoReturn:
        """Rank 0's start or step failed with `error` (None: a worker was found dead before the
        step): blame the worker that reported an error or died, if one did (its failure usually
        surfaces on rank 0 as a broken collective), stop every rank and raise."""
        failure = self._worker_failure() or error
        self.failure = failure
        self._shutdown(grace_s=0)
        if failure is error:
            raise error
        raise failure from error

    def _worker_failure(self) -> TensorParallelError | None:
        """The first error a worker reported (waiting REPORT_WAIT_S for it), else a worker that
        died without one; None when every worker is alive and silent."""
        failure = self._started and self._started.first_failure(REPORT_WAIT_S)
        return TensorParallelError(f"tensor-parallel {failure}") if failure else None

    def close(self) -> None:
        """Tell the other ranks to exit, wait for them, and close the groups this engine made."""
        if self.closed:
            return
        if self.failure is None:
            try:
                self._send(STOP, [0] * (HEADER_SIZE - 1), [])
            except Exception:  # noqa: BLE001 - a rank already gone cannot be told; stopped below
                pass
        self._shutdown(grace_s=STOP_GRACE_S)

    def _shutdown(self, grace_s: float) -> None:
        self.closed = True
        if self._started is not None:  # after a failure some wait in a collective forever
            self._started.stop(grace_s)
        if self.ranks is not None:
            self.ranks.close()
        if self._owns_world:
            dist.destroy_process_group()
            self._owns_world = False
            TensorParallelDriver._spawned_world = None


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C in the middle of a step would leave the other ranks inside a collective that rank
    0 never finishes (`tetrad run` stops a reply with Ctrl-C): on the main thread it is held
    until the step is done, then delivered."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda *args: held.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(*held[0])


class TensorParallelWorker:
    """Rank r > 0 of a tensor-parallel engine: its share of the model and of the KV pool; runs
    the steps rank 0 sends until rank 0's engine closes. Construct it on every rank but 0 of a
    process group of exactly tp ranks while rank 0 constructs LLM(..., tp=tp); the engine
    configuration comes from rank 0. `model`: the whole model (split in place) or a folder to
    load it from."""

    def __init__(self, model: nn.Module | str | Path):
        self.ranks = TensorParallelRanks()
        config, max_model_len = self.ranks.share(None)
        if not isinstance(model, nn.Module):
            model = load_pretrained(model, dtype=TORCH_DTYPES[config.dtype])
        self.runner, self.kv_plan = load_runner(model, config, max_model_len, self.ranks.device,
                                                self.ranks)

    def step(self) -> bool:
        """Receive and run one step; False once rank 0 has closed the engine (this rank's
        control group is then closed too)."""
        comm, control = self.ranks.comm, self.ranks.control
        header = torch.empty(HEADER_SIZE, dtype=torch.long)
        comm.broadcast(header, 0, control, STEP_TAG)
        kind, *sizes = header.tolist()
        if kind == STOP:
            self.ranks.close()
            return False
        payload = torch.empty(StepPlan.payload_size(sizes), dtype=torch.long)
        comm.broadcast(payload, 0, control, STEP_TAG)
        plan = StepPlan.decode(sizes, payload.tolist(), self.kv_plan.block_size)
        with torch.inference_mode():
            logits = self.runner.execute(plan)  # [samples, vocab / tp]
            if logits.shape[0]:
                comm.send(logits.contiguous(), 0, self.ranks.group, LOGITS_TAG).wait()
        return True

    def serve(self) -> None:
        while self.step():
            pass


def _serve_rank(rank: int, tp: int, source: nn.Module | str) -> None:
    """A spawned rank (tetrad.parallel.launch has joined it to rank 0's process group): serve
    until rank 0 stops it."""
    TensorParallelWorker(source).serve()
