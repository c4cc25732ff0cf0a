"""Counting the memory a step really holds, on any device (CPU included, where no allocator
statistics exist). Used by the trainer and by the parallel runtimes alike."""

from __future__ import annotations

import torch
from torch import nn


class ActivationMeter:
    """Counts the bytes autograd keeps alive for backward (the activations), by hooking every
    tensor saved during forward. Parameters are excluded (they are counted as params), and a
    storage saved by several operations is counted once. Works on any device, CPU included."""

    def __init__(self, model: nn.Module):
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.peak_bytes = 0
        self._storages: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameter_storages:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def measure(self):
        """Context manager around one microbatch's forward."""
        self._storages = {}
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def finish_microbatch(self) -> int:
        held = sum(self._storages.values())
        self.peak_bytes = max(self.peak_bytes, held)
        self._storages = {}
        return held
