"""Attention data parallelism (`--dp D`), with the experts spread over the same ranks (`--ep D`,
or over each group of E ranks with `--ep E` dividing D): the planner's throughput layout for
DeepSeek (tp1 dp16 ep16).

Each dp rank owns its requests and a KV pool of its own and runs attention, the dense layers and
the shared expert on its sequences alone (every rank holds those weights whole). With ep > 1 a
MoE layer's routed experts are divided over each ep group of ranks, and each rank's tokens go to
the ranks that own their experts and come back by all-to-all: training's dispatch and combine
(tetrad.parallel.expert_parallel.ExpertParallelMoE), used as it is.

Scheduling. Rank 0 runs one Scheduler and BlockManager per dp rank (DataParallelScheduler): a new
request goes to the rank with the fewest unfinished sequences (the lowest rank on a tie) and stays
there, with its forks, its prefix-cache hits, its preemptions and swaps; block ids are that rank's.
A step is every rank's batch, scheduled independently; rank 0 sends each rank its StepPlan (all of
them in one broadcast) and every rank runs its own forward in lockstep, since each MoE layer's
all-to-all needs every rank. A rank with nothing scheduled still takes part: it runs only the MoE
layers' dispatch and combine, on no tokens of its own (`idle_step`). The logits come back to rank 0
rank after rank, in the order of the merged batch the engine samples from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tetrad.inference.core.block_manager import BlockManager
from tetrad.inference.core.params import SamplingParams
from tetrad.inference.worker.runner import ModelRunner, StepPlan
from tetrad.inference.core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tetrad.inference.core.sequence import Sequence
from tetrad.parallel.expert_parallel import ExpertParallelMoE


class DataParallelBatch(ScheduledBatch):
    """The dp ranks' batches, merged rank after rank for the engine (which samples from it);
    `parts` are the batches themselves, whose block ids are each rank's own."""

    def __init__(self, parts: list[ScheduledBatch]):
        super().__init__()
        self.parts = parts
        for part in parts:
            self.seqs += part.seqs
            self.num_tokens += part.num_tokens
            self.samples += part.samples
            self.preempted += part.preempted

    def plans(self, block_size: int) -> list[StepPlan]:
        return [StepPlan.from_batch(part, block_size) for part in self.parts]


class PooledBlocks:
    """The dp ranks' block managers seen as one, for the engine's statistics: sums of theirs."""

    def __init__(self, managers: list[BlockManager]):
        self.managers = managers
        self.block_size = managers[0].block_size

    def __getattr__(self, name: str) -> int:
        if name in ("num_used_blocks", "num_blocks", "num_prefix_hits", "num_prefix_queries"):
            return sum(getattr(manager, name) for manager in self.managers)
        raise AttributeError(name)


class DataParallelScheduler:
    """One Scheduler per dp rank, behind the Scheduler interface the engine and its request
    tracker use. Every rank's pool has the same number of blocks."""

    def __init__(self, config: SchedulerConfig, make_blocks: Callable[[], BlockManager],
                 dp: int):
        self.schedulers = [Scheduler(config, make_blocks()) for _ in range(dp)]
        self.block_manager = PooledBlocks([s.block_manager for s in self.schedulers])
        self.owner: dict[str, Scheduler] = {}  # request id -> the rank's scheduler

    def validate(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        return self.schedulers[0].validate(num_prompt_tokens, params)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> Sequence:
        least_busy = min(self.schedulers, key=lambda s: len(s.sequences()))
        self.owner[request_id] = least_busy
        return least_busy.add_request(request_id, prompt_token_ids, params)

    def _merged(self, name: str) -> list[Sequence]:
        return [seq for scheduler in self.schedulers for seq in getattr(scheduler, name)]

    @property
    def waiting(self) -> list[Sequence]:
        return self._merged("waiting")

    @property
    def running(self) -> list[Sequence]:
        return self._merged("running")

    @property
    def swapped(self) -> list[Sequence]:
        return self._merged("swapped")

    @property
    def num_preemptions(self) -> int:
        return sum(scheduler.num_preemptions for scheduler in self.schedulers)

    def has_unfinished(self) -> bool:
        return any(scheduler.has_unfinished() for scheduler in self.schedulers)

    def sequences(self) -> list[Sequence]:
        return [seq for scheduler in self.schedulers for seq in scheduler.sequences()]

    def prepare_admission(self) -> None:
        for scheduler in self.schedulers:
            scheduler.prepare_admission()

    def schedule(self) -> DataParallelBatch:
        return DataParallelBatch([scheduler.schedule() for scheduler in self.schedulers])

    def advance(self, batch: DataParallelBatch) -> list[tuple[Sequence, int]]:
        """Each rank's (sequence, logits row), the rows offset by the earlier ranks' rows."""
        to_sample, offset = [], 0
        for scheduler, part in zip(self.schedulers, batch.parts):
            to_sample += [(seq, offset + row) for seq, row in scheduler.advance(part)]
            offset += sum(part.samples)
        return to_sample

    def append_tokens(self, sampled: list[tuple[Sequence, int]],
                      eos_token_ids: tuple[int, ...] = ()) -> list[Sequence]:
        finished = []
        for seq, token in sampled:
            scheduler = self.owner[seq.request_id]
            finished += scheduler.append_tokens([(seq, token)], eos_token_ids)
            self._forget_if_done(seq.request_id, scheduler)
        return finished

    def finish(self, seq: Sequence, reason: str) -> None:
        scheduler = self.owner[seq.request_id]
        scheduler.finish(seq, reason)
        self._forget_if_done(seq.request_id, scheduler)

    def _forget_if_done(self, request_id: str, scheduler: Scheduler) -> None:
        if all(seq.request_id != request_id for seq in scheduler.sequences()):
            del self.owner[request_id]

    def abort(self, request_id: str) -> list[Sequence]:
        scheduler = self.owner.pop(request_id, None)  # None: it finished already
        return [] if scheduler is None else scheduler.abort(request_id)


class DataParallelStep:
    """One dp rank's share of a step: its own plan through its model, or, with nothing
    scheduled, only the MoE layers' exchanges."""

    def __init__(self, runner: ModelRunner, dp_index: int):
        self.runner, self.dp_index = runner, dp_index

    def __call__(self, plans: list[StepPlan]) -> torch.Tensor:
        plan = plans[self.dp_index]
        if plan.starts:
            return self.runner.execute(plan)
        cache = self.runner.kv_cache  # a rank whose sequences were all preempted still swaps
        cache.swap_out(plan.swap_out)
        cache.swap_in(plan.swap_in)
        return idle_step(self.runner.model)


def idle_step(model: nn.Module) -> torch.Tensor:
    """Every expert-parallel MoE layer in order on no tokens (this rank then only serves the
    others' tokens to its experts); empty logits [0, vocab]."""
    weight = model.embed.weight
    nothing = weight.new_empty((1, 0, weight.shape[1]))
    for block in model.layers:
        if isinstance(block.mlp, ExpertParallelMoE):
            block.mlp(nothing)
    return weight.new_empty((0, model.config.vocab_size))
