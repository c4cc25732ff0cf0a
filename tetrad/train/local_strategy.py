"""Single-process training: the reference every parallel layout must reproduce (fp32 losses
within 1e-5), and the base of the strategies over a process mesh (tetrad.train.mesh_strategy).
The trainer reaches both through tetrad.train.strategy."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.config import TrainConfig
from tetrad.memory import ActivationMeter
from tetrad.models.moe import update_router_biases
from tetrad.sharded_tensors import Piece, whole_pieces
from tetrad.train.optim import build_optimizer, parameter_groups, set_learning_rate

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
COMPUTE_DTYPES = {"fp32": torch.float32, **AUTOCAST_DTYPES}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(value for state in optimizer.state.values() for value in state.values()
                        if torch.is_tensor(value))


class LocalStrategy:
    """Everything in one process: full model, full optimizer, no communication."""

    rank = 0
    world_size = 1
    coords = {"dp": 0, "pp": 0, "cp": 0, "tp": 0, "ep": 0}
    idle_fraction = 0.0  # no pipeline, no bubble

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device):
        self.model = model
        self.device = device
        self.config = config
        self.optimizer = build_optimizer(parameter_groups(model, config.weight_decay), config)
        # fp16 needs loss scaling: its small exponent range flushes small gradients to zero.
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.dtype == "fp16")
        self.comm = None  # no collectives: the run report's comm_bytes stay zero
        self.meter = ActivationMeter(model)

    @property
    def activations_peak(self) -> int:
        """Most bytes saved for backward at once in any step so far."""
        return self.meter.peak_bytes

    def forward_backward(self, batch: torch.Tensor) -> tuple[float, float | None]:
        """Forward and backward of every microbatch of one step, from the global batch
        [batch_size, seq_len + 1]. Returns the global batch's mean loss (and mean MoE
        load-balance loss)."""
        microbatches = self.local_batch(batch).to(self.device).chunk(self.config.grad_accum)
        loss_sum, aux_sum = 0.0, None
        for index, window in enumerate(microbatches):
            inputs, targets, positions = self.split(window)
            with self.meter.measure(), self.autocast():
                logits = self.model(inputs, positions=positions)
                loss = self.loss(logits, targets)
                aux = self.model.aux_loss()
                objective = (loss if aux is None
                             else loss + self.model.config.router_aux_loss_coef * aux)
            self.meter.finish_microbatch()
            self.backward(objective / len(microbatches),
                          is_last_microbatch=index == len(microbatches) - 1)
            loss_sum += loss.item() / len(microbatches)
            if aux is not None:
                aux_sum = (aux_sum or 0.0) + aux.item() / len(microbatches)
        aux_mean = None if aux_sum is None else self.global_mean(aux_sum)
        return self.global_mean(loss_sum), aux_mean

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global batch [batch_size, seq_len + 1]."""
        return batch

    def split(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """A microbatch window [batch, seq + 1] -> inputs, targets, positions (None: 0..seq-1)."""
        return window[:, :-1], window[:, 1:], None

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        dtype = AUTOCAST_DTYPES.get(self.config.dtype)
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            yield

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None:
        self.scaler.scale(loss).backward()

    def finish_gradients(self) -> None:
        """Wait for gradient communication; gradients are final (and unscaled) afterwards."""
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
        """Average of a per-rank number over the ranks that split the batch."""
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


def named_state(params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer
                ) -> dict[str, dict[str, torch.Tensor]]:
    """Parameters and torch AdamW's moments by kind ("model", "exp_avg", "exp_avg_sq"), then name:
    what a checkpoint holds of tensors a rank steps with a torch optimizer."""
    exp_avg, exp_avg_sq, _ = named_moments(optimizer, params)
    return {"model": {name: param.detach() for name, param in params.items()},
            "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def named_moments(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter]
                  ) -> tuple[dict, dict, int]:
    """torch AdamW's state by parameter name (zeros for a parameter never stepped)."""
    moments = ({}, {})
    step = 0
    for name, param in params.items():
        state = optimizer.state.get(param, {})
        step = max(step, int(state.get("step", 0)))
        for kind, target in zip(("exp_avg", "exp_avg_sq"), moments):
            target[name] = state[kind] if kind in state else torch.zeros_like(param)
    return *moments, step


@torch.no_grad()
def load_named(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter],
               values: dict[str, torch.Tensor], moments: dict | None) -> None:
    """Parameters, and torch AdamW's state when given (step, moments by name), by name."""
    for name, param in params.items():
        param.copy_(values[name])
        if moments:
            optimizer.state[param] = {
                "step": torch.tensor(float(moments["step"])),
                "exp_avg": moments["exp_avg"][name].to(param).clone(),
                "exp_avg_sq": moments["exp_avg_sq"][name].to(param).clone()}


def grad_scaler_state(state: dict, scaler: torch.amp.GradScaler) -> dict:
    """torch's GradScaler state from a mesh run's loss scaler (same policy, fewer fields)."""
    if "clean_steps" not in state:
        return state
    return {**scaler.state_dict(), "scale": state["scale"], "_growth_tracker": state["clean_steps"]}
