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

from tetrad.inference.worker.attention import (BACKENDS, DeviceStep, HostStep, StepContext,
                                               resolve_backend)
from tetrad.inference.worker.cpu_decode import FusedCpuDecode, fused_decode_refusal
from tetrad.inference.worker.cuda_graphs import DecodeGraphs
from tetrad.inference.worker.kv_cache import (KV_TORCH_DTYPES, TORCH_DTYPES, KVCache, KVPlan,
                                              parse_bytes, plan_kv_pool, resolve_kv_dtype)
from tetrad.inference.core.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from tetrad.inference.worker.config import EngineConfig, RankShare

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

    def decode_slots_and_tables(self, block_size: int, pad: int
                                ) -> tuple[list[int], int, list[int]]:
        """For a step of one token per sequence (what CUDA graphs and the fused CPU step run):
        each token's pool slot, the width of the longest table, and every table padded to it with
        block `pad`, one after another."""
        width = max(map(len, self.tables))
        slots = [table[start // block_size] * block_size + start % block_size
                 for start, table in zip(self.starts, self.tables)]
        tables = [block for table in self.tables for block in table + [pad] * (width - len(table))]
        return slots, width, tables

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
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.device = next(model.parameters()).device
        # The name of the backend that runs ("auto" resolved); the runner never branches on it.
        self.backend = resolve_backend(attention, self.device, block_size, kv_cache.latent,
                                       kv_cache.pool.dtype)
        self.attention = BACKENDS[self.backend](kv_cache, block_size, compile)
        # The forward, compiled on request (the model object stays the plain module).
        self.forward = torch.compile(model, dynamic=True) if compile else model
        self.graphs = None  # DecodeGraphs, when captured (cuda_graphs.py)
        self.fused: FusedCpuDecode | None = None  # a CPU's one-op decode step

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, StepContext]:
        """(input ids [tokens], positions [tokens], the step's context) for the forward pass."""
        size, pad = self.block_size, self.kv_cache.pad_block
        max_q, width = max(plan.num_tokens), max(map(len, plan.tables))
        host = HostStep(plan.starts, plan.num_tokens, tables=[], width=width, max_q=max_q,
                        decodes=[], decode_rows=[], chunks=[],
                        num_table_blocks=list(map(len, plan.tables)))
        positions, slots, logits_rows, query_positions = [], [], [], []
        row = 0
        for index, (start, num_new, samples, table) in enumerate(
                zip(plan.starts, plan.num_tokens, plan.samples, plan.tables)):
            span = list(range(start, start + num_new))
            positions += span
            slots += [table[p // size] * size + p % size for p in span]
            host.tables += table + [pad] * (width - len(table))
            if samples == PROMPT_LOGITS:
                logits_rows += range(row, row + num_new)
            elif samples:
                logits_rows.append(row + num_new - 1)
            query_positions += span + [span[-1]] * (max_q - num_new)  # padding repeats the last
            if num_new > 1:
                host.chunks.append((row, row + num_new, index if start else None))
            else:
                host.decodes.append(index)
                host.decode_rows.append(row)
            row += num_new
        batch = HostBatch()
        ids = [batch.add(values) for values in (plan.token_ids, positions, slots, logits_rows,
                                                host.tables, query_positions)]
        uploads = {name: batch.add(values)
                   for name, values in self.attention.uploads(host).items()}
        sent = batch.send(self.device)
        input_ids, positions_t, slots_t, logits_indices, tables_t, qpos_t = (sent[i] for i in ids)
        step = DeviceStep(slots_t, tables_t.view(len(plan.starts), width),
                          qpos_t.view(len(plan.starts), max_q), host.all_decodes)
        attention = self.attention.prepare(host, step, {name: sent[i]
                                                        for name, i in uploads.items()})
        return input_ids, positions_t, StepContext(attention, logits_indices)

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
        if self.fused is not None and self.fused.fits(plan):
            return self.fused.run(plan)
        input_ids, positions, context = self.prepare(plan)
        return self.forward(input_ids.unsqueeze(0), positions, cache=context)[0]


def load_runner(model: nn.Module, config: "EngineConfig", max_model_len: int,
                device: torch.device, ranks: "RankShare | None" = None
                ) -> tuple[ModelRunner, KVPlan]:
    """This rank's runner: the model (with `ranks`, this rank's tensor-parallel share of it) on
    the device in the engine's dtype, and a KV pool sized from config. Every tensor-parallel rank
    calls it, in the same order: the ranks agree on the number of blocks here."""
    # Only a quantized model needs the quantizers: they import triton where it is installed
    # (~75 MB resident), which an unquantized model never runs.
    quantized = config.quantization != "none"
    if quantized:
        from tetrad.models.quant_model import quantize_model, whole_model_weights
    dtype = TORCH_DTYPES[config.dtype]
    # The whole model's quantized projections: stored with it (quant_store), else calibrated
    # here before a split.
    whole = getattr(model, "stored_quantized", None)
    stored = whole is not None
    if stored:
        del model.stored_quantized
        whole = whole.to(device, dtype)
    if ranks is not None:
        if quantized and not stored:
            whole = whole_model_weights(model, config.quantization, dtype)
        model = ranks.shard(model)
    if stored:  # before the move: the projections it replaces were never read (meta tensors)
        model = quantize_model(model, config.quantization, whole)
    model = model.to(device).eval()
    for param in model.parameters():  # buffers (rotary frequencies) stay fp32
        param.data = param.data.to(dtype)
    if quantized and not stored:
        model = quantize_model(model, config.quantization, whole)  # this rank's share
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, config.dtype)
    tp = 1 if ranks is None else ranks.size
    plan = plan_kv_pool(model.config, kv_dtype, device, config.block_size,
                        None if config.kv_memory is None else parse_bytes(config.kv_memory),
                        parse_bytes(config.swap_memory) if config.preemption == "swap" else 0,
                        max_model_len, tp, len(model.layers))  # a pipeline stage's own
    if config.num_blocks:
        plan = plan.with_blocks(config.num_blocks)
    if ranks is not None:
        plan = ranks.agree(plan)
    runner = ModelRunner(model, KVCache(model.config, plan, KV_TORCH_DTYPES[kv_dtype], device),
                         plan.block_size, config.attention, config.compile)
    # Graphs fix the tables' width at the longest context: only in-place attention reads no
    # more for it. Routed experts pick their tokens by a data-dependent torch.where, which a
    # capture refuses (cudaErrorStreamCaptureUnsupported, seen on an H200): MoE decodes eagerly.
    if (device.type == "cuda" and not config.enforce_eager and ranks is None
            and runner.attention.capturable and not model.config.num_experts):
        runner.graphs = DecodeGraphs(runner, config.max_num_seqs, max_model_len)
        runner.graphs.capture()
    if (device.type == "cpu" and not config.enforce_eager and not config.compile
            and ranks is None and runner.backend == "cpu"
            and fused_decode_refusal(runner.model, runner.kv_cache.pool.dtype) is None):
        runner.fused = FusedCpuDecode(runner.model, runner.kv_cache, plan.block_size)
    return runner, plan
