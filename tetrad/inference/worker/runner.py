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

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tetrad.errors import ConfigError
from tetrad.inference.worker.attention import (flex_attention, flex_paged_attention, kernel_paged_decode,
                                        paged_block_mask, resolve_backend, sdpa_paged_attention,
                                        tiled_paged_attention, varlen_paged_attention,
                                        visible_keys)
from tetrad.inference.worker.config import ATTENTION_BACKENDS
from tetrad.inference.worker.cuda_graphs import DecodeGraphs
from tetrad.inference.worker.kv_cache import (TORCH_DTYPES, KVCache, KVPlan, parse_bytes,
                                       plan_kv_pool)
from tetrad.inference.core.scheduler import ScheduledBatch
from tetrad.models.layers import causal_attention

if TYPE_CHECKING:
    from tetrad.inference.worker.config import EngineConfig, RankShare

# With "auto", a call whose gathered K/V copy would exceed this many bytes goes to the tiled
# kernel, which never builds it. On CPU (benchmarks/bench_serving.py --attention) SDPA is twice
# as fast for prefill chunks over a cached context and on par for small decode batches; the tiled
# kernel ties or wins for decode batches whose contexts add up to 100+ MB of K/V.
GATHER_LIMIT_BYTES = 64 * 2**20
# A StepPlan.samples value: logits for every token of the chunk, not only the last (prompt
# log-probabilities, tetrad.inference.worker.logprobs); 1 is the last token's row, 0 none.
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

    In-place backends (flex, varlen) attend every sequence of the step in one call straight from
    the pool. The CPU backends attend the single-token sequences (decodes) together in one
    batched call: the C++ kernel in place ("cpu"), or gathered (sdpa, tiled, and "auto" where
    the kernel cannot be built); a chunk of several tokens with no cached context before it is
    plain causal attention over the chunk (the training path's SDPA); any other chunk attends
    over its cached context through its table, gathered."""

    def __init__(self, kv_cache: KVCache, backend: str, block_size: int,
                 flex: Callable = flex_attention):
        self.kv_cache, self.backend, self.block_size = kv_cache, backend, block_size
        self.flex = flex  # flex_attention, or its compiled form
        self.slots: torch.Tensor | None = None  # [tokens] where each token's K/V is written
        self.logits_indices: torch.Tensor | None = None  # [samples] rows that get logits
        self.all_decodes = False  # every sequence computes one token: rows are sequences
        self.tables: torch.Tensor | None = None  # [seqs, width], padded with the pad block
        self.query_positions: torch.Tensor | None = None  # [seqs, max_q], padding repeats
        self.query_rows: torch.Tensor | None = None  # [seqs, max_q] token row of each query
        self.token_index: torch.Tensor | None = None  # [tokens] its place in [seqs * max_q]
        self.block_mask = None  # flex: built once per step, shared by the layers
        self.decode_mask: torch.Tensor | None = None  # sdpa, decode steps: likewise
        self.varlen: tuple = ()  # varlen: (tables int32, cu_seq_q, cu_seq_k, lens, max_q, max_k)
        self.decode_seqs: torch.Tensor | None = None  # gathering: [decodes] their seq indices
        self.decode_rows: torch.Tensor | None = None  # gathering: [decodes] their token rows
        self.decode_tables: torch.Tensor | None = None  # cpu: [decodes, width]
        self.decode_lens: torch.Tensor | None = None  # cpu: [decodes] their context lengths
        self.rows_read: torch.Tensor | None = None  # cpu: int64 [1], counts K/V rows when set
        # gathering: (first row, end row, seq index; None when no cached context)
        self.chunks: list[tuple[int, int, int | None]] = []
        self.num_table_blocks: list[int] = []  # gathering: [seqs] table entries in use

    def gathered(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None
                 ) -> torch.Tensor:
        # K and V of every table entry, as SDPA's contiguous copy would hold them.
        size = 2 * tables.numel() * math.prod(k_cache.shape[1:]) * k_cache.element_size()
        if self.backend == "tiled" or (self.backend in ("auto", "cpu")
                                       and size > GATHER_LIMIT_BYTES):
            return tiled_paged_attention(q, k_cache, v_cache, tables, positions)
        return sdpa_paged_attention(q, k_cache, v_cache, tables, positions, mask)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """q: [1, heads, tokens, head_dim]; k, v: [1, kv_heads, tokens, head_dim] -> [1, heads,
        tokens, v's head_dim] (narrower than q's for MLA, whose values are its latents)."""
        k_cache, v_cache = self.kv_cache.layer(layer)
        if self.all_decodes and self.backend == "cpu":  # one op: the write, then attention
            return kernel_paged_decode(q, k_cache, v_cache, self.decode_tables, self.decode_lens,
                                       self.rows_read,
                                       (k, None if self.kv_cache.latent else v, self.slots))
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [tokens, heads, head_dim]
        self.kv_cache.write(layer, self.slots, k, v)
        if self.backend == "varlen":
            out = varlen_paged_attention(q, k_cache, v_cache, *self.varlen)
        elif self.backend == "flex":
            queries = q.unsqueeze(1) if self.all_decodes else q[self.query_rows]
            out = flex_paged_attention(queries, k_cache, v_cache, self.block_mask, self.flex)
            out = out[:, 0] if self.all_decodes else out.flatten(0, 1)[self.token_index]
        elif self.all_decodes:
            if self.decode_mask is None:  # made by the first layer, used by all
                self.decode_mask = visible_keys(self.tables, self.query_positions,
                                                self.block_size)
            out = self.gathered(q.unsqueeze(1), k_cache, v_cache, self.tables,
                                self.query_positions, self.decode_mask)[:, 0]
        else:
            out = self._gathered_mixed(q, k, v, k_cache, v_cache)
        return out.transpose(0, 1).unsqueeze(0)

    def _gathered_mixed(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        if self.decode_rows is not None and self.backend == "cpu":
            queries = q[self.decode_rows].transpose(0, 1).unsqueeze(0)  # the kernel's layout
            out[self.decode_rows] = kernel_paged_decode(
                queries, k_cache, v_cache, self.decode_tables, self.decode_lens,
                self.rows_read)[0].transpose(0, 1)
        elif self.decode_rows is not None:
            seqs = self.decode_seqs
            out[self.decode_rows] = self.gathered(
                q[self.decode_rows].unsqueeze(1), k_cache, v_cache, self.tables[seqs],
                self.query_positions[seqs, :1])[:, 0]
        for start, end, seq in self.chunks:
            if seq is None:
                chunk = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                out[start:end] = causal_attention(*chunk)[0].transpose(0, 1)
            else:
                blocks = self.num_table_blocks[seq]
                out[start:end] = self.gathered(
                    q[None, start:end], k_cache, v_cache, self.tables[seq:seq + 1, :blocks],
                    self.query_positions[seq:seq + 1, :end - start])[0]
        return out


class HostBatch:
    """Integer lists of a step, packed into one host tensor and sent to the device in one
    non-blocking copy (pinned memory on a GPU); `send` returns device views, one per list."""

    def __init__(self):
        self.lists: list[list[int]] = []

    def add(self, values: list[int]) -> int:
        self.lists.append(values)
        return len(self.lists) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        host = torch.tensor([v for values in self.lists for v in values], dtype=torch.long)
        if device.type == "cuda":
            host = host.pin_memory()
        return list(host.to(device, non_blocking=True).split([len(v) for v in self.lists]))


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, block_size: int,
                 attention: str = "auto", compile: bool = False):
        if attention not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, "
                              f"got {attention!r}")
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.device = next(model.parameters()).device
        self.backend = resolve_backend(attention, self.device, block_size, kv_cache.latent)
        # The forward, compiled on request (the model object stays the plain module).
        self.forward = torch.compile(model, dynamic=True) if compile else model
        # Eager FlexAttention is a dense reference over the whole pool; compiled it reads the
        # pool in place, so a GPU always compiles it. Inductor's CPU kernel fails to build with
        # dynamic shapes (torch 2.13): on a CPU it compiles once per step shape.
        self.flex = flex_attention
        if compile or self.device.type == "cuda":
            self.flex = torch.compile(flex_attention,
                                      dynamic=None if self.device.type == "cuda" else False)
        self.graphs = None  # DecodeGraphs, when captured (cuda_graphs.py)

    def new_context(self) -> StepContext:
        return StepContext(self.kv_cache, self.backend, self.block_size, self.flex)

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, StepContext]:
        """(input ids [tokens], positions [tokens], the step's context) for the forward pass."""
        size, pad = self.block_size, self.kv_cache.pad_block
        context = self.new_context()
        num_seqs, max_q = len(plan.starts), max(plan.num_tokens)
        width = max(map(len, plan.tables))
        positions, slots, logits_rows, tables = [], [], [], []
        query_rows, query_positions, token_index, decodes, decode_rows = [], [], [], [], []
        row = 0
        for index, (start, num_new, samples, table) in enumerate(
                zip(plan.starts, plan.num_tokens, plan.samples, plan.tables)):
            span = list(range(start, start + num_new))
            positions += span
            slots += [table[p // size] * size + p % size for p in span]
            tables += table + [pad] * (width - len(table))
            if samples == PROMPT_LOGITS:
                logits_rows += range(row, row + num_new)
            elif samples:
                logits_rows.append(row + num_new - 1)
            padding = max_q - num_new  # padded queries repeat the last one
            query_rows += list(range(row, row + num_new)) + [row + num_new - 1] * padding
            query_positions += span + [span[-1]] * padding
            token_index += range(index * max_q, index * max_q + num_new)
            if num_new > 1:
                context.chunks.append((row, row + num_new, index if start else None))
            else:
                decodes.append(index)
                decode_rows.append(row)
            row += num_new
        context.all_decodes = max_q == 1
        context.num_table_blocks = list(map(len, plan.tables))
        batch = HostBatch()
        ids = [batch.add(values) for values in (plan.token_ids, positions, slots, logits_rows,
                                                tables, query_positions)]
        extra = {}
        if self.backend == "flex" and not context.all_decodes:
            extra.update(rows=batch.add(query_rows), index=batch.add(token_index))
        if self.backend == "varlen":
            lens = [start + num for start, num in zip(plan.starts, plan.num_tokens)]
            extra.update(cu_q=batch.add([0, *itertools.accumulate(plan.num_tokens)]),
                         cu_k=batch.add([0, *itertools.accumulate(lens)]),
                         lens=batch.add(lens), max_k=max(lens))
        gathering = self.backend in ("auto", "sdpa", "tiled", "cpu")
        if gathering and decodes and not context.all_decodes:
            extra.update(decode_seqs=batch.add(decodes), decode_rows=batch.add(decode_rows))
        if self.backend == "cpu" and decodes:
            extra.update(decode_lens=batch.add([plan.starts[i] + 1 for i in decodes]))
            if not context.all_decodes:
                extra.update(decode_tables=batch.add(
                    [tables[i * width + j] for i in decodes for j in range(width)]))
        sent = batch.send(self.device)
        input_ids, positions_t, context.slots, context.logits_indices, tables_t, qpos_t = (
            sent[i] for i in ids)
        context.tables = tables_t.view(num_seqs, width)
        context.query_positions = qpos_t.view(num_seqs, max_q)
        if "rows" in extra:
            context.query_rows = sent[extra["rows"]].view(num_seqs, max_q)
            context.token_index = sent[extra["index"]]
        if self.backend == "flex":
            num_table_blocks = torch.div(context.query_positions[:, -1], size,
                                         rounding_mode="floor") + 1
            context.block_mask = paged_block_mask(context.tables, num_table_blocks,
                                                  context.query_positions,
                                                  self.kv_cache.pool.shape[2], size)
        if self.backend == "varlen":
            context.varlen = (context.tables.int(), sent[extra["cu_q"]].int(),
                              sent[extra["cu_k"]].int(), sent[extra["lens"]].int(), max_q,
                              extra["max_k"])
        if "decode_seqs" in extra:
            context.decode_seqs = sent[extra["decode_seqs"]]
            context.decode_rows = sent[extra["decode_rows"]]
        if "decode_lens" in extra:
            context.decode_lens = sent[extra["decode_lens"]]
            context.decode_tables = (context.tables if context.all_decodes
                                     else sent[extra["decode_tables"]].view(len(decodes), width))
        return input_ids, positions_t, context

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run the step; logits [sequences with samples set, vocab] in plan order (under tensor
        parallelism this rank's slice, [.., vocab / tp])."""
        # Swap-outs first: their device blocks may be handed to another sequence in this step.
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.copy_blocks(plan.copies)
        self.kv_cache.swap_in(plan.swap_in)
        if self.graphs is not None and self.graphs.fits(plan):
            return self.graphs.run(plan)
        input_ids, positions, context = self.prepare(plan)
        return self.forward(input_ids.unsqueeze(0), positions, cache=context)[0]


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
                        max_model_len, tp, len(model.layers))  # a pipeline stage's own
    if config.num_blocks:
        plan = plan.with_blocks(config.num_blocks)
    if ranks is not None:
        plan = ranks.agree(plan)
    runner = ModelRunner(model, KVCache(model.config, plan, dtype, device), plan.block_size,
                         config.attention, config.compile)
    # Graphs fix the tables' width at the longest context: only in-place attention reads no
    # more for it.
    if (device.type == "cuda" and not config.enforce_eager and ranks is None
            and runner.backend in ("flex", "varlen")):
        runner.graphs = DecodeGraphs(runner, config.max_num_seqs, max_model_len)
        runner.graphs.capture()
    return runner, plan
