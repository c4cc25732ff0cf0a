"""Scheduler: continuous batching, chunked prefill, preemption, rejection, forks; and random
workloads run against a fake model that reads its context through the block tables."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetrad.errors import ConfigError
from tetrad.inference.core.block_manager import BlockManager
from tetrad.inference.core.params import RequestRejected, SamplingParams
from tetrad.inference.core.scheduler import Scheduler, SchedulerConfig
from tetrad.inference.core.sequence import SequenceStatus

EOS = 0


def make_scheduler(num_blocks=32, block_size=4, num_cpu_blocks=0, prefix=True, **config):
    manager = BlockManager(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching=prefix,
                           watermark=config.pop("watermark", 0.0))
    return Scheduler(SchedulerConfig(**{"max_model_len": 64, **config}), manager)


class FakeRunner:
    """Stands in for the model: keeps "K/V" (each token with its whole prefix) in a paged store,
    performs the block copies, and checks the context it reads back through the block table. A
    scheduler or block manager that loses, shares or overwrites the wrong block fails here."""

    def __init__(self, scheduler, vocab=7):
        manager = scheduler.block_manager
        self.manager, self.vocab = manager, vocab
        self.store = [[None] * manager.block_size for _ in range(manager.num_blocks)]
        self.cpu_store = [[None] * manager.block_size for _ in range(manager.num_cpu_blocks)]

    def run(self, batch):
        size = self.manager.block_size
        for device, cpu in batch.swap_out:
            self.cpu_store[cpu] = list(self.store[device])
        for source, dest in batch.copies:
            self.store[dest] = list(self.store[source])
        for cpu, device in batch.swap_in:
            self.store[device] = list(self.cpu_store[cpu])
        logits = []
        for seq, num_new, samples in zip(batch.seqs, batch.num_tokens, batch.samples):
            start = seq.num_computed_tokens
            for position in range(start, start + num_new):
                block = self.manager.blocks[seq.block_table[position // size]]
                assert block.ref_count == 1 and block.hash is None, "wrote a shared block"
                # Real K/V depend on every earlier token (attention, positions): so does this.
                self.store[block.block_id][position % size] = tuple(seq.token_ids[:position + 1])
            context = [self.store[seq.block_table[p // size]][p % size]
                       for p in range(start + num_new)]
            assert context == [tuple(seq.token_ids[:p + 1]) for p in range(start + num_new)]
            if samples:
                logits.append(context[-1])
        return logits

    def next_token(self, context, index):
        return hash((context, index)) % self.vocab


def reference_outputs(prompt, params, vocab=7):
    """What the fake model generates with no paging at all, per sample index."""
    outputs = []
    for index in range(params.n):
        tokens = list(prompt)
        for _ in range(params.max_tokens):
            tokens.append(hash((tuple(tokens), index)) % vocab)
            if tokens[-1] == EOS and not params.ignore_eos:
                break
        outputs.append(tokens[len(prompt):])
    return outputs


def run_to_completion(scheduler, arrivals, max_steps=2000, check=True):
    """arrivals: list of (step, request_id, prompt, params). Returns ({request: [outputs]},
    rejected request ids, steps)."""
    runner = FakeRunner(scheduler)
    pending = sorted(arrivals, key=lambda a: a[0])
    seqs, rejected, step = {}, set(), 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params = pending.pop(0)
            try:
                scheduler.add_request(request_id, prompt, params)
            except RequestRejected:
                rejected.add(request_id)
        batch = scheduler.schedule()
        # The engine runs the model (and with it the block copies) only for a batch with
        # sequences: a swap with nothing to compute would never copy its blocks.
        assert batch.seqs or not (batch.swap_out or batch.swap_in or batch.copies)
        assert batch.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        contexts = runner.run(batch)
        sampled = [(seq, runner.next_token(contexts[row], seq.index))
                   for seq, row in scheduler.advance(batch)]
        for seq, _ in sampled:
            seqs.setdefault(seq.request_id, []).append(seq)
        scheduler.append_tokens(sampled, eos_token_ids=(EOS,))
        if check:
            scheduler.block_manager.check_invariants(scheduler.running, scheduler.swapped)
        step += 1
        assert step < max_steps, "the workload did not finish: a request is stuck"
    outputs = {rid: [s.output_token_ids for s in sorted(set(group), key=lambda s: s.index)]
               for rid, group in seqs.items()}
    return outputs, rejected, step


def test_decodes_and_a_chunked_prefill_share_each_step():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    short = scheduler.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    batch = scheduler.schedule()
    assert batch.seqs == [short] and batch.num_tokens == [3] and batch.samples == [True]
    scheduler.advance(batch)
    scheduler.append_tokens([(short, 4)])
    long = scheduler.add_request("b", list(range(1, 21)), SamplingParams(max_tokens=2))
    # Step: the decode goes first (1 token), the 20-token prompt gets the other 7 of the budget.
    batch = scheduler.schedule()
    assert batch.seqs == [short, long] and batch.num_tokens == [1, 7]
    assert batch.samples == [True, False]
    scheduler.advance(batch)
    scheduler.append_tokens([(short, 4)])
    batch = scheduler.schedule()
    assert batch.num_tokens == [1, 7] and long.num_computed_tokens == 7
    scheduler.advance(batch)
    scheduler.append_tokens([(short, 4)])
    batch = scheduler.schedule()
    assert batch.num_tokens == [1, 6] and batch.samples == [True, True]


def test_newest_running_sequence_is_preempted_by_recompute_and_requeued_first():
    # 4 blocks of 2 tokens; two 3-token prompts take 2 blocks each; the first decode that needs a
    # third block for the older sequence evicts the newer one.
    scheduler = make_scheduler(num_blocks=4, block_size=2, prefix=False)
    old = scheduler.add_request("old", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    new = scheduler.add_request("new", [4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    waiting = scheduler.add_request("late", [7], SamplingParams(max_tokens=1))
    batch = scheduler.schedule()
    assert batch.seqs == [old, new]  # "late" has no block left
    scheduler.advance(batch)
    scheduler.append_tokens([(old, 1), (new, 1)])
    batch = scheduler.schedule()  # 4 tokens each: both fit in their 2 blocks
    scheduler.advance(batch)
    scheduler.append_tokens([(old, 1), (new, 1)])
    batch = scheduler.schedule()  # old needs a third block: new is preempted
    assert batch.preempted == [new] and batch.seqs == [old]
    assert new.status is SequenceStatus.WAITING and new.block_table == []
    assert list(scheduler.waiting) == [new, waiting] and scheduler.num_preemptions == 1
    assert new.num_computed_tokens == 0 and new.output_token_ids == [1, 1]  # kept, recomputed


def test_swap_preemption_copies_blocks_out_and_back():
    scheduler = make_scheduler(num_blocks=4, block_size=2, num_cpu_blocks=4, prefix=False,
                               preemption="swap")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outputs, rejected, _ = run_to_completion(
        scheduler, [(0, "a", [1, 2, 3], params), (0, "b", [4, 5, 6], params)])
    assert not rejected and scheduler.num_preemptions > 0
    assert outputs["a"] == reference_outputs([1, 2, 3], params)
    assert outputs["b"] == reference_outputs([4, 5, 6], params)


def test_requests_that_can_never_fit_are_rejected_with_the_fix_in_the_message():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(RequestRejected, match="whole pool has 4: lower max_tokens"):
        scheduler.add_request("a", [1] * 10, SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="lower max_tokens to at most 22"):
        scheduler.add_request("b", [1] * 10, SamplingParams(max_tokens=23))
    with pytest.raises(RequestRejected, match="shorten the prompt"):
        scheduler.add_request("c", [1] * 32, SamplingParams())
    with pytest.raises(RequestRejected, match="empty"):
        scheduler.add_request("d", [], SamplingParams())
    assert not scheduler.has_unfinished()
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=32)
    seq = scheduler.add_request("e", [1] * 10, SamplingParams())
    assert seq.params.max_tokens == 22  # None means "up to the context length"


def test_sampling_params_reject_bad_values():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(n=0),
                dict(max_tokens=0), dict(temperature="hot"), dict(stop=[""]), dict(seed=1.5)):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    assert SamplingParams(stop="x").stop == ("x",)


def test_watermark_keeps_blocks_free_when_admitting_next_to_running_sequences():
    scheduler = make_scheduler(num_blocks=10, block_size=2, prefix=False, watermark=0.3)
    first = scheduler.add_request("a", [1] * 12, SamplingParams(max_tokens=2))  # 6 blocks
    second = scheduler.add_request("b", [2] * 4, SamplingParams(max_tokens=2))  # 2 blocks
    batch = scheduler.schedule()
    # The first request is alone, so the watermark does not apply; the second would leave
    # 10 - 6 - 2 = 2 < 3 blocks free.
    assert batch.seqs == [first] and list(scheduler.waiting) == [second]


def test_forked_samples_share_the_prompt_and_diverge():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    params = SamplingParams(n=3, max_tokens=6, ignore_eos=True)
    outputs, _, _ = run_to_completion(scheduler, [(0, "a", [1, 2, 3, 4, 5, 6], params)])
    assert outputs["a"] == reference_outputs([1, 2, 3, 4, 5, 6], params)
    assert len({tuple(o) for o in outputs["a"]}) > 1  # the samples really differ


def test_abort_frees_the_blocks():
    scheduler = make_scheduler(num_blocks=8, block_size=2)
    seq = scheduler.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    scheduler.advance(scheduler.schedule())
    assert scheduler.block_manager.num_used_blocks == 3
    assert scheduler.abort("a") == [seq] and seq.finish_reason == "abort"
    assert scheduler.block_manager.num_used_blocks == 0 and not scheduler.has_unfinished()


def test_prefix_cache_hits_skip_computing_the_shared_prompt():
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    system = list(range(1, 13))
    run_to_completion(scheduler, [(0, "a", system + [5], params)])
    second = scheduler.add_request("b", system + [6, 6], params)
    batch = scheduler.schedule()
    assert second.num_cached_tokens == 12 and batch.num_tokens == [2]


workload = st.lists(
    st.tuples(st.integers(0, 12),  # arrival step
              st.integers(0, 2),  # which shared prefix
              st.lists(st.integers(0, 6), max_size=10),  # suffix
              st.integers(1, 12),  # max_tokens
              st.integers(1, 3),  # n
              st.booleans()),  # ignore_eos
    min_size=1, max_size=10)


@settings(max_examples=120, deadline=None)
@given(requests=workload, num_blocks=st.integers(3, 40), block_size=st.integers(1, 6),
       budget=st.integers(1, 24), max_num_seqs=st.integers(3, 8), prefix=st.booleans(),
       swap=st.booleans(), watermark=st.sampled_from([0.0, 0.1]))
def test_random_workloads_finish_with_the_unpaged_outputs(
        requests, num_blocks, block_size, budget, max_num_seqs, prefix, swap, watermark):
    """Every admitted request finishes, with exactly the tokens the fake model gives without
    paging; rejected ones are exactly those that could never fit; nothing leaks."""
    scheduler = make_scheduler(num_blocks, block_size, num_cpu_blocks=num_blocks if swap else 0,
                               prefix=prefix, max_num_batched_tokens=budget,
                               max_num_seqs=max_num_seqs, watermark=watermark,
                               preemption="swap" if swap else "recompute", max_model_len=40)
    prefixes = [[1, 2, 3, 4, 5, 6, 1, 2], [1, 2, 3, 4, 6, 6], [3]]
    arrivals = []
    for i, (step, which, suffix, max_tokens, n, ignore_eos) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=ignore_eos)
        arrivals.append((step, f"r{i}", prefixes[which] + suffix, params))
    outputs, rejected, _ = run_to_completion(scheduler, arrivals)
    for step, request_id, prompt, params in arrivals:
        fits = -(-(len(prompt) + params.max_tokens) // block_size) <= num_blocks
        assert (request_id in rejected) == (not fits or params.n > max_num_seqs)
        if request_id not in rejected:
            assert outputs[request_id] == reference_outputs(prompt, params)
    manager = scheduler.block_manager
    manager.check_invariants([], [])
    assert manager.num_free_blocks == num_blocks and len(manager.cpu_free) == manager.num_cpu_blocks


def test_requests_exactly_at_each_limit_are_accepted():
    """The context, the pool and max_num_seqs are limits a request may reach, not exceed."""
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=3)
    at_context = scheduler.add_request("a", [1] * 10, SamplingParams(max_tokens=22))
    assert at_context.params.max_tokens == 22  # 10 + 22 = 32 tokens
    assert scheduler.add_request("b", [1] * 31, SamplingParams()).params.max_tokens == 1
    whole_pool = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    assert whole_pool.add_request("c", [1] * 6, SamplingParams(max_tokens=10))  # 16 = 4 blocks
    with pytest.raises(RequestRejected, match="needs 5 KV blocks"):
        whole_pool.add_request("d", [1] * 6, SamplingParams(max_tokens=11))
    assert scheduler.add_request("e", [1], SamplingParams(n=3, max_tokens=1)).params.n == 3
    with pytest.raises(RequestRejected, match="n = 4"):
        scheduler.add_request("f", [1], SamplingParams(n=4, max_tokens=1))



def test_the_watermark_does_not_hold_back_a_request_when_nothing_runs():
    # Alone, a prompt may take all but fewer blocks than the watermark keeps (else it would
    # wait for ever: nothing running will free any).
    scheduler = make_scheduler(num_blocks=10, block_size=2, prefix=False, watermark=0.3)
    alone = scheduler.add_request("a", [1] * 18, SamplingParams(max_tokens=2))  # 9 blocks
    assert scheduler.schedule().seqs == [alone]
