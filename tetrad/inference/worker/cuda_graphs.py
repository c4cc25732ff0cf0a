"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (as vLLM and nano-vllm
do): a step of n single-token sequences runs the graph of the smallest bucket >= n, its inputs
padded to the bucket. A replay is one launch for the whole forward instead of one per kernel
(about 45 per layer), which is what bounds small decode batches on a GPU.

The graphs read their inputs from static device buffers (token ids, positions, slots, block
tables as wide as the longest context); a step copies its own into them (one upload) and replays.
Padding rows write and read the KV pool's pad block, which no sequence owns. Attention inside a
graph must read the pool in place with shapes fixed at capture (a backend's `capturable`); its
step data is made from the static buffers by the backend's `graph_step`, on the device, so a
replay remakes it from the refilled buffers.

Without CUDA (the tests on CPU) `capture` records the same forward on the same buffers and `run`
calls it, so bucket choice, padding and the static-buffer forward are checked everywhere.
"""

from __future__ import annotations

import torch

from tetrad.inference.worker.attention import DeviceStep, StepContext

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16  # above 8 sequences, a bucket every 16 (nano-vllm's choice)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 16, and max_num_seqs itself."""
    sizes = {size for size in SMALL_BUCKETS if size < max_num_seqs}
    sizes.update(range(BUCKET_STEP, max_num_seqs, BUCKET_STEP))
    return sorted(sizes | {max_num_seqs})


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `batch` sequences, None when none does."""
    return next((size for size in buckets if size >= batch), None)


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int):
        """runner: the runner.ModelRunner whose forward the graphs replay (not imported here:
        runner.py imports this module)."""
        self.runner = runner
        self.buckets = graph_buckets(max_num_seqs)
        size = runner.block_size
        self.width = -(-max_model_len // size)  # table entries of the longest context
        largest, device = self.buckets[-1], runner.device
        pad = runner.kv_cache.pad_block
        self.token_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slots = torch.full((largest,), pad * size, dtype=torch.long, device=device)
        self.tables = torch.full((largest, self.width), pad, dtype=torch.long, device=device)
        self.rows = torch.arange(largest + 1, device=device)
        self.replays: dict[int, tuple] = {}  # bucket -> (replay, its logits)
        self.pool = None  # the graphs' shared memory pool

    def fits(self, plan) -> bool:
        """A decode-only step (a runner.StepPlan) that a captured bucket holds."""
        return (len(plan.starts) <= self.buckets[-1] and max(plan.num_tokens) == 1
                and all(plan.samples) and max(map(len, plan.tables)) <= self.width)

    def _context(self, bucket: int):
        step = DeviceStep(self.slots[:bucket], self.tables[:bucket],
                          self.positions[:bucket, None], all_decodes=True)
        return StepContext(self.runner.attention.graph_step(step), self.rows[:bucket])

    def _forward(self, bucket: int) -> torch.Tensor:
        context = self._context(bucket)
        return self.runner.forward(self.token_ids[None, :bucket], self.positions[:bucket],
                                   cache=context)[0]

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first, all in one memory pool (on CPU: the forward)."""
        for bucket in reversed(self.buckets):
            if self.runner.device.type != "cuda":
                self.replays[bucket] = (None, None)
                continue
            self._forward(bucket)  # warm-up: lazy initialisations stay out of the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._forward(bucket)
            self.pool = graph.pool()
            self.replays[bucket] = (graph.replay, logits)

    def run(self, plan) -> torch.Tensor:
        """The step's logits [sequences, vocab], from the bucket's graph."""
        num_seqs = len(plan.starts)
        bucket = bucket_for(num_seqs, self.buckets)
        size, pad = self.runner.block_size, self.runner.kv_cache.pad_block
        padding = bucket - num_seqs
        slots, width, tables = plan.decode_slots_and_tables(size, pad)
        host = torch.tensor(plan.token_ids + [0] * padding + plan.starts + [0] * padding
                            + slots + [pad * size] * padding + tables + [pad] * (width * padding),
                            dtype=torch.long)
        if host.device != self.token_ids.device:
            host = host.pin_memory().to(self.token_ids.device, non_blocking=True)
        ids, positions, slot_values, table_values = host.split([bucket] * 3 + [bucket * width])
        self.token_ids[:bucket].copy_(ids)
        self.positions[:bucket].copy_(positions)
        self.slots[:bucket].copy_(slot_values)
        self.tables[:bucket, :width].copy_(table_values.view(bucket, width))
        replay, logits = self.replays[bucket]
        if replay is None:  # no CUDA: the recorded forward on the same buffers
            return self._forward(bucket)[:num_seqs]
        replay()
        return logits[:num_seqs]
