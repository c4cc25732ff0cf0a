"""Multi-rank serving: the engine's model split over processes by tensor, pipeline, expert and
data parallelism (`LLM(path, tp=, pp=, ep=, dp=)`, `tetrad serve PATH --tp T --pp P --ep E --dp
D`; which layouts run: tetrad.inference.ranks.layout). One driver and one worker loop serve every layout;
what a rank computes in a step is its layout's (a `RankStep`):
  tp            the model split by the training code's layers (tetrad.parallel.tensor_parallel:
                attention by heads, the MLP by hidden units, embedding and head by vocabulary
                rows), each rank holding 1/tp of the weights and a KV pool of its own kv heads (a
                kv head is replicated on tp / num_kv_heads ranks when there are fewer than ranks);
                the forward runs in lockstep, each layer ending in an all-reduce over mesh["tp"]
  pp (x tp)     stages own consecutive layers and their KV pools; the step's sequences go through
                them as microbatches, activations passed point to point (tetrad.inference.ranks.pipeline)
  dp (ep = dp)  each rank runs its own sequences, the MoE layers' tokens travel to the experts'
                owners and back (tetrad.inference.ranks.data_parallel)

Rank 0 is the process that made the LLM: the scheduler(s), block manager(s) and sampler run there
only. Each step:
  1. rank 0 broadcasts the step on the control group: a header of sizes, then one int64 row of
     the plans (runner.StepPlan: token ids, starts, token counts, sample flags, block tables and
     block moves), one plan per dp rank;
  2. every rank does its plan's block moves on its own pool and runs its share of the forward;
  3. the ranks holding logits (the last stage's tp ranks, each dp rank) send rank 0 their block
     [their sequences' samples, vocab / tp]; rank 0 puts them together (rows by dp rank, columns
     by tp rank: rank order is vocabulary order) and samples.

The control group is gloo on the CPU (a step is host data), with a timeout that never fires: the
other ranks wait there for as long as the engine is idle. The model's collectives run on the
mesh's groups (NCCL on GPUs) under the collective timeout. A rank that dies closes its sockets, so
the others' next collective fails at once; rank 0 then reports the dead rank's traceback (workers
send it on a queue), stops the rest and refuses further steps.

Started without a process group, LLM starts ranks 1..world-1 itself with the launcher `tetrad
train` uses too (tetrad.parallel.launch: spawn start method, rank 0 hosts the rendezvous store,
errors come back on one queue) and owns the process group; each worker loads the model folder
itself (a model object travels to it pickled). Inside a process group of exactly tp*pp*dp ranks
(torchrun, the tests) LLM runs on rank 0 and every other rank runs `ServingWorker(model).serve()`.
"""

from __future__ import annotations

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

from tetrad.errors import ConfigError, TetradError
from tetrad.inference.worker.kv_cache import TORCH_DTYPES
from tetrad.inference.ranks.rank_share import ServingRanks
from tetrad.inference.worker.runner import PROMPT_LOGITS, StepPlan, load_runner
from tetrad.models.hf import load_pretrained
from tetrad.parallel.launch import COLLECTIVE_TIMEOUT_S, WorkerProcesses, init_worker

if TYPE_CHECKING:
    from tetrad.inference.worker.config import EngineConfig
    from tetrad.spec.serving import ServeLayout

REPORT_WAIT_S = 2.0  # after a failed collective, how long rank 0 waits for a worker's traceback
STOP_GRACE_S = 10.0  # how long closed workers get to exit before they are terminated
STOP, STEP = 0, 1
PLAN_SIZES = 6  # len(StepPlan.sizes()); the header is [STOP or STEP, *sizes of each dp rank's plan]
# Comm tags: the step broadcast, the logits sent to rank 0 (start-up exchanges: "setup"). The
# model's all-reduces carry tensor parallelism's own tag, "activations"; pipeline stages pass
# "stages", expert dispatch "experts".
STEP_TAG, LOGITS_TAG = "step", "logits"


class ServingRankError(TetradError):
    """A serving rank failed: the message names it and carries its error."""


def logits_rows(plan: StepPlan) -> int:
    """Rows of logits the plan's forward returns."""
    return sum(num if samples == PROMPT_LOGITS else samples
               for num, samples in zip(plan.num_tokens, plan.samples))


