"""A parameter-server worker as the trainer's strategy (docs/parameter_server.md): it computes
gradients on its slice of every global batch with the one microbatch loop
(tetrad.train.microbatches), and its WorkerClient (tetrad.parallel.ps.worker) pushes them to the
servers that own the keys and pulls fresh parameters back.

In sync mode the loss is the mean over the workers (the global batch's), the gradient norm the
servers' mean gradient's, and the servers clip and step. In async and ssp modes the worker clips
its own gradient (it is the whole update) and reports its own batch's loss.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.spec.model import TrainConfig
from tetrad.parallel.comm import Comm
from tetrad.parallel.compile import apply_compile
from tetrad.parallel.mesh import Group
from tetrad.parallel.ps.protocol import PSOptions, check_run, nbytes
from tetrad.parallel.ps.worker import Admission, WorkerClient
from tetrad.sharded_tensors import Piece
from tetrad.train.microbatches import MicrobatchLoop, apply_precision, whole_sequences


class ParameterServerStrategy:
    idle_fraction = 0.0  # no pipeline, no bubble

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device, world: Group,
                 comm: Comm, options: PSOptions, admission: Admission | None = None):
        """`config`: batch_size, grad_accum, dtype and fp8_recipe are read (the checks of
        check_run). `admission`: a spare joining a running job in a dead worker's place."""
        # Before the client flattens the parameters.
        apply_precision(model, config.dtype, config.fp8_recipe)
        self.model, self.config, self.device, self.options = model, config, device, options
        self.client = WorkerClient(model, world, comm, options)
        self.joined = admission is not None
        if self.joined:
            self.client.take_over(admission)
        # Steps past the start (or the checkpoint) the trainer skips: a spare's slot's clock.
        self.first_step = self.client.clock
        self.slot = self.client.slot
        self.comm, self.received = self.client.sent, self.client.received
        self.rank, self.world_size = self.client.rank, world.size
        self.coords = {"dp": self.slot, "pp": 0, "cp": 0, "tp": 0, "ep": 0}
        roles = self.client.roles
        check_run(config.batch_size, config.grad_accum, config.dtype, device,
                  roles.num_workers, roles.most_workers(options))
        self.clip_scale = 1.0
        self.summary: dict | None = None  # the scheduler's run summary, after gather
        if config.compile:
            apply_compile(model)
        # After the client moved the parameters into its flat buffer.
        self.loop = MicrobatchLoop(model, device, config.grad_accum, config.dtype,
                                   whole_sequences, self.loss, self.backward)

    @property
    def clock(self) -> int:
        """Steps this worker has finished."""
        return self.client.clock

    @property
    def activations_peak(self) -> int:
        return self.loop.meter.peak_bytes

    def forward_backward(self, batch: torch.Tensor) -> tuple[float, float | None]:
        return self.loop.run(self.local_batch(batch), self.global_mean)

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This worker's slice of the global batch: slot k of a step's n takes rows
        [k B/n, (k+1) B/n). Pulls the embedding rows it reads."""
        rows = batch.shape[0] // self.client.slots
        local = batch[self.slot * rows:(self.slot + 1) * rows]
        if self.client.embed is not None:
            self.client.pull_rows(torch.unique(local[:, :-1]))
        return local

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        loss.backward()

    def finish_gradients(self) -> None:
        if self.options.mode == "sync":
            self.client.push(lr=0.0)  # the learning rate comes with STEP

    def clip_grad_norm(self, max_norm: float) -> float:
        limit = max_norm if max_norm > 0 else math.inf
        if self.options.mode != "sync":
            return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit))
        norm = math.sqrt(self.client.squared_norm())
        self.clip_scale = min(limit / (norm + 1e-6), 1.0)  # torch's clip_grad_norm_ rule
        return norm

    def step(self, lr: float) -> bool:
        self.client.step(lr, self.clip_scale)
        return True

    def global_mean(self, value: float) -> float:
        """Sync: the mean over the workers (the global batch's loss); async and ssp: this
        worker's own value (the workers are on different steps)."""
        return self.client.mean(value) if self.options.mode == "sync" else value

    def gather(self, value: dict) -> list[dict]:
        """Ends the session with the servers (WorkerClient.finish) and returns every rank's
        entry; the run summary lands in self.summary."""
        report = self.client.finish(value)
        self.summary = report["summary"]
        return report["ranks"]

    def whole_model(self) -> nn.Module:
        return self.model

    def checkpoint_state(self) -> tuple[list[Piece], dict]:
        """Rank 0 fetches every server's range and moments and writes them as whole tensors, so
        a run can resume under any layout; the other ranks write nothing."""
        if self.rank != 0:
            return [], {}
        pieces, step = self.client.fetch_state()
        return pieces, {"optimizer": {"step": step}, "scaler": None}

    def exchange(self, value: Any) -> list[Any]:
        """Only rank 0 writes checkpoint files (it fetched the whole state): no one to wait for."""
        return [value]

    def agree_on_signal(self, signum: int) -> int:
        """Its own signal: workers talk only to the servers (the launcher signals every worker
        at once; rank 0 alone saves, from the servers' state)."""
        return signum

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """The replica's parameters; the servers load their own ranges and moments. A spare
        that joined has the servers' current parameters already."""
        if self.joined:
            return
        for name, param in self.model.named_parameters():
            param.copy_(state["model"][name])

    def bytes_held(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {"params": sum(nbytes(p) for p in params),
                "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
                "optimizer": 0}
