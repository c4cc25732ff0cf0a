"""What a parameter server owns (docs/parameter_server.md): the fp32 parameters and AdamW
moments of its key range, a dense flat range and the rows of the sparse table, the gradient of
the coming step, and the AdamW step over them (tetrad.parallel.zero_optimizer's ShardedAdamW,
element for element torch's, to fp32 rounding)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tetrad.parallel.ps.protocol import KeyLayout, nbytes
from tetrad.parallel.zero_optimizer import ShardedAdamW


@dataclass
class KeyRange:
    """What ShardedAdamW steps: fp32 parameters of a key range (flat), their moments, the
    gradient of the coming step, and (start, end, weight decay) segments."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay_segments: list[tuple[int, int, float]] = field(default_factory=list)
    main_grad: torch.Tensor | None = None


class OwnedKeys:
    """Server `index`'s ranges of `layout`: `ranges` and `grads` are (dense, table), flat."""

    def __init__(self, model: nn.Module, param_groups: list[dict], layout: KeyLayout, index: int,
                 betas: tuple[float, float], eps: float):
        self.layout, self.index = layout, index
        self.ranges = self._own_ranges(model, param_groups)
        self.grads = [torch.zeros_like(r.master) for r in self.ranges]
        self.optimizer = ShardedAdamW(self.ranges, betas, eps)

    @property
    def table_rows(self) -> int:
        lo, hi = self.layout.row_range(self.index)
        return hi - lo

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The sparse table's rows `ids` (global row numbers, all of them this server's)."""
        row_lo, _ = self.layout.row_range(self.index)
        return self.ranges[1].master.view(self.table_rows, -1).index_select(0, ids - row_lo)

    def tables(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Flat table tensors as [rows, row_numel]; none when this server owns no rows."""
        if not self.table_rows:
            return ()
        return tuple(t.view(self.table_rows, -1) for t in tensors)

    def accumulate(self, dense: torch.Tensor, *rows: torch.Tensor) -> None:
        """Add a push: the dense range's gradient, and (row ids, their gradients) if any."""
        self.grads[0].add_(dense)
        if rows:
            ids, values = rows
            row_lo, _ = self.layout.row_range(self.index)
            self.grads[1].view(self.table_rows, -1).index_add_(0, ids - row_lo, values)

    @torch.no_grad()
    def apply(self, lr: float, scale: float) -> None:
        """One AdamW step with the accumulated gradient times `scale`, which then starts over."""
        for key_range, grad in zip(self.ranges, self.grads):
            key_range.main_grad = grad.mul_(scale)
        self.optimizer.step(lr)
        for grad in self.grads:
            grad.zero_()

    @torch.no_grad()
    def _own_ranges(self, model: nn.Module, param_groups: list[dict]) -> list[KeyRange]:
        decay = {id(p): group["weight_decay"] for group in param_groups for p in group["params"]}
        params = dict(model.named_parameters())
        lo, hi = self.layout.dense_range(self.index)
        dense = torch.empty(hi - lo)
        table = torch.empty(self.table_rows * self.layout.row_numel)
        self._scatter(params, [dense, table])
        segments = [[(start, end, decay[id(params[name])])
                     for name, start, end, _ in self.layout.dense_pieces(self.index)
                     if decay[id(params[name])]], []]
        if self.layout.sparse and decay[id(params[self.layout.sparse])] and table.numel():
            segments[1].append((0, table.numel(), decay[id(params[self.layout.sparse])]))
        return [KeyRange(t, torch.zeros_like(t), torch.zeros_like(t), s)
                for t, s in zip((dense, table), segments)]

    def _scatter(self, full: dict[str, torch.Tensor], targets: list[torch.Tensor]) -> None:
        """This server's pieces of whole per-parameter tensors into (dense, table) targets."""
        for name, start, end, offset in self.layout.dense_pieces(self.index):
            targets[0][start:end] = full[name].reshape(-1)[offset:offset + end - start]
        if self.layout.sparse:
            row_lo, row_hi = self.layout.row_range(self.index)
            targets[1].copy_(full[self.layout.sparse][row_lo:row_hi].reshape(-1))

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Resume from a checkpoint of any layout (whole tensors by name, as ZeRO's)."""
        self._scatter(state["model"], [r.master for r in self.ranges])
        optimizer = state.get("optimizer")
        if optimizer:
            self._scatter(optimizer["exp_avg"], [r.exp_avg for r in self.ranges])
            self._scatter(optimizer["exp_avg_sq"], [r.exp_avg_sq for r in self.ranges])
            self.optimizer.step_count = optimizer["step"]

    def bytes_held(self) -> dict[str, int]:
        return {"params": sum(nbytes(r.master) for r in self.ranges),
                "grads": sum(nbytes(g) for g in self.grads),
                "optimizer": sum(nbytes(r.exp_avg) + nbytes(r.exp_avg_sq) for r in self.ranges)}
