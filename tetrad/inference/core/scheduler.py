"""Continuous batching: which sequences compute how many tokens in the next step. Plain Python.

Every step (as vLLM v1 does it, with v0's swap):
  1. running sequences, oldest first, each gets min(uncomputed tokens, budget left): one token for
     a decode, a chunk for a prompt still being prefilled. When the pool has no block for one,
     the newest running sequence is preempted (by recompute: blocks freed, re-queued at the front;
     or by swap: blocks copied to the CPU pool) until it fits, or until it was itself the newest;
  2. unless something was preempted this step (memory is short), swapped sequences come back;
  3. then waiting requests are admitted, first come first served, while the token budget, the
     sequence limit and the blocks (keeping a small watermark free) allow. A prompt longer than
     the budget is split over steps (chunked prefill).
Finished sequences free their blocks the moment they finish. A request that could never fit
(longer than the context, or more blocks than the whole pool) is rejected when it is added.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from tetrad.errors import check_choice, check_positive
from tetrad.spec.serving import PREEMPTION_MODES, ServeConfig
from tetrad.inference.core.block_manager import BlockManager
from tetrad.inference.core.params import RequestRejected, SamplingParams, check_stop_token
from tetrad.inference.core.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine's limits (their meaning and defaults: ServeConfig) and the context length."""

    max_num_seqs: int = ServeConfig.max_num_seqs
    max_num_batched_tokens: int = ServeConfig.max_num_batched_tokens
    max_model_len: int = 2048  # the model's context length
    preemption: str = ServeConfig.preemption

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            check_positive(name, getattr(self, name))
        check_choice("preemption", self.preemption, PREEMPTION_MODES)


