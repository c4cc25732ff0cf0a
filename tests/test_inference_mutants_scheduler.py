"""The scheduler's limits (tetrad.inference.core.scheduler) hit exactly: the token budget filled to the
last token and split into chunks, max_num_seqs counting the samples a prompt will fork into,
logits rows shared by forked samples, prompt log-probabilities computing every prompt position,
and requests finished while waiting or swapped returning every block. Counts are by hand."""

import pytest
from test_scheduler import make_scheduler

from tetrad.errors import ConfigError
from tetrad.inference.core.params import SamplingParams
from tetrad.inference.core.scheduler import SchedulerConfig
from tetrad.inference.core.sequence import SequenceStatus

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def test_the_token_budget_is_filled_exactly_and_a_long_prompt_is_chunked():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    first = scheduler.add_request("a", [1] * 4, PARAMS)
    second = scheduler.add_request("b", [2] * 6, PARAMS)
    third = scheduler.add_request("c", [3] * 15, PARAMS)
    batch = scheduler.schedule()
    assert batch.seqs == [first, second] and batch.num_tokens == [4, 6]
    assert batch.samples == [True, True] and batch.num_batched_tokens == 10
    assert list(scheduler.waiting) == [third]  # no budget left, though blocks are
    rows = scheduler.advance(batch)
    assert rows == [(first, 0), (second, 1)]
    scheduler.append_tokens([(first, 5), (second, 5)])
    batch = scheduler.schedule()  # two decodes, then 8 of the long prompt's 15
    assert batch.seqs == [first, second, third] and batch.num_tokens == [1, 1, 8]
    assert batch.samples == [True, True, False]
    assert [row for _, row in scheduler.advance(batch)] == [0, 1]  # the chunk gives no row
    assert third.num_computed_tokens == 8
    scheduler.append_tokens([(first, 5), (second, 5)])
    batch = scheduler.schedule()
    assert batch.num_tokens == [1, 1, 7] and batch.samples == [True, True, True]


def test_max_num_seqs_counts_the_samples_a_prompt_forks_into():
    scheduler = make_scheduler(max_num_seqs=3)
    pair = scheduler.add_request("pair", [1, 2, 3], PARAMS.replace(n=2))
    single = scheduler.add_request("single", [4, 5], PARAMS)
    late = scheduler.add_request("late", [6], PARAMS)
    batch = scheduler.schedule()
    assert batch.seqs == [pair, single] and list(scheduler.waiting) == [late]  # 2 + 1 = 3
    rows = scheduler.advance(batch)
    # Both samples of the pair read the pair's logits row; the single reads the next.
    assert [(seq.request_id, seq.index, row) for seq, row in rows] == [
        ("pair", 0, 0), ("pair", 1, 0), ("single", 0, 1)]
    child = rows[1][0]
    assert child.block_table == pair.block_table and child.seq_id not in (pair.seq_id,
                                                                          single.seq_id)
    scheduler.append_tokens([(seq, 9) for seq, _ in rows])
    assert late not in scheduler.schedule().seqs  # still 3 running
    scheduler.finish(single, "stop")
    assert late in scheduler.schedule().seqs


def test_prompt_logprobs_compute_every_prompt_position_despite_cached_blocks():
    scheduler = make_scheduler()
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks could come from the cache
    cached = scheduler.add_request("first", prompt, PARAMS)
    scheduler.advance(scheduler.schedule())
    scheduler.finish(cached, "stop")
    again = scheduler.add_request("again", prompt, PARAMS)
    scored = scheduler.add_request("scored", prompt, PARAMS.replace(prompt_logprobs=0))
    batch = scheduler.schedule()
    assert batch.num_tokens == [10 - 8, 10]
    assert again.num_cached_tokens == 8 and scored.num_cached_tokens == 0


def test_requests_finished_while_waiting_or_swapped_return_every_block():
    scheduler = make_scheduler(num_blocks=6, num_cpu_blocks=6, preemption="swap")
    manager = scheduler.block_manager
    old = scheduler.add_request("old", [1] * 9, SamplingParams(max_tokens=12, ignore_eos=True))
    new = scheduler.add_request("new", [2] * 9, SamplingParams(max_tokens=12, ignore_eos=True))
    queued = scheduler.add_request("queued", [3] * 4, PARAMS)
    batch = scheduler.schedule()
    assert batch.seqs == [old, new]  # all 6 blocks; the third prompt waits for room
    while new.status is not SequenceStatus.SWAPPED:
        scheduler.append_tokens([(seq, 4) for seq, _ in scheduler.advance(batch)])
        batch = scheduler.schedule()
    assert manager.num_free_blocks + len(old.block_table) == 6
    assert len(manager.cpu_free) == 6 - len(new.block_table)
    assert scheduler.abort("new") == [new]
    assert len(manager.cpu_free) == 6 and new.status is SequenceStatus.FINISHED
    assert new not in scheduler.swapped and new.finish_reason == "abort"
    scheduler.finish(queued, "abort")
    assert queued not in scheduler.waiting and not queued.block_table
    scheduler.finish(old, "stop")
    assert manager.num_free_blocks == 6 and not scheduler.has_unfinished()


def test_each_limit_must_be_positive_and_preemption_a_known_kind():
    assert SchedulerConfig(1, 1, 1, "swap").max_num_seqs == 1
    for bad in (dict(max_num_seqs=0), dict(max_num_batched_tokens=0), dict(max_model_len=0),
                dict(preemption="evict")):
        with pytest.raises(ConfigError):
            SchedulerConfig(**bad)