def _read_step(ranks: ServingRanks, block_size: int) -> list[StepPlan] | None:
    """A worker's next step from rank 0: every dp rank's plan, or None when rank 0 stopped."""
    comm, control = ranks.comm, ranks.control
    header = torch.empty(1 + PLAN_SIZES * ranks.layout.dp, dtype=torch.long)
    comm.broadcast(header, 0, control, STEP_TAG)
    kind, *sizes = header.tolist()
    if kind == STOP:
        return None
    parts = [sizes[i:i + PLAN_SIZES] for i in range(0, len(sizes), PLAN_SIZES)]
    payload = torch.empty(sum(map(StepPlan.payload_size, parts)), dtype=torch.long)
    comm.broadcast(payload, 0, control, STEP_TAG)
    values, plans, start = payload.tolist(), [], 0
    for part in parts:
        end = start + StepPlan.payload_size(part)
        plans.append(StepPlan.decode(part, values[start:end], block_size))
        start = end
    return plans


class ServingDriver:
    """Rank 0 of a multi-rank engine: starts the other ranks (or joins the process group they
    are in), holds its share of the model and KV pool (`runner`, `kv_plan`), and runs every
    step on all ranks. After a failure it stops the other ranks and refuses to step again: the
    ranks may have been left inside different collectives."""

    # The process group a driver of this process started, while it is open: torch.distributed
    # has one default group per process, so a second engine could only join the first's ranks.
    _spawned_world: ClassVar[ServingDriver | None] = None

    def __init__(self, model: nn.Module, source: nn.Module | str, config: EngineConfig,
                 max_model_len: int, device: torch.device):
        """`model`: the whole model, split in place; `source`: what spawned workers load (a
        folder) or receive pickled (a model object). The layout is the config's, checked
        against the model already (layout.check_servable); `device` is rank 0's when this
        driver starts the ranks (joining a process group, its backend decides)."""
        self.workers: list[multiprocessing.Process] = []
        self._started: WorkerProcesses | None = None
        self._owns_world = False
        self.ranks: ServingRanks | None = None
        self.failure: BaseException | None = None
        self.closed = False
        self.vocab_size, self.dtype = model.config.vocab_size, TORCH_DTYPES[config.dtype]
        world = config.world_size
        if dist.is_initialized():
            self._check_joinable(config)
            device = None
        else:
            self._spawn(world, source, device)
        try:
            self.ranks = ServingRanks(device)
            self.ranks.share((config, max_model_len))
            self.ranks.build(config)
            self.runner, self.kv_plan = load_runner(model, config, max_model_len,
                                                    self.ranks.device, self.ranks)
            self.rank_step = self.ranks.step_of(self.runner)
        except BaseException as error:
            self._fail(error)

    def _check_joinable(self, layout: ServeLayout) -> None:
        if ServingDriver._spawned_world is not None:
            raise ConfigError("this process already runs a multi-rank LLM that started its own "
                              "ranks: close() it (or use it in a with block) before starting "
                              "another")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != layout.world_size:
            raise ConfigError(f"torch.distributed runs {world} ranks but tp*pp*dp is "
                              f"{layout.world_size}: a multi-rank engine spans its whole process "
                              f"group; start {layout.world_size} ranks, or create the LLM "
                              f"without a process group and it starts its own")
        if rank != 0:
            raise ConfigError(f"this is rank {rank}: the LLM runs on rank 0; the other ranks run "
                              f"tetrad.inference.ranks.driver.ServingWorker(model).serve()")

    def _spawn(self, world: int, source: nn.Module | str, device: torch.device) -> None:
        threads = torch.get_num_threads()
        if device.type == "cpu":  # the ranks share the cores
            threads = max(1, threads // world)
            torch.set_num_threads(threads)
        self._started = WorkerProcesses(_serve_rank, range(1, world), world, (source,), threads,
                                        device.type, ignore_interrupts=True)
        self.workers = self._started.processes
        try:
            self._started.wait_started(COLLECTIVE_TIMEOUT_S)
            init_worker(0, world, 0, world, COLLECTIVE_TIMEOUT_S, self._started.store, threads,
                        device)
        except BaseException as error:
            self._fail(error)
        self._owns_world = True
        ServingDriver._spawned_world = self

    # ---- steps ---------------------------------------------------------------------------------

    def execute(self, plans: list[StepPlan]) -> torch.Tensor:
        """Run the step (one plan per dp rank) on every rank; the whole logits [samples, vocab],
        dp rank after dp rank (rank 0 samples)."""
        if self.failure is not None or self.closed:
            raise ServingRankError(
                "the multi-rank engine is closed" if self.failure is None else
                f"the multi-rank engine stopped after an error: {self.failure}")
        if any(worker.exitcode is not None for worker in self.workers):
            self._fail(None)
        try:
            with _interrupts_held(), torch.inference_mode():
                self._send(STEP, [size for plan in plans for size in plan.sizes()],
                           [value for plan in plans for value in plan.payload()])
                return self._gather(plans, self.rank_step(plans))
        except Exception as error:
            self._fail(error)

    def _send(self, kind: int, sizes: list[int], payload: list[int]) -> None:
        comm, control = self.ranks.comm, self.ranks.control
        comm.broadcast(torch.tensor([kind, *sizes], dtype=torch.long), 0, control, STEP_TAG)
        if kind == STEP:
            comm.broadcast(torch.tensor(payload, dtype=torch.long), 0, control, STEP_TAG)

    def _gather(self, plans: list[StepPlan], local: torch.Tensor | None) -> torch.Tensor:
        """The holders' blocks [rows of dp rank d, vocab / tp] -> [samples, vocab]: rows in dp
        order, columns in tp order (ranks hold consecutive vocabulary slices)."""
        world = self.ranks.mesh["world"]
        width = self.vocab_size // self.ranks.layout.tp
        blocks, handles = [], []
        for plan, holders in zip(plans, self.ranks.logits_holders()):
            rows = logits_rows(plan)
            row = [local if rank == 0 else
                   torch.empty((rows, width), dtype=self.dtype, device=self.ranks.device)
                   for rank in holders]
            handles += [self.ranks.comm.recv(piece, rank, world)
                        for rank, piece in zip(holders, row) if rank and rows]
            blocks.append(row)
        for handle in handles:
            handle.wait()
        return torch.cat([torch.cat(row, dim=-1) for row in blocks])

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

    def _worker_failure(self) -> ServingRankError | None:
        """The first error a worker reported (waiting REPORT_WAIT_S for it), else a worker that
        died without one; None when every worker is alive and silent."""
        failure = self._started and self._started.first_failure(REPORT_WAIT_S)
        return ServingRankError(f"serving {failure}") if failure else None

    def close(self) -> None:
        """Tell the other ranks to exit, wait for them, and close the groups this engine made."""
        if self.closed:
            return
        if self.failure is None:
            try:
                self._send(STOP, [0] * PLAN_SIZES * self.ranks.layout.dp, [])
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
            ServingDriver._spawned_world = None


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


class ServingWorker:
    """Rank r > 0 of a multi-rank engine: its share of the model and of the KV pool; runs the
    steps rank 0 sends until rank 0's engine closes. Construct it on every rank but 0 of a
    process group of exactly tp*pp*dp ranks while rank 0 constructs LLM(..., tp=, pp=, ep=,
    dp=); the engine configuration and layout come from rank 0. `model`: the whole model (split
    in place) or a folder to load it from."""

    def __init__(self, model: nn.Module | str | Path):
        self.ranks = ServingRanks()
        config, max_model_len = self.ranks.share(None)
        self.ranks.build(config)
        if not isinstance(model, nn.Module):
            model = load_pretrained(model, dtype=TORCH_DTYPES[config.dtype])
        self.runner, self.kv_plan = load_runner(model, config, max_model_len, self.ranks.device,
                                                self.ranks)
        self.rank_step = self.ranks.step_of(self.runner)

    def step(self) -> bool:
        """Receive and run one step; False once rank 0 has closed the engine (this rank's
        control group is then closed too)."""
        plans = _read_step(self.ranks, self.kv_plan.block_size)
        if plans is None:
            self.ranks.close()
            return False
        with torch.inference_mode():
            logits = self.rank_step(plans)  # [this dp rank's samples, vocab / tp] or None
            if logits is not None and logits.shape[0]:
                self.ranks.comm.send(logits.contiguous(), 0, self.ranks.mesh["world"],
                                     LOGITS_TAG).wait()
        return True

    def serve(self) -> None:
        while self.step():
            pass


def _serve_rank(rank: int, world_size: int, source: nn.Module | str) -> None:
    """A spawned rank (tetrad.parallel.launch has joined it to rank 0's process group): serve
    until rank 0 stops it."""
    ServingWorker(source).serve()
