"""The CPU's decode attention (`--attention cpu`, auto on a CPU): a C++ kernel (paged_decode.cpp,
built on first use by cpu_kernels.py) that walks each sequence's block table and reads every K
and V row of its context once, straight from the pool, with a running max and sum per head. A
decode step is one op per layer: the step's K/V written at its slots, then attention. Prefill
chunks over a cached context are gathered (SDPA, or the tiled kernel when large).
"""

from __future__ import annotations

import torch

from tetrad.inference.worker.attention.base import DeviceStep, HostStep, StepAttention
from tetrad.inference.worker.attention.sdpa import GatheringStep
from tetrad.inference.worker.attention.tiled import SizedGatheringBackend
from tetrad.inference.worker.cpu_kernels import KernelUnavailable, load_cpu_kernels


def kernel_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        rows_read: torch.Tensor | None = None,
                        new: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None
                        ) -> torch.Tensor:
    """One query per sequence, on a CPU, in the model's layout: q [1, heads, seqs, head_dim] over
    keys 0..context_lens[b] - 1 of sequence b (int64 block_tables and context_lens) -> [1, heads,
    seqs, v's head_dim]. `new`: (k, v, slots), the step's keys and values [1, kv_heads, seqs,
    head_dim] (v None for MLA, whose values live in its keys), written at `slots` first, in the
    same call. `rows_read` (int64 [1]), when given, gains the K and V rows the kernel read (one
    per token and KV head each): what tests and the benchmark count. Raises KernelUnavailable
    where the kernel cannot be built."""
    load_cpu_kernels()  # built or loaded once per process; a cached no-op after that
    new_k, new_v, slots = new or (None, None, None)
    return torch.ops.tetrad.paged_decode(q, k_cache, v_cache, block_tables, context_lens,
                                         q.shape[-1] ** -0.5, new_k, new_v, slots, rows_read)


class KernelStep(GatheringStep):
    """Decodes through the kernel (`decode_tables` [decodes, width], `decode_lens` [decodes]);
    `rows_read` (int64 [1]), when set, counts the K/V rows it reads."""

    def __init__(self, backend, step, decode_tables, decode_lens, host=None, decode_rows=None):
        super().__init__(backend, step, host, decode_rows=decode_rows)
        self.decode_tables, self.decode_lens = decode_tables, decode_lens
        self.rows_read: torch.Tensor | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        if not self.step.all_decodes:
            return super().attend(layer, q, k, v)
        k_cache, v_cache = self.kv_cache.layer(layer)
        return kernel_paged_decode(q, k_cache, v_cache, self.decode_tables, self.decode_lens,
                                   self.rows_read,
                                   (k, None if self.kv_cache.latent else v, self.step.slots))

    def attend_decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                       ) -> torch.Tensor:
        queries = q.transpose(0, 1).unsqueeze(0)  # the kernel's layout
        return kernel_paged_decode(queries, k_cache, v_cache, self.decode_tables,
                                   self.decode_lens, self.rows_read)[0].transpose(0, 1)


class CpuKernelBackend(SizedGatheringBackend):
    name = "cpu"
    devices = ("cpu",)
    automatic = True
    reads_fp8 = False  # the kernel reads the pool in the model's dtype

    @classmethod
    def refusal(cls, device, block_size, latent, dtype=None) -> str | None:
        if device.type != "cpu":
            return ("--attention cpu is the CPU's decode kernel: on a GPU use --attention auto, "
                    "flex or varlen")
        try:
            load_cpu_kernels()
        except KernelUnavailable as error:
            return f"--attention cpu: {error}"
        return None

    def uploads(self, host: HostStep) -> dict[str, list[int]]:
        if not host.decodes:
            return {}
        lens = [host.starts[i] + 1 for i in host.decodes]
        if host.all_decodes:  # the step's own tables are the decodes'
            return {"decode_lens": lens}
        width = host.width
        return {"decode_lens": lens, "decode_rows": host.decode_rows,
                "decode_tables": [block for i in host.decodes
                                  for block in host.tables[i * width:(i + 1) * width]]}

    def prepare(self, host: HostStep, step: DeviceStep, sent: dict[str, torch.Tensor]
                ) -> StepAttention:
        tables = sent.get("decode_tables")
        if tables is not None:
            tables = tables.view(len(host.decodes), host.width)
        return KernelStep(self, step, step.tables if host.all_decodes else tables,
                          sent.get("decode_lens"), host, sent.get("decode_rows"))

    def graph_step(self, step: DeviceStep) -> StepAttention:
        return KernelStep(self, step, step.tables, step.query_positions[:, 0] + 1)
