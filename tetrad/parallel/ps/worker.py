"""A parameter-server worker, shaped like the trainer's strategies (tetrad/train/strategy.py):
it computes gradients on its slice of every global batch, pushes them to the servers that own
the keys, and pulls fresh parameters back.

The worker holds a full replica of the model. Its dense parameters are views of one flat
buffer and their gradients views of another (as DDP's buckets), so a server's key range is one
contiguous slice to push from and to pull into, with no copies. The sparse table (the untied
embedding) is pulled row by row: `local_batch` sees which rows this step's inputs read and
pulls exactly those, and the push carries exactly those rows' gradients. Rows the batch does
not read may be stale on the worker; nothing reads them until the end of the run, when
`gather` pulls every row so evaluation and sampling see the servers' final parameters.

Per step (sync):  local_batch  PULL_ROWS -> ROWS        global_mean  METRIC -> METRIC
                  finish_gradients  PUSH                clip_grad_norm  <- NORM (each server)
                  step  STEP(lr, clip coefficient) -> PARAMS
Per step (async, ssp): the worker clips its own gradient (it is the whole update), and step
pushes it with its learning rate; the PARAMS reply is the pull (held back in ssp while the
worker is K steps ahead of the slowest). The loss it reports is its own batch's.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.config import TrainConfig
from tetrad.errors import TetradError
from tetrad.memory import ActivationMeter
from tetrad.parallel.comm import Comm, CommCounter
from tetrad.parallel.mesh import Group
from tetrad.parallel.ps.protocol import (FOREVER_S, Kind, KeyLayout, Message, PSOptions,
                                         allocate, check_run, nbytes, payload_spec,
                                         per_step_by_tag, receive, record_received, send)
from tetrad.sharded_tensors import CHECKPOINT_KINDS, Piece, whole_pieces


class ParameterServerWorker:
    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device, world: Group,
                 comm: Comm, options: PSOptions):
        """`config`: batch_size, grad_accum and dtype are read (the checks of check_run)."""
        self.model, self.config, self.device = model, config, device
        self.world, self.collectives, self.options = world, comm, options
        self.comm = comm.counter  # the trainer reports comm.totals_per_step()
        self.received = CommCounter()
        self.roles = options.roles(world.size)
        self.rank, self.world_size = world.ranks[world.index], world.size
        assert not self.roles.is_server(self.rank), self.rank
        self.coords = {"dp": self.rank, "pp": 0, "cp": 0, "tp": 0, "ep": 0}
        check_run(config.batch_size, config.grad_accum, config.dtype, device,
                  self.roles.num_workers)
        self.servers = list(self.roles.servers)
        self.layout = KeyLayout.from_model(model, options.num_servers)
        self.clock = 0
        self.clip_scale = 1.0
        self.touched: torch.Tensor | None = None  # sorted ids of the rows this step reads
        self.summary: dict | None = None  # the scheduler's run summary, after gather
        params = dict(model.named_parameters())
        self.flat = torch.empty(self.layout.dense_numel)
        self.flat_grad = torch.zeros(self.layout.dense_numel)
        for name, offset in self.layout.dense_offsets().items():
            param = params[name]
            view = self.flat[offset:offset + param.numel()].view_as(param)
            view.copy_(param.detach())
            param.data = view
            param.grad = self.flat_grad[offset:offset + param.numel()].view_as(param)
        self.embed = params[self.layout.sparse] if self.layout.sparse else None
        self.meter = ActivationMeter(model)  # after the parameters moved into the flat buffer

    # Talking to the servers ----------------------------------------------------------------

    @contextlib.contextmanager
    def _talking_to(self, server: int) -> Iterator[None]:
        try:
            yield
        except RuntimeError as error:
            raise TetradError(
                f"{self.roles.describe(server)} failed to answer ({str(error).splitlines()[0]}): "
                f"it holds the only copy of its key range, so training stops; restart from the "
                f"last checkpoint with --resume") from None

    def _post(self, messages: dict[int, Message]) -> None:
        """Send one message to each of several servers, then wait for all of them."""
        posted = {}
        for server, message in messages.items():
            with self._talking_to(server):
                posted[server] = send(self.collectives, self.world, server, message)
        for server, handles in posted.items():
            with self._talking_to(server):
                for handle in handles:
                    handle.wait(self.options.reply_timeout_s)

    def _receive(self, server: int, kind: Kind,
                 buffers_for: Callable[[Message], list[torch.Tensor]] | None = None,
                 timeout_s: float | None = None) -> Message:
        def fresh(message: Message) -> list[torch.Tensor]:
            return allocate(payload_spec(message.kind, message.count, 0,
                                         self.layout.row_numel, 0))
        with self._talking_to(server):
            message = receive(self.collectives, self.world, server, buffers_for or fresh,
                              timeout_s or self.options.reply_timeout_s)
        if message.kind == Kind.DROPPED:
            raise TetradError(
                f"worker rank {self.rank} was silent for more than {self.options.heartbeat_s:.0f}"
                f" s and the scheduler dropped it; the other workers trained on without it")
        assert message.kind == kind, (message.kind, kind)
        record_received(self.received, message)
        return message

    def _index(self, server: int) -> int:
        return self.roles.server_index(server)

    def _dense(self, flat: torch.Tensor, server: int) -> torch.Tensor:
        lo, hi = self.layout.dense_range(self._index(server))
        return flat[lo:hi]

    def _rows_by_server(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Sorted row ids -> the ids each server owns (servers owning none left out)."""
        starts = [self.layout.row_range(self._index(s))[0] for s in self.servers]
        cuts = torch.searchsorted(ids, torch.tensor(starts[1:] + [self.layout.num_rows]))
        pieces = torch.tensor_split(ids, cuts[:-1].tolist())
        return {server: piece for server, piece in zip(self.servers, pieces) if piece.numel()}

    @torch.no_grad()
    def _pull_rows(self, ids: torch.Tensor) -> None:
        wanted = self._rows_by_server(ids)
        self._post({s: Message(Kind.PULL_ROWS, self.rank, self.clock, len(piece),
                               payload=(piece,)) for s, piece in wanted.items()})
        for server, piece in wanted.items():
            rows = self._receive(server, Kind.ROWS).payload[0]
            self.embed.data.index_copy_(0, piece, rows)

    def _push(self, lr: float) -> None:
        wanted = self._rows_by_server(self.touched) if self.embed is not None else {}
        grad = self.embed.grad if self.embed is not None else None
        messages = {}
        for server in self.servers:
            payload = (self._dense(self.flat_grad, server),)
            piece = wanted.get(server)
            if piece is not None:
                payload += (piece, grad.index_select(0, piece))
            messages[server] = Message(Kind.PUSH, self.rank, self.clock,
                                       0 if piece is None else len(piece), (lr, 0.0), payload)
        self._post(messages)

    # The strategy ---------------------------------------------------------------------------

    idle_fraction = 0.0  # no pipeline, no bubble

    @property
    def activations_peak(self) -> int:
        return self.meter.peak_bytes

    def forward_backward(self, batch: torch.Tensor) -> tuple[float, float | None]:
        """One step's microbatches of this worker's rows, forward and backward on its replica:
        the loop of tetrad.train's LocalStrategy, which this layer may not import."""
        microbatches = self.local_batch(batch).to(self.device).chunk(self.config.grad_accum)
        loss_sum, aux_sum = 0.0, None
        for index, window in enumerate(microbatches):
            with self.meter.measure(), self.autocast():
                logits = self.model(window[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
                aux = self.model.aux_loss()
                objective = (loss if aux is None
                             else loss + self.model.config.router_aux_loss_coef * aux)
            self.meter.finish_microbatch()
            self.backward(objective / len(microbatches), index == len(microbatches) - 1)
            loss_sum += loss.item() / len(microbatches)
            if aux is not None:
                aux_sum = (aux_sum or 0.0) + aux.item() / len(microbatches)
        aux_mean = None if aux_sum is None else self.global_mean(aux_sum)
        return self.global_mean(loss_sum), aux_mean

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This worker's slice of the global batch; pulls the embedding rows it reads."""
        rows = batch.shape[0] // self.roles.num_workers
        local = batch[self.rank * rows:(self.rank + 1) * rows]
        if self.embed is not None:
            self.touched = torch.unique(local[:, :-1])
            self._pull_rows(self.touched)
        return local

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        enabled = self.config.dtype == "bf16"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled):
            yield

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        loss.backward()

    def finish_gradients(self) -> None:
        if self.options.mode == "sync":
            self._push(lr=0.0)  # the learning rate comes with STEP

    def clip_grad_norm(self, max_norm: float) -> float:
        limit = max_norm if max_norm > 0 else math.inf
        if self.options.mode != "sync":
            return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit))
        square = sum(self._receive(server, Kind.NORM).values[0] for server in self.servers)
        norm = math.sqrt(square)
        self.clip_scale = min(limit / (norm + 1e-6), 1.0)  # torch's clip_grad_norm_ rule
        return norm

    def step(self, lr: float) -> bool:
        if self.options.mode == "sync":
            self._post({s: Message(Kind.STEP, self.rank, self.clock,
                                   values=(lr, self.clip_scale)) for s in self.servers})
        else:
            self._push(lr)
        for server in self.servers:
            self._receive(server, Kind.PARAMS, lambda m, s=server: [self._dense(self.flat, s)])
        self.flat_grad.zero_()
        if self.embed is not None:
            self.embed.grad = None
        self.clock += 1
        self.comm.end_step()
        self.received.end_step()
        return True

    def global_mean(self, value: float) -> float:
        """Sync: the mean over the workers (the global batch's loss); async and ssp: this
        worker's own value (the workers are on different steps)."""
        if self.options.mode != "sync":
            return value
        scheduler = self.roles.scheduler
        self._post({scheduler: Message(Kind.METRIC, self.rank, self.clock, values=(value, 0.0))})
        return self._receive(scheduler, Kind.METRIC).values[0]

    def gather(self, value: dict) -> list[dict]:
        """Ends the session with the servers: sends this worker's run-report entry to the
        scheduler, waits until every worker is done or dead, pulls the final parameters (every
        row), says goodbye, and returns every rank's entry. The run summary lands in
        self.summary."""
        entry = {**value, "role": "worker",
                 "parameter_server": {"pushed_per_step": per_step_by_tag(self.comm),
                                      "pulled_per_step": per_step_by_tag(self.received)}}
        scheduler = self.roles.scheduler
        self._post({scheduler: Message.carrying(Kind.DONE, self.rank, entry)})
        report = self._receive(scheduler, Kind.FINISHED, timeout_s=FOREVER_S).object()
        self.summary = report["summary"]
        self._pull_all()
        self._post({s: Message(Kind.BYE, self.rank, self.clock) for s in self.servers})
        return report["ranks"]

    @torch.no_grad()
    def _pull_all(self) -> None:
        self._post({s: Message(Kind.PULL_ALL, self.rank, self.clock) for s in self.servers})
        for server in self.servers:
            tables = [self.embed.data] if self.embed is not None else []
            self._receive(server, Kind.ALL_PARAMS,
                          lambda m, s=server, t=tables: [self._dense(self.flat, s),
                                                         *self._table_rows(s, t)])

    def _table_rows(self, server: int, tables: list[torch.Tensor]) -> list[torch.Tensor]:
        """The rows `server` owns of each table; none when it owns no rows (nothing is sent)."""
        lo, hi = self.layout.row_range(self._index(server))
        return [table[lo:hi] for table in tables] if hi > lo else []

    def whole_model(self) -> nn.Module:
        return self.model

    def checkpoint_state(self) -> tuple[list[Piece], dict]:
        """Rank 0 fetches every server's range and moments and writes them as whole tensors, so
        a run can resume under any layout; the other ranks write nothing."""
        if self.rank != 0:
            return [], {}
        dense = [torch.empty(self.layout.dense_numel) for _ in range(3)]
        tables = [torch.empty(self.layout.num_rows, self.layout.row_numel) for _ in range(3)]
        self._post({s: Message(Kind.SAVE, self.rank, self.clock) for s in self.servers})
        steps = []
        for server in self.servers:
            into = [self._dense(flat, server) for flat in dense] + self._table_rows(server, tables)
            steps.append(self._receive(server, Kind.STATE, lambda m, into=into: into).clock)
        shapes = {name: p.shape for name, p in self.model.named_parameters()}

        def by_name(flat: torch.Tensor, table: torch.Tensor) -> dict[str, torch.Tensor]:
            named = {name: flat[offset:offset + shapes[name].numel()].view(shapes[name]).clone()
                     for name, offset in self.layout.dense_offsets().items()}
            if self.layout.sparse:
                named[self.layout.sparse] = table
            return named

        pieces = [piece for index, kind in enumerate(CHECKPOINT_KINDS)
                  for piece in whole_pieces(kind, by_name(dense[index], tables[index]))]
        # The scheduler's count: in async mode a worker that died between two pushes leaves the
        # servers one update apart.
        return pieces, {"optimizer": {"step": steps[0]}, "scaler": None}

    def exchange(self, value: Any) -> list[Any]:
        """Only rank 0 writes checkpoint files (it fetched the whole state): no one to wait for."""
        return [value]

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """The replica's parameters; the servers load their own ranges and moments."""
        for name, param in self.model.named_parameters():
            param.copy_(state["model"][name])

    def bytes_held(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {"params": sum(nbytes(p) for p in params),
                "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
                "optimizer": 0}
