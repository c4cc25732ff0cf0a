"""The one interface of the data-parallel engines (DDP in data_parallel.py, ZeRO-1/2 in zero.py,
ZeRO-3 in fsdp.py), and torch's AdamW over parameters a rank holds whole, which DDP and the
experts of expert parallelism step.

An engine owns the replicated parameters' gradient reduction over dp x cp *and* their optimizer,
so the caller (ParallelModel) never asks which engine it has: backward (loss scaling included),
reduce the gradients after the step's last backward (unscaled afterwards), the squared gradient
norm of what it holds, clipping by a coefficient, the step (skipped on an fp16 overflow), what it
writes in a checkpoint, loading whole tensors, and the bytes it holds. With fp16 the loss is
scaled (`LossScaler`) and a step whose gradients overflowed is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Protocol

import torch
from torch import nn

from tetrad.parallel.mesh import Group
from tetrad.sharded_tensors import Piece
# DDP's bucket caps, the planner's too; the engines and their callers read them from here.
from tetrad.spec.runtime_rules import BUCKET_BYTES as DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES

# (name, parameter, tensor shaped like it) -> the part of it this rank counts in a sum over the
# whole model within its tp group and pipeline (None: nothing).
Counted = Callable[[str, nn.Parameter, torch.Tensor], "torch.Tensor | None"]
# (name, parameter) -> (global shape, split dim, this rank's rows) of what this rank writes of
# it in a checkpoint, or None when a tp or pipeline peer writes it.
Placement = Callable[[str, nn.Parameter], "tuple | None"]


@dataclass(frozen=True)
class DataParallelOptions:
    """What the data-parallel engines take from the training recipe."""

    group_parameters: Callable  # parameters -> AdamW's weight-decay groups
    # Weight-decay groups -> torch's AdamW, built as the single-process run builds it (what steps
    # whole parameters: DDP's, the experts'; ZeRO shards its own AdamW with betas and eps).
    whole_optimizer: Callable[[list[dict]], torch.optim.Optimizer]
    betas: tuple[float, float]
    eps: float
    compute_dtype: torch.dtype = torch.float32
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


class ParameterView:
    """Named parameters that are not one module's (a rank's pipeline stages without its experts),
    shaped as the data-parallel engines and the optimizer read a model."""

    def __init__(self, named: dict[str, nn.Parameter]):
        self.named = named

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self.named.items())

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(self.named.values())

    def buffers(self) -> Iterator[torch.Tensor]:
        return iter(())


class LossScaler:
    """Dynamic loss scaling for fp16 (torch.amp.GradScaler's policy): multiply the loss by
    `scale` so small gradients survive fp16; on inf/nan skip the step and halve the scale, after
    `growth_interval` clean steps double it."""

    def __init__(self, scale: float = 2.0 ** 16, growth_interval: int = 2000):
        self.scale = scale
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= 0.5
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= 2.0
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]


class DataParallelEngine(Protocol):
    """What ParallelModel asks of DDP and ZeRO-1/2/3 alike."""

    scaler: LossScaler | None  # fp16 only
    # Called with {id(param): grad} of a bucket or flat buffer just before it is reduced: tensor
    # parallelism sums there the gradients its ranks hold only part of (the two sums commute).
    before_reduce: Callable[[dict[int, torch.Tensor]], None] | None

    def backward(self, loss: torch.Tensor, is_last_microbatch: bool) -> None: ...

    def reduce_gradients(self) -> None:
        """After the step's last backward: gradients averaged over the group and unscaled."""

    def grad_square(self, counted: Counted) -> torch.Tensor:
        """Sum of the squares of the gradient elements this rank counts (float64), summed over
        the group when its ranks hold different elements."""

    def clip(self, coefficient: float) -> None: ...

    def step(self, lr: float, grad_norm: float) -> bool:
        """Apply the update; False when an fp16 overflow (a non-finite norm) skipped it."""

    def pieces(self, kinds: tuple[str, ...], placement: Placement) -> list[Piece]:
        """This rank's pieces of `kinds` (of CHECKPOINT_KINDS) that no other rank writes."""

    def load(self, params: Mapping[str, torch.Tensor], moments: dict | None,
             scaler: dict | None) -> None:
        """This rank's share of whole tensors by name (and AdamW's step and moments)."""

    def optimizer_step(self) -> int: ...

    def bytes_held(self) -> dict[str, int]: ...


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(value for state in optimizer.state.values() for value in state.values()
                        if torch.is_tensor(value))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class WholeAdamW:
    """torch's AdamW over parameters this rank holds whole, replicated over `replicas` (DDP's
    parameters over dp x cp, an ep rank's experts over edp): the first replica writes them."""

    def __init__(self, named: dict[str, nn.Parameter], options: DataParallelOptions,
                 replicas: Group):
        self.named, self.replicas = named, replicas
        self.optimizer = options.whole_optimizer(options.group_parameters(ParameterView(named)))

    def grad_square(self, counted: Counted, device: torch.device) -> torch.Tensor:
        square = torch.zeros((), dtype=torch.float64, device=device)
        for name, param in self.named.items():
            part = None if param.grad is None else counted(name, param, param.grad)
            if part is not None:
                square += part.double().square().sum()
        return square

    def clip(self, coefficient: float) -> None:
        for param in self.named.values():
            if param.grad is not None:
                param.grad.mul_(coefficient)

    def unscale(self, scale: float) -> None:
        for param in self.named.values():
            if param.grad is not None:
                param.grad.div_(scale)

    def step(self, lr: float) -> None:
        set_learning_rate(self.optimizer, lr)
        self.optimizer.step()

    def pieces(self, kinds: tuple[str, ...], placement: Placement) -> list[Piece]:
        if self.replicas.index != 0:
            return []
        pieces = []
        for kind, tensors in named_state(self.named, self.optimizer).items():
            for name, param in self.named.items():
                place = placement(name, param) if kind in kinds else None
                if place is not None:
                    pieces.append(Piece(kind, name, tensors[name], *place))
        return pieces

    def load(self, params: Mapping[str, torch.Tensor], moments: dict | None) -> None:
        load_named(self.optimizer, self.named, params, moments)

    def optimizer_step(self) -> int:
        return named_moments(self.optimizer, self.named)[2]

    def bytes_held(self) -> dict[str, int]:
        params = list(self.named.values())
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
               values: Mapping[str, torch.Tensor], moments: dict | None) -> None:
    """Parameters, and torch AdamW's state when given (step, moments by name), by name."""
    for name, param in params.items():
        param.copy_(values[name])
        if moments:
            # The fused AdamW kernel reads its step count on the parameter's device.
            optimizer.state[param] = {
                "step": torch.tensor(float(moments["step"]), dtype=torch.float32,
                                     device=param.device),
                "exp_avg": moments["exp_avg"][name].to(param).clone(),
                "exp_avg_sq": moments["exp_avg_sq"][name].to(param).clone()}
