"""Global gradient-norm clipping pieces shared by the runtimes that split a model: each sums the
squares it owns (reducing over its own groups), then scales every gradient the way
torch.nn.utils.clip_grad_norm_ does on the single-process model."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def grad_square(params: Iterable[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """Sum of the squared gradient norms of `params` (zero when none has a gradient)."""
    norms = [torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]
    return torch.stack(norms).square().sum() if norms else torch.zeros((), device=device)


def scale_to_max_norm_(params: Iterable[torch.nn.Parameter], total: torch.Tensor,
                       max_norm: float) -> float:
    """Scale every gradient by max_norm / total when total is larger (0: no clipping), with
    torch's 1e-6 guard; returns the norm before clipping."""
    if max_norm > 0:
        factor = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for param in params:
            if param.grad is not None:
                param.grad.mul_(factor)
    return float(total)
