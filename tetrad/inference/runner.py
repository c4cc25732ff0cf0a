"""Runs one scheduled step on the model: block copies, then one forward pass over every scheduled
token of every sequence, flattened into a single row, with attention over the paged KV cache.

The runner owns no model math. It calls the model's own forward with a `cache` (a StepContext);
each attention layer hands it q, k, v after the model's QKV projection and rotary embedding, and
gets back attention over the sequence's cached context plus its new tokens.

A step reaches the runner as a StepPlan: plain integers, nothing of the scheduler's objects, so
that under tensor parallelism rank 0 can send it to the other ranks (tetrad.inference.tp) and
every rank builds the same step from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tetrad.errors import ConfigError
from tetrad.inference.attention import sdpa_paged_attention, tiled_paged_attention
from tetrad.inference.config import ATTENTION_BACKENDS
from tetrad.inference.kv_cache import (TORCH_DTYPES, KVCache, KVPlan, parse_bytes,
                                       plan_kv_pool)
from tetrad.inference.scheduler import ScheduledBatch
from tetrad.models.layers import causal_attention

if TYPE_CHECKING:
    from tetrad.inference.config import EngineConfig, RankShare

# With "auto", a call whose gathered K/V copy would exceed this many bytes goes to the tiled
# kernel, which never builds it. On CPU (benchmarks/bench_serving.py --attention) SDPA is twice
# as fast for prefill chunks over a cached context and on par for small decode batches; the tiled
# kernel ties or wins for decode batches whose contexts add up to 100+ MB of K/V.
GATHER_LIMIT_BYTES = 64 * 2**20
# A StepPlan.samples value: logits for every token of the chunk, not only the last (prompt
# log-probabilities, tetrad.inference.logprobs); 1 is the last token's row, 0 none.
PROMPT_LOGITS = 2


def _flat(pairs: list[tuple[int, int]]) -> list[int]:
    return [block for pair in pairs for block in pair]


def _pairs(flat: list[int]) -> list[tuple[int, int]]:
    return list(zip(flat[0::2], flat[1::2]))


@dataclass
class StepPlan:
    """One step as plain integers: for each scheduled sequence its new tokens, the position of the
    first (its num_computed_tokens), whether the last one gets logits, and the block table entries
    that cover them; and the block copies to do before the forward (ScheduledBatch's order)."""

    token_ids: list[int] = field(default_factory=list)  # [tokens], sequence after sequence
    starts: list[int] = field(default_factory=list)  # [seqs]
    num_tokens: list[int] = field(default_factory=list)  # [seqs]
    # [seqs] 1: a logits row for its last token; PROMPT_LOGITS: a row for each of its tokens
    samples: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)  # [seqs][ceil((start + num) / size)]
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)

    @classmethod
    def from_batch(cls, batch: ScheduledBatch, block_size: int) -> "StepPlan":
        plan = cls(swap_out=batch.swap_out, copies=batch.copies, swap_in=batch.swap_in)
        for seq, num_new, samples in zip(batch.seqs, batch.num_tokens, batch.samples):
            start = seq.num_computed_tokens
            plan.token_ids += seq.token_ids[start:start + num_new]
            plan.starts.append(start)
            plan.num_tokens.append(num_new)
            wants_prompt = (seq.params.prompt_logprobs is not None
                            and start < seq.num_prompt_tokens)
            plan.samples.append(PROMPT_LOGITS if wants_prompt else int(samples))
            plan.tables.append(seq.block_table[:-(-(start + num_new) // block_size)])
        return plan

    # The wire format (tensor-parallel ranks): sizes first, then every list in one int64 row of
    # payload_size(sizes) values. Table lengths are not sent: they follow from start + num_tokens.

    def sizes(self) -> list[int]:
        """[seqs, tokens, table entries, swap-outs, copies, swap-ins]."""
        return [len(self.starts), len(self.token_ids), sum(map(len, self.tables)),
                len(self.swap_out), len(self.copies), len(self.swap_in)]

    @staticmethod
    def payload_size(sizes: list[int]) -> int:
        seqs, tokens, entries, swap_out, copies, swap_in = sizes
        return tokens + 3 * seqs + entries + 2 * (swap_out + copies + swap_in)

    def payload(self) -> list[int]:
        return [*self.token_ids, *self.starts, *self.num_tokens, *self.samples,
                *(block for table in self.tables for block in table),
                *_flat(self.swap_out), *_flat(self.copies), *_flat(self.swap_in)]

    @classmethod
    def decode(cls, sizes: list[int], payload: list[int], block_size: int) -> "StepPlan":
        seqs, tokens, entries, swap_out, copies, swap_in = sizes
        end = 0

        def take(count: int) -> list[int]:
            nonlocal end
            end += count
            return payload[end - count:end]

        plan = cls(take(tokens), take(seqs), take(seqs), take(seqs))
        plan.tables = [take(-(-(start + num) // block_size))
                       for start, num in zip(plan.starts, plan.num_tokens)]
        plan.swap_out, plan.copies, plan.swap_in = (_pairs(take(2 * n))
                                                    for n in (swap_out, copies, swap_in))
        return plan


class StepContext:
    """What attention needs to know about one step, built once and used by every layer.

    Sequences computing one token (decodes) are attended together in one batched call; a chunk of
    several tokens with no cached context before it is plain causal attention over the chunk (the
    training path's SDPA); any other chunk attends over its cached context through its table."""

    def __init__(self, kv_cache: KVCache, attention: str, device: torch.device):
        self.kv_cache, self.attention, self.device = kv_cache, attention, device
        self.slots: torch.Tensor | None = None  # [tokens] where each token's K/V is written
        self.logits_indices: torch.Tensor | None = None  # [samples] rows that get logits
        self.decode_rows: torch.Tensor | None = None  # [decodes] their token rows
        self.decode_tables: torch.Tensor | None = None  # [decodes, max_blocks]
        self.decode_positions: torch.Tensor | None = None  # [decodes, 1]
        # (first row, end row, table [1, blocks] and positions [1, chunk]; None when no context)
        self.chunks: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []

    def paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # K and V of every table entry, as SDPA's contiguous copy would hold them.
        gathered = 2 * tables.numel() * k_cache[0].numel() * k_cache.element_size()
        if self.attention == "tiled" or (self.attention == "auto"
                                         and gathered > GATHER_LIMIT_BYTES):
            return tiled_paged_attention(q, k_cache, v_cache, tables, positions)
        return sdpa_paged_attention(q, k_cache, v_cache, tables, positions)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """q: [1, heads, tokens, head_dim]; k, v: [1, kv_heads, tokens, head_dim] -> like q."""
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [tokens, heads, head_dim]
        self.kv_cache.write(layer, self.slots, k, v)
        k_cache, v_cache = self.kv_cache.layer(layer)
        out = torch.empty_like(q)
        if self.decode_rows is not None:
            queries = q[self.decode_rows].unsqueeze(1)  # [decodes, 1, heads, head_dim]
            out[self.decode_rows] = self.paged(queries, k_cache, v_cache, self.decode_tables,
                                               self.decode_positions)[:, 0]
        for start, end, table, positions in self.chunks:
            if table is None:
                chunk = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                out[start:end] = causal_attention(*chunk)[0].transpose(0, 1)
            else:
                out[start:end] = self.paged(q[None, start:end], k_cache, v_cache, table,
                                            positions)[0]
        return out.transpose(0, 1).unsqueeze(0)


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, block_size: int,
                 attention: str = "auto"):
        if attention not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, "
                              f"got {attention!r}")
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.attention = attention
        self.device = next(model.parameters()).device

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, StepContext]:
        """(input ids [tokens], positions [tokens], the step's context) for the forward pass."""
        size = self.block_size
        positions, slots, logits_rows = [], [], []
        decode_rows, decode_tables, decode_positions = [], [], []
        context = StepContext(self.kv_cache, self.attention, self.device)
        row = 0
        for start, num_new, samples, table in zip(plan.starts, plan.num_tokens, plan.samples,
                                                  plan.tables):
            span = range(start, start + num_new)
            positions += span
            slots += [table[p // size] * size + p % size for p in span]
            if samples == PROMPT_LOGITS:
                logits_rows += range(row, row + num_new)
            elif samples:
                logits_rows.append(row + num_new - 1)
            if num_new == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_positions.append([start])
            elif start == 0:
                context.chunks.append((row, row + num_new, None, None))
            else:
                context.chunks.append((row, row + num_new, self._tensor([table]),
                                       self._tensor([list(span)])))
            row += num_new
        if decode_rows:
            width = max(len(table) for table in decode_tables)
            context.decode_rows = self._tensor(decode_rows)
            context.decode_tables = self._tensor([table + [0] * (width - len(table))
                                                  for table in decode_tables])
            context.decode_positions = self._tensor(decode_positions)
        context.slots = self._tensor(slots)
        context.logits_indices = self._tensor(logits_rows)
        return self._tensor(plan.token_ids), self._tensor(positions), context

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run the step; logits [sequences with samples set, vocab] in plan order (under tensor
        parallelism this rank's slice, [.., vocab / tp])."""
        # Swap-outs first: their device blocks may be handed to another sequence in this step.
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.copy_blocks(plan.copies)
        self.kv_cache.swap_in(plan.swap_in)
        input_ids, positions, context = self.prepare(plan)
        return self.model(input_ids.unsqueeze(0), positions, cache=context)[0]


def load_runner(model: nn.Module, config: "EngineConfig", max_model_len: int,
                device: torch.device, ranks: "RankShare | None" = None
                ) -> tuple[ModelRunner, KVPlan]:
    """This rank's runner: the model (with `ranks`, this rank's tensor-parallel share of it) on
    the device in the engine's dtype, and a KV pool sized from config. Every tensor-parallel rank
    calls it, in the same order: the ranks agree on the number of blocks here."""
    if ranks is not None:
        model = ranks.shard(model)
    model = model.to(device).eval()
    dtype = TORCH_DTYPES[config.dtype]
    for param in model.parameters():  # buffers (rotary frequencies) stay fp32
        param.data = param.data.to(dtype)
    tp = 1 if ranks is None else ranks.size
    plan = plan_kv_pool(model.config, config.dtype, device, config.block_size,
                        None if config.kv_memory is None else parse_bytes(config.kv_memory),
                        parse_bytes(config.swap_memory) if config.preemption == "swap" else 0,
                        max_model_len, tp)
    if config.num_blocks:
        plan = plan.with_blocks(config.num_blocks)
    if ranks is not None:
        plan = ranks.agree(plan)
    runner = ModelRunner(model, KVCache(model.config, plan, dtype, device), plan.block_size,
                         config.attention)
    return runner, plan
