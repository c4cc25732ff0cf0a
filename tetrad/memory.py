"""Counting the memory a step really holds, on any device (CPU included, where no allocator
statistics exist). Used by the trainer and by the parallel runtimes alike."""

from __future__ import annotations

import torch
from torch import nn


def storage_id(tensor: torch.Tensor) -> int:
    """Identity of the storage behind a tensor. Not its data pointer: ZeRO-3 frees a parameter's
    storage and regathers it elsewhere, so the pointer changes while the storage stays the
    parameter's."""
    return tensor.untyped_storage()._cdata


class ActivationMeter:
    """Counts the bytes autograd keeps alive for backward (the activations), by hooking every
    tensor saved during forward. Parameters are excluded (they are counted as params), and a
    storage saved by several operations is counted once. Works on any device, CPU included."""

    def __init__(self, model: nn.Module):
        self.parameter_storages = {storage_id(p) for p in model.parameters()}
        self.peak_bytes = 0
        self._storages: dict[int, int] = {}
        # Pipelines keep several microbatches' activations alive at once: key -> its storages.
        self._in_flight: dict[object, dict[int, int]] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_id(tensor)
        if key not in self.parameter_storages:
            self._storages[key] = tensor.untyped_storage().nbytes()
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

    def hold(self, key) -> int:
        """Pipeline accounting, instead of finish_microbatch: what the forward just measured stays
        in flight under `key` until `release(key)` (its backward has run). The peak counts every
        microbatch in flight at once. Returns the bytes in flight now."""
        self._in_flight[key] = self._storages
        self._storages = {}
        in_flight: dict[int, int] = {}
        for storages in self._in_flight.values():
            in_flight.update(storages)
        held = sum(in_flight.values())
        self.peak_bytes = max(self.peak_bytes, held)
        return held

    def release(self, key) -> None:
        del self._in_flight[key]
