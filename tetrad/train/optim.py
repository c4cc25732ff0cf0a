"""AdamW and the learning-rate schedule. The schedule is a pure function of the step, so a resumed
run needs no scheduler state to continue exactly."""

from __future__ import annotations

import math

import torch
from torch import nn

from tetrad.spec.model import TrainConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights); leave vectors (norms, biases) alone, as
    nanoGPT and Megatron do: decaying a norm's gain only fights the normalization."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(params: list[dict] | list[torch.Tensor], config: TrainConfig
                    ) -> torch.optim.AdamW:
    """torch's AdamW with its fused kernel (CPU and CUDA): one pass over each parameter's memory
    where the default single-tensor path makes about seven (lerp, mul, addcmul, sqrt, div, add,
    addcdiv), many times faster on the CPU (benchmarks/bench_optimizer.py, BENCHMARKS.md). The
    same update, to fp32 rounding (tests/test_optim.py)."""
    return torch.optim.AdamW(params, lr=config.lr, betas=(config.beta1, config.beta2),
                             weight_decay=config.weight_decay, eps=1e-8, fused=True)


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step.
    `step` counts from 0."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    min_lr = config.lr * config.min_lr_ratio
    return min_lr + 0.5 * (config.lr - min_lr) * (1 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