@dataclass
class ScheduledBatch:
    """One step's work. The runner computes num_tokens[i] tokens of seqs[i] starting at its
    num_computed_tokens, and returns one row of logits per sequence whose `samples` flag is set
    (its chunk reaches the last token). Block copies happen first: swap_out, copies, swap_in."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (source, dest)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(num_tokens)
        self.samples.append(seq.num_computed_tokens + num_tokens == len(seq))

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_tokens)


def _by_priority(seq: Sequence) -> tuple[int, int]:
    return seq.priority


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by priority: the newest is last
        self.swapped: list[Sequence] = []  # sorted by priority
        self.num_preemptions = 0
        self._next_seq_id = 0
        self._next_arrival = 0

    # ---- requests -----------------------------------------------------------------------------

    def validate(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """The request's params with max_tokens resolved, or RequestRejected if it could never
        run: longer than the context, more blocks than the whole pool, or more samples than
        max_num_seqs."""
        limit = self.config.max_model_len
        if num_prompt_tokens == 0:
            raise RequestRejected("the prompt is empty: a prompt needs at least one token")
        if num_prompt_tokens >= limit:
            raise RequestRejected(f"the prompt has {num_prompt_tokens} tokens but the context "
                                  f"length is {limit}: shorten the prompt to at most {limit - 1} "
                                  f"tokens")
        if params.max_tokens is None:
            params = params.replace(max_tokens=limit - num_prompt_tokens)
        elif num_prompt_tokens + params.max_tokens > limit:
            raise RequestRejected(
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the context length {limit}: lower max_tokens to at most "
                f"{limit - num_prompt_tokens}")
        manager = self.block_manager
        needed = manager.blocks_for(num_prompt_tokens + params.max_tokens)
        if needed > manager.num_blocks:
            raise RequestRejected(
                f"the request needs {needed} KV blocks of {manager.block_size} tokens but the "
                f"whole pool has {manager.num_blocks}: lower max_tokens or raise --kv-memory")
        if params.n > self.config.max_num_seqs:
            raise RequestRejected(f"n = {params.n} exceeds max_num_seqs "
                                  f"{self.config.max_num_seqs}: lower n")
        return params

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> Sequence:
        """Queue a request (its first sample; the others fork off when its prompt is done)."""
        params = self.validate(len(prompt_token_ids), params)
        seq = Sequence(self._new_seq_id(), request_id, prompt_token_ids, params,
                       self._next_arrival)
        self._next_arrival += 1
        self.waiting.append(seq)
        return seq

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def sequences(self) -> list[Sequence]:
        return [*self.running, *self.swapped, *self.waiting]

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        manager = self.block_manager
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted a moment ago to make room for an older one
            if budget == 0:
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not manager.can_append(seq, num_new):
                victim = self.running[-1]  # the newest: never one scheduled before `seq`
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                batch.copies += manager.append_slots(seq, num_new)
                batch.add(seq, num_new)
                budget -= num_new
        if batch.preempted:
            return batch  # memory is short: admit nothing new this step

        while self.swapped and budget and self._num_seqs() < self.config.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if self.running and not manager.can_swap_in(seq, num_new):
                break
            self.swapped.pop(0)
            batch.swap_in += manager.swap_in(seq)
            self._start(seq, num_new, batch)
            budget -= num_new
        if self.swapped:
            return batch  # swapped sequences are older than every waiting one

        while self.waiting and budget:
            seq = self.waiting[0]
            if self._num_seqs() + seq.num_pending_forks > self.config.max_num_seqs:
                break
            # Prompt log-probabilities need every prompt position computed, cached or not.
            hits = [] if seq.params.prompt_logprobs is not None else manager.prefix_hits(seq)
            num_new = min(len(seq) - len(hits) * manager.block_size, budget)
            if not manager.can_allocate(seq, hits, num_new, use_watermark=bool(self.running)):
                break
            self.waiting.popleft()
            manager.allocate(seq, hits)
            self._start(seq, num_new, batch)
            budget -= num_new
        return batch

    def prepare_admission(self) -> None:
        """The part of admitting waiting requests that no step's outcome changes (their prompts'
        prefix-cache hashes), done ahead while a step computes; the admission itself (blocks,
        the budget) waits for schedule(). Only the queue's head can be admitted next."""
        for seq in itertools.islice(self.waiting, self.config.max_num_seqs):
            if seq.params.prompt_logprobs is None:
                self.block_manager.hash_prompt(seq)

    def _num_seqs(self) -> int:
        """Running sequences, counting the samples a prompt still being prefilled will fork into."""
        return sum(seq.num_pending_forks for seq in self.running)

    def _start(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_by_priority)
        batch.copies += self.block_manager.append_slots(seq, num_new)
        batch.add(seq, num_new)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        manager = self.block_manager
        if self.config.preemption == "swap" and manager.can_swap_out(seq):
            batch.swap_out += manager.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_by_priority)
        else:
            manager.free(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    def advance(self, batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
        """After the runner ran `batch`: record the computed tokens and return (sequence, logits
        row) for every sequence to sample now. A request with n > 1 forks here, when its prompt is
        done: the siblings share its blocks and its logits row."""
        to_sample = []
        row = 0
        for seq, num_new, samples in zip(batch.seqs, batch.num_tokens, batch.samples):
            self.block_manager.mark_computed(seq, num_new)
            if not samples:
                continue
            to_sample.append((seq, row))
            for index in range(1, seq.num_pending_forks):
                child = seq.fork(self._new_seq_id(), index)
                self.block_manager.fork(seq, child)
                bisect.insort(self.running, child, key=_by_priority)
                to_sample.append((child, row))
            seq.num_pending_forks = 1
            row += 1
        return to_sample

    def append_tokens(self, sampled: list[tuple[Sequence, int]],
                      eos_token_ids: tuple[int, ...] = ()) -> list[Sequence]:
        """Append each sampled token; finish (and free) the sequences that stop on it."""
        finished = []
        for seq, token in sampled:
            seq.append_token(token)
            reason = check_stop_token(seq.params, token, seq.num_output_tokens, eos_token_ids)
            if reason:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.free_swapped(seq)
        else:
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            elif seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> list[Sequence]:
        """Drop every sequence of a request (a client that went away) and free its blocks."""
        aborted = [seq for seq in self.sequences() if seq.request_id == request_id]
        for seq in aborted:
            self.finish(seq, "abort")
        return aborted
