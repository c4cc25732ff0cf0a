"""Activation recomputation (`--recompute {none,selective,full}`): keep less for backward and run
part of the forward again during backward instead (torch.utils.checkpoint, non-reentrant).

- full: each transformer block keeps only its input; its whole forward runs again in backward
  (Chen et al. 2016). What a step saves no longer grows with the block's internals: one hidden
  state [batch, seq, hidden] per layer.
- selective: only the attention core softmax(QK^T)V runs again (Korthikanti et al. 2022), the
  part whose saved tensors grow with seq^2 when the kernel materializes the probabilities.

What selective saves depends on the attention kernel, measured by tests/test_recompute.py:
- SDPA's fused kernel (flash attention; what CPU fp32 training runs) never keeps an S x S tensor:
  it saves q, k, v, the output and the log-sum-exp. Recomputing it drops only the output and the
  log-sum-exp, batch*heads*seq*(head_dim + 1)*4 bytes per layer. There is no S^2 part to drop.
- SDPA's math path (or any attention that materializes the probabilities) keeps the
  [batch, heads, seq, seq] probabilities; selective recomputation drops them.
- Ring attention (context parallelism) is already flash-style, and recomputing it would send its
  K/V around the ring again: selective leaves it alone.

Full recomputation re-runs a block's communication too (ring attention's K/V hops, expert
parallelism's all-to-alls) during backward; the byte counters see that traffic.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from tetrad.errors import ConfigError
from tetrad.models.transformer import Transformer
from tetrad.parallel.context_parallel import RingAttention

MODES = ("none", "selective", "full")


class RecomputedAttention:
    """An attention core whose forward runs again during backward: only its inputs q, k, v are
    kept (the checkpoint saves them, so an ActivationMeter counts them)."""

    def __init__(self, core: Callable):
        self.core = core

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.core(q, k, v)
        return checkpoint(self.core, q, k, v, use_reentrant=False)


class RecomputedBlock:
    """A block's forward under a checkpoint. Installed on the instance, so parameter names (and
    the checkpoint format) stay those of the plain model; it wraps the forward the block has
    (a compiled one under --compile, which then runs again in backward)."""

    def __init__(self, forward: Callable):
        self.forward = forward

    def __call__(self, x: torch.Tensor, rope, attend=None) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.forward(x, rope, attend)
        return checkpoint(self.forward, x, rope, attend, use_reentrant=False)


def apply_recompute(model: Transformer, mode: str) -> None:
    """Recompute `mode` on every block of `model`. Apply after context parallelism (selective
    recognizes ring attention), after expert parallelism and after compilation (full wraps the
    compiled forward); losses and gradients are unchanged."""
    if mode not in MODES:
        raise ConfigError(f"--recompute must be one of {', '.join(MODES)}, got {mode!r}")
    for block in model.layers:
        if mode == "full":
            block.forward = RecomputedBlock(block.forward)
        elif mode == "selective" and not isinstance(block.attn.core, RingAttention):
            block.attn.core = RecomputedAttention(block.attn.core)
