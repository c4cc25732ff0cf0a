"""One sequence as the scheduler and the block manager see it. Plain Python: no torch.

Prefill and decode are the same operation here (as in vLLM v1): a step computes the K/V of some
tokens [num_computed_tokens, num_computed_tokens + k). When that reaches the last token, the step's
logits give the next token. A prompt is "prefilled" by one or more such chunks, a decode is k = 1,
and a sequence preempted by recompute simply starts again from num_computed_tokens = 0.
"""

from __future__ import annotations

import enum
from typing import Any

from tetrad.inference.core.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # no blocks: not started, or preempted by recompute
    RUNNING = "running"  # blocks in the device pool
    SWAPPED = "swapped"  # blocks copied to the CPU pool (preempted by swap)
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, arrival: int, index: int = 0):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # which of the request's n samples this is
        self.params = params
        self.arrival = arrival  # order of admission: the newest running sequence is preempted first
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []  # logical block i -> physical block (device or CPU pool)
        self.block_hashes: list[int] = []  # hash chain of the full blocks, computed once
        self.num_computed_tokens = 0  # tokens whose K/V sit in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.num_pending_forks = params.n  # forked into n samples when the prompt is done
        self.finish_reason: str | None = None
        self.generator: Any = None  # the sampler's random state, kept across preemptions

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.value}, tokens={len(self)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")

    @property
    def priority(self) -> tuple[int, int]:
        return self.arrival, self.seq_id

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, seq_id: int, index: int) -> "Sequence":
        """A sibling sample that shares everything computed so far (the block manager shares the
        blocks; the sampler gives it its own random stream)."""
        child = Sequence(seq_id, self.request_id, [], self.params, self.arrival, index)
        child.token_ids = list(self.token_ids)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.status = self.status
        child.block_hashes = list(self.block_hashes)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.num_pending_forks = 1
        return child
