"""Triton's paged attention (`--attention triton`, auto on a GPU where triton runs): the kernels of
worker/triton_attention.py read the pool in place through the block tables, any block size, on
any torch that brings triton. Decode steps (eager or replayed from a CUDA graph) run the split-KV
decode kernel, with a split count that depends only on the batch and the tables' width; steps with
prefill chunks run the one kernel for every token. On a CPU it runs only under Triton's
interpreter (TRITON_INTERPRET=1 before triton is imported): how the tests run it.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

from tetrad.inference.worker.attention.base import (AttentionBackend, DeviceStep, HostStep,
                                                    StepAttention)


def _kernels():
    # Imported on first use, not with the engine: importing triton takes a second, and fixes for
    # the process whether its kernels are compiled or interpreted.
    from tetrad.inference.worker import triton_attention
    return triton_attention


class TritonStep:
    """A step's int32 tables [seqs, width] and context lengths [seqs]; `cu_seq_q` (int32
    [seqs + 1]) when some sequence has several queries, else decodes in `num_splits` ranges."""

    def __init__(self, kv_cache, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 cu_seq_q: torch.Tensor | None = None, num_splits: int = 1):
        self.kv_cache, self.slots, self.tables, self.lens = kv_cache, slots, tables, lens
        self.cu_seq_q, self.num_splits = cu_seq_q, num_splits

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.layer(layer)
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [tokens, heads, head_dim]
        self.kv_cache.write(layer, self.slots, k, v)
        kernels = _kernels()
        if self.cu_seq_q is None:  # the split scratch is allocated here: in a graph, its memory
            out = kernels.triton_paged_decode(q, k_cache, v_cache, self.tables, self.lens,
                                              self.num_splits)
        else:
            out = kernels.triton_paged_attention(q, k_cache, v_cache, self.tables,
                                                 self.cu_seq_q, self.lens)
        return out.transpose(0, 1).unsqueeze(0)


class TritonBackend(AttentionBackend):
    name = "triton"
    automatic = True
    capturable = True

    def __init__(self, kv_cache, block_size: int, compile: bool = False):
        super().__init__(kv_cache, block_size, compile)
        device = kv_cache.pool.device
        self.multiprocessors = (torch.cuda.get_device_properties(device).multi_processor_count
                                if device.type == "cuda" else 1)

    @classmethod
    def refusal(cls, device, block_size, latent, dtype=None) -> str | None:
        reason = super().refusal(device, block_size, latent, dtype)
        cpu_refusal = ("--attention triton runs on a CPU only under Triton's interpreter "
                       "(TRITON_INTERPRET=1), for tests: use --attention auto")
        if not reason and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1" \
                and "tetrad.inference.worker.triton_attention" not in sys.modules:
            # Not interpreted, so not runnable here: asking the kernels would import triton,
            # whose library a CPU engine would then hold (~70 MB resident) for nothing.
            return cpu_refusal
        if reason or _kernels().triton_available(device):
            return reason
        if device.type == "cpu":
            return cpu_refusal
        return "--attention triton: triton does not import or has no GPU driver here"

    def uploads(self, host: HostStep) -> dict[str, list[int]]:
        lens = [start + num for start, num in zip(host.starts, host.num_tokens)]
        if host.all_decodes:
            return {"lens": lens}
        return {"lens": lens, "cu_seq_q": [0, *itertools.accumulate(host.num_tokens)]}

    def _decode_splits(self, tables: torch.Tensor) -> int:
        """The split count of a decode over tables [seqs, width]: from shapes only, so a graph
        bucket keeps one."""
        return _kernels().decode_splits(tables.shape[0], self.kv_cache.kv_heads,
                                        self.kv_cache.head_dim, tables.shape[1] * self.block_size,
                                        self.multiprocessors)

    def prepare(self, host: HostStep, step: DeviceStep, sent: dict[str, torch.Tensor]
                ) -> StepAttention:
        tables, lens = step.tables.int(), sent["lens"].int()
        if host.all_decodes:
            return TritonStep(self.kv_cache, step.slots, tables, lens, None,
                              self._decode_splits(tables))
        return TritonStep(self.kv_cache, step.slots, tables, lens, sent["cu_seq_q"].int())

    def graph_step(self, step: DeviceStep) -> StepAttention:
        tables = step.tables.int()
        lens = (step.query_positions[:, 0] + 1).int()
        return TritonStep(self.kv_cache, step.slots, tables, lens, None,
                          self._decode_splits(tables))
