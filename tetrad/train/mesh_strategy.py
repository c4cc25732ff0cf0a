"""Training over a process mesh, under any 4D layout and any data-parallel engine (DDP or
ZeRO-1/2/3, chosen by --zero): the model is spread by tetrad.parallel.parallelize in its one fixed
order, and the resulting ParallelModel does the reduction, the global norm, the optimizer step
and the checkpoint pieces whatever the engine. Without a pipeline a step is the one microbatch
loop (tetrad.train.microbatches); with one, the executor's. In a checkpoint each rank writes its
own pieces, described in the single-process tensors' coordinates, so a run resumes under any
layout (tetrad.sharded_tensors)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tetrad.spec.model import TrainConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm
from tetrad.parallel.engine import DEFAULT_BUCKET_BYTES, DataParallelOptions
from tetrad.parallel.mesh import Mesh
from tetrad.parallel.parallelize import parallelize
from tetrad.sharded_tensors import CHECKPOINT_KINDS, Piece
from tetrad.train.microbatches import COMPUTE_DTYPES, MicrobatchLoop, autocast
from tetrad.train.optim import build_optimizer, parameter_groups


class MeshStrategy:
    """This rank's part of a run over a process mesh: the layout applied to the model, this
    rank's rows of the batch (every cp and tp rank of a dp index reads the same rows), the
    microbatch loop or the pipeline's step, global means and norms, pieces for checkpoints. fp16
    scales the loss; a step whose global gradient norm is inf/nan is skipped on every rank."""

    summary = None

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device, mesh: Mesh,
                 collectives: Comm, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.config, self.device = config, device
        self.mesh, self.collectives = mesh, collectives
        self.comm = collectives.counter  # the trainer reports comm.totals_per_step()
        self.rank, self.world_size, self.coords = mesh.rank, mesh.dims.world_size, mesh.coords
        defaults = build_optimizer([torch.empty(0)], config).defaults
        options = DataParallelOptions(
            lambda params: parameter_groups(params, config.weight_decay),
            lambda groups: build_optimizer(groups, config), defaults["betas"], defaults["eps"],
            COMPUTE_DTYPES[config.dtype], bucket_bytes)
        self.autocast = partial(autocast, device, config.dtype)  # the pipeline's stages too
        self.parallel = parallelize(model, mesh, collectives, config.parallel, config.seq_len,
                                    options, self.autocast, config.compile)
        self.model = self.parallel.module
        # After the engine moved the parameters (the meter tells them from activations).
        self.loop = MicrobatchLoop(self.model, device, config.grad_accum, config.dtype,
                                   self.split, self.loss, self.backward)
        self.params = self.parallel.params
        self.engine = self.parallel.engine
        self.grad_norm = 0.0
        self.pipeline_peak, self.idle_fractions = 0, []

    @property
    def activations_peak(self) -> int:
        return self.pipeline_peak if self.parallel.pipeline else self.loop.meter.peak_bytes

    @property
    def idle_fraction(self) -> float:
        """The pipeline's measured bubble, averaged over the steps."""
        return sum(self.idle_fractions) / len(self.idle_fractions) if self.idle_fractions else 0.0

    def loss_scale(self) -> float:
        """What the objective is multiplied by before backward (fp16 loss scaling)."""
        return self.parallel.scaler.scale if self.parallel.scaler else 1.0

    def forward_backward(self, batch: torch.Tensor) -> tuple[float, float | None]:
        pipeline = self.parallel.pipeline
        if pipeline is None:
            return self.loop.run(self.local_batch(batch), self.logged_mean)
        # The executor runs its own microbatches; --grad-accum repeats whole pipeline steps.
        chunks = self.local_batch(batch).to(self.device).chunk(self.config.grad_accum)
        loss_sum = aux_sum = 0.0
        for index, chunk in enumerate(chunks):
            stats = pipeline.step(chunk, loss_scale=self.loss_scale() / len(chunks),
                                  last_of_step=index == len(chunks) - 1)
            loss_sum += stats.loss / len(chunks)
            aux_sum += (stats.aux_loss or 0.0) / len(chunks)
            self.pipeline_peak = max(self.pipeline_peak, stats.peak_activation_bytes)
            self.idle_fractions.append(stats.idle_fraction)
        aux_mean = self.logged_mean(aux_sum) if self.parallel.config.is_moe else None
        return self.logged_mean(loss_sum), aux_mean

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        dp = self.mesh["dp"]
        rows = batch.shape[0] // dp.size
        return batch[dp.index * rows:(dp.index + 1) * rows]

    def split(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return self.parallel.split(window)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.parallel.loss(logits, targets)

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        self.parallel.backward(loss, is_last_microbatch)

    def global_mean(self, value: float) -> float:
        """Mean over dp x cp: each of those ranks scored its own tokens, and the same number of
        them (tp and pp ranks of one position agree already)."""
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.collectives.all_reduce(total, self.mesh["dp_cp"], "metrics")
        return total.item() / self.mesh["dp_cp"].size

    def logged_mean(self, value: float) -> float:
        """global_mean where only the dp x cp group's first rank needs it (global rank 0, which
        logs and reports the loss, is one): a reduce to it. Every other rank gets its own
        `value` back, which is what its non-finite check needs."""
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        group = self.mesh["dp_cp"]
        self.collectives.reduce(total, 0, group, "metrics")
        return total.item() / group.size if group.index == 0 else value

    def gather(self, value: Any) -> list[Any]:
        """Every rank's entry on rank 0, which alone writes the report; elsewhere only its
        own."""
        return self.collectives.gather_object(value, 0, self.mesh["world"], "report") or [value]

    def finish_gradients(self) -> None:
        """Gradients reduced and unscaled, and their global norm (which also decides, with fp16,
        whether the step is skipped: on every rank alike)."""
        self.parallel.reduce_gradients()
        self.grad_norm = self.parallel.grad_norm()

    def clip_grad_norm(self, max_norm: float) -> float:
        self.parallel.clip(self.grad_norm, max_norm)
        return self.grad_norm

    def step(self, lr: float) -> bool:
        applied = self.parallel.step(lr, self.grad_norm)
        self.comm.end_step()
        return applied

    def checkpoint_state(self) -> tuple[list[Piece], dict]:
        """This rank's pieces of the parameters and AdamW moments (what it alone writes in a
        sharded checkpoint), and the state every rank shares (optimizer step, loss scaler)."""
        scaler = self.parallel.scaler
        return self.parallel.checkpoint_pieces(CHECKPOINT_KINDS), {
            "optimizer": {"step": self.parallel.optimizer_step()},
            "scaler": scaler.state_dict() if scaler else None}

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's `value` (collective over the world, tag "checkpoint")."""
        return self.collectives.all_gather_object(value, self.mesh["world"], "checkpoint")

    def agree_on_signal(self, signum: int) -> int:
        """The largest signal number any rank received (SIGTERM over SIGINT). Outside the byte
        counter: four bytes a step are not the layout's traffic the report compares with the
        planner's."""
        world = self.mesh["world"]
        if world.handle is None:
            return signum
        agreed = torch.tensor([signum], dtype=torch.int32, device=self.device)
        dist.all_reduce(agreed, dist.ReduceOp.MAX, group=world.handle)
        return int(agreed.item())

    def load_state_dict(self, state: dict) -> None:
        self.parallel.load(state)

    def whole_model(self) -> nn.Module:
        """Every rank's parameter pieces exchanged and assembled: the whole model on each rank."""
        whole = Transformer(self.parallel.config)
        whole.load_state_dict(self.parallel.whole_state(), strict=False)
        return whole.to(self.device)

    def bytes_held(self) -> dict[str, int]:
        return self.parallel.bytes_held()
