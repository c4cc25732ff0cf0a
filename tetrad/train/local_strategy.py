"""Single-process training: the reference every parallel layout must reproduce (fp32 losses
within 1e-5). The trainer reaches it through tetrad.train.strategy."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.spec.model import TrainConfig
from tetrad.models.moe import update_router_biases
from tetrad.parallel.compile import CompiledForward
from tetrad.parallel.engine import (load_named, named_moments, named_state,
                                    optimizer_state_bytes, tensor_bytes)
from tetrad.sharded_tensors import Piece, whole_pieces
from tetrad.train.microbatches import MicrobatchLoop, whole_sequences
from tetrad.train.optim import build_optimizer, parameter_groups, set_learning_rate


class LocalStrategy:
    """Everything in one process: full model, full optimizer, no communication."""

    rank = 0
    world_size = 1
    coords = {"dp": 0, "pp": 0, "cp": 0, "tp": 0, "ep": 0}
    idle_fraction = 0.0  # no pipeline, no bubble
    comm = None  # no collectives: the run report's comm_bytes stay zero
    summary = None

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device):
        self.model = model
        self.device = device
        self.config = config
        self.optimizer = build_optimizer(parameter_groups(model, config.weight_decay), config)
        # fp16 needs loss scaling: its small exponent range flushes small gradients to zero.
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.dtype == "fp16")
        # With --compile the cross-entropy is compiled too: the logits are the step's largest
        # tensors, and eager's writes their log-probabilities, then zero-fills a gradient of
        # their size and scatters the targets into it; inductor's makes one pass forward (the
        # log-sum-exp and the target's logit) and one backward (softmax minus the target).
        loss = CompiledForward(self.loss) if config.compile else self.loss
        self.loop = MicrobatchLoop(model, device, config.grad_accum, config.dtype,
                                   whole_sequences, loss, self.backward)
        self.meter, self.autocast = self.loop.meter, self.loop.autocast

    @property
    def activations_peak(self) -> int:
        """Most bytes saved for backward at once in any step so far."""
        return self.meter.peak_bytes

    def forward_backward(self, batch: torch.Tensor) -> tuple[float, float | None]:
        """Forward and backward of every microbatch of one step, from the global batch
        [batch_size, seq_len + 1]. Returns the global batch's mean loss (and mean MoE
        load-balance loss)."""
        return self.loop.run(batch)

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global batch [batch_size, seq_len + 1]: all of it."""
        return batch

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        self.scaler.scale(loss).backward()

    def finish_gradients(self) -> None:
        """Wait for gradient communication; gradients are final (and unscaled) afterwards. A
        parameter the step did not use (an expert no token chose) gets a zero gradient, as the
        data-parallel engines' buffers give it: AdamW then decays it and carries its moments on
        alike in every layout, instead of skipping it here only."""
        for param in self.model.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
        self.scaler.unscale_(self.optimizer)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to max_norm (0 means no clipping) and return the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                    max_norm if max_norm > 0 else float("inf")))

    def step(self, lr: float) -> bool:
        """Apply the update; False when fp16 loss scaling found inf/nan and skipped it."""
        set_learning_rate(self.optimizer, lr)
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        update_router_biases(self.model)  # aux-loss-free balancing: after the step, as DeepSeek
        return scale_before is None or self.scaler.get_scale() >= scale_before

    def global_mean(self, value: float) -> float:
        """Average of a per-rank number over the ranks that split the batch: itself."""
        return value

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (collective): the run report's per-rank entries."""
        return [value]

    def whole_model(self) -> nn.Module:
        """The model with every parameter whole on this rank, for using it on one rank alone
        (evaluation and sampling at the end of a run). Collective: every rank calls it."""
        return self.model

    def checkpoint_state(self) -> tuple[list[Piece], dict]:
        """This rank's pieces of the parameters and AdamW moments (here: all of them, whole),
        and the state every rank shares (optimizer step, loss scaler)."""
        params = dict(self.model.named_parameters())
        return ([piece for kind, tensors in named_state(params, self.optimizer).items()
                 for piece in whole_pieces(kind, tensors)],
                {"optimizer": {"step": named_moments(self.optimizer, params)[2]},
                 "scaler": self.scaler.state_dict()})

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (collective): how the ranks agree on a save."""
        return [value]

    def agree_on_signal(self, signum: int) -> int:
        return signum

    def load_state_dict(self, state: dict) -> None:
        """From a checkpoint of any layout: whole tensors by name (tetrad.sharded_tensors)."""
        load_named(self.optimizer, dict(self.model.named_parameters()), state["model"],
                   state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(grad_scaler_state(state["scaler"], self.scaler))

    def bytes_held(self) -> dict[str, int]:
        """Bytes of the tensors this rank holds, by kind. Called while gradients are live."""
        params = list(self.model.parameters())
        return {"params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
                "optimizer": optimizer_state_bytes(self.optimizer)}


def grad_scaler_state(state: dict, scaler: torch.amp.GradScaler) -> dict:
    """torch's GradScaler state from a mesh run's loss scaler (same policy, fewer fields)."""
    if "clean_steps" not in state:
        return state
    return {**scaler.state_dict(), "scale": state["scale"], "_growth_tracker": state["clean_steps"]}
