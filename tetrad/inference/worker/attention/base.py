"""The interface every attention backend implements, and the step as the runner hands it over.

The runner makes one pass over a step's plan (`HostStep`: its integers), sends them to the device
in one copy together with whatever lists the backend asks for (`uploads`), and gets back from
`prepare` the backend's own step data (a `StepAttention`), which every layer of the forward then
calls. A decode step replayed from a CUDA graph has no host integers: the graph's static buffers
are refilled before each replay, and `graph_step` builds the step data from them on the device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from tetrad.inference.worker.kv_cache import KVCache


@dataclass
class HostStep:
    """A step's integers, from the runner's one pass over its plan. Rows are the step's tokens,
    sequence after sequence; queries are padded to max_q per sequence by repeating the last."""

    starts: list[int]  # [seqs] position of each sequence's first new token
    num_tokens: list[int]  # [seqs] its new tokens
    tables: list[int]  # [seqs * width] block tables, padded with the pool's pad block
    width: int  # table entries of the longest context
    max_q: int  # the most new tokens of any sequence
    decodes: list[int]  # sequences with one new token
    decode_rows: list[int]  # their token rows
    # sequences with several new tokens: (first row, end row, sequence; None: no cached context)
    chunks: list[tuple[int, int, int | None]]
    num_table_blocks: list[int]  # [seqs] table entries in use

    @property
    def all_decodes(self) -> bool:
        """Every sequence computes one token: rows are sequences."""
        return self.max_q == 1


@dataclass
class DeviceStep:
    """What every backend reads on the device: where each token's K/V goes, the padded block
    tables and each sequence's query positions (a query sees keys at positions <= its own)."""

    slots: torch.Tensor  # [tokens]
    tables: torch.Tensor  # [seqs, width]
    query_positions: torch.Tensor  # [seqs, max_q]
    all_decodes: bool


class StepAttention(Protocol):
    """A backend's data for one step, made once and called by every layer."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """q: [1, heads, tokens, head_dim]; k, v: [1, kv_heads, tokens, head_dim] -> [1, heads,
        tokens, v's head_dim]. Writes the step's k and v into the pool at the step's slots first;
        MLA's v is a view of k's first columns and is not stored again."""
        ...


class StepContext:
    """What the model's forward reads of a step (its `cache` argument): the rows that get logits,
    and attention, which each layer calls with its index; the backend's step data does it."""

    def __init__(self, attention: StepAttention, logits_indices: torch.Tensor):
        self.attention, self.logits_indices = attention, logits_indices

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        return self.attention.attend(layer, q, k, v)


class AttentionBackend(ABC):
    """One way of attending over the paged pool; `registry.py` lists them by name."""

    name: ClassVar[str]  # the --attention value
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")  # the device types it runs on
    automatic: ClassVar[bool] = False  # --attention auto may pick it (registry.py's order)
    # A CUDA graph may replay it: it reads the pool in place with shapes fixed at capture, so
    # tables as wide as the longest context cost nothing.
    capturable: ClassVar[bool] = False
    # It reads an fp8 pool (--kv-cache-dtype fp8), upcasting what it reads.
    reads_fp8: ClassVar[bool] = False

    def __init__(self, kv_cache: KVCache, block_size: int, compile: bool = False):
        self.kv_cache, self.block_size = kv_cache, block_size

    @classmethod
    def refusal(cls, device: torch.device, block_size: int, latent: bool,
                dtype: torch.dtype | None = None) -> str | None:
        """Why this backend cannot run here (one line for `--attention NAME`), or None. `latent`:
        MLA's cache, whose values are narrower than its keys; dtype None: not known yet."""
        if device.type not in cls.devices:
            return f"--attention {cls.name} runs on {' or '.join(cls.devices)} only"
        return None

    def uploads(self, host: HostStep) -> dict[str, list[int]]:
        """Integer lists this backend needs on the device, sent with the step's one copy."""
        return {}

    @abstractmethod
    def prepare(self, host: HostStep, step: DeviceStep, sent: dict[str, torch.Tensor]
                ) -> StepAttention:
        """The step data for an eager step; `sent` holds the uploads' device views by name."""

    @abstractmethod
    def graph_step(self, step: DeviceStep) -> StepAttention:
        """The step data for a decode step in a graph's static buffers (one query per row): made
        from the buffers with device ops only, so that a replay recomputes it from refilled
        buffers. Called once per batch-size bucket at capture (on a CPU, every step)."""
