"""BlockManager: allocation, prefix caching, LRU eviction, copy-on-write, swap, and the ownership
invariants under random operation sequences (hypothesis)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tetrad.inference.core.block_manager import BlockManager
from tetrad.inference.core.params import SamplingParams
from tetrad.inference.core.sequence import Sequence


def make_seq(seq_id, tokens, n=1):
    return Sequence(seq_id, f"r{seq_id}", list(tokens), SamplingParams(n=n), arrival=seq_id)


def admit(manager, seq, num_tokens=None):
    """Allocate a waiting sequence and pretend the runner computed its tokens."""
    hits = manager.prefix_hits(seq)
    manager.allocate(seq, hits)
    num_new = (num_tokens or len(seq)) - seq.num_computed_tokens
    copies = manager.append_slots(seq, num_new)
    manager.mark_computed(seq, num_new)
    return hits, copies


def test_only_the_last_block_has_free_slots():
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    seq = make_seq(0, range(10))
    admit(manager, seq)
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 7  # 10 tokens: 4 + 4 + 2
    seq.append_token(99)
    seq.append_token(98)
    assert manager.num_blocks_to_append(seq, 2) == 0  # fills the last block exactly
    manager.append_slots(seq, 2)
    manager.mark_computed(seq, 2)
    seq.append_token(97)
    assert manager.num_blocks_to_append(seq, 1) == 1
    manager.free(seq)
    assert manager.num_free_blocks == 10 and seq.block_table == []


def test_prefix_hits_share_full_blocks_but_not_the_block_of_the_last_token():
    manager = BlockManager(num_blocks=10, block_size=4)
    first = make_seq(0, range(12))
    admit(manager, first)
    # Same 12 tokens: blocks 0 and 1 hit; block 2 holds the last token and is recomputed.
    second = make_seq(1, range(12))
    hits, _ = admit(manager, second)
    assert hits == first.block_table[:2]
    assert second.num_cached_tokens == 8 and second.block_table[2] != first.block_table[2]
    assert manager.blocks[hits[0]].ref_count == 2
    # A different second block: only the first block hits (the hash chain includes the parent).
    third = make_seq(2, [0, 1, 2, 3, 9, 9, 9, 9, 8, 8])
    hits, _ = admit(manager, third)
    assert hits == first.block_table[:1]
    manager.check_invariants([first, second, third], [])


def test_freed_cached_blocks_are_reused_then_evicted_least_recent_first():
    manager = BlockManager(num_blocks=4, block_size=2)
    a = make_seq(0, [1, 2, 3, 4, 5])  # blocks [1 2] [3 4] [5]
    admit(manager, a)
    full_a = a.block_table[:2]
    manager.free(a)
    assert manager.num_free_blocks == 4 and len(manager.cached) == 2
    again = make_seq(1, [1, 2, 3, 4, 7])
    hits, _ = admit(manager, again)
    assert hits == full_a and manager.num_prefix_hits == 4
    manager.free(again)
    # Freed last block first: [3 4] is older in the LRU than [1 2], so it is evicted first, and
    # plain free blocks go before any cached one.
    other = make_seq(2, [8] * 8)
    admit(manager, other, num_tokens=7)
    assert other.block_table[2:] == [full_a[1], full_a[0]]
    assert manager.prefix_hits(make_seq(3, [1, 2, 3, 4, 7])) == []
    manager.check_invariants([other], [])


def test_copy_on_write_when_forked_samples_diverge():
    manager = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(0, range(6), n=2)  # a full block and a half-full one
    admit(manager, parent)
    child = parent.fork(1, index=1)
    manager.fork(parent, child)
    shared_last = parent.block_table[1]
    assert manager.blocks[shared_last].ref_count == 2
    parent.append_token(50)
    child.append_token(60)
    copies = manager.append_slots(parent, 1)
    assert copies == [(shared_last, parent.block_table[1])] and parent.block_table[1] != shared_last
    # The child is now the only owner: it writes in place, no copy.
    assert manager.append_slots(child, 1) == [] and child.block_table[1] == shared_last
    assert parent.block_table[0] == child.block_table[0]  # the full block stays shared
    manager.check_invariants([parent, child], [])


def test_swap_out_and_in_moves_blocks_to_the_cpu_pool_and_back():
    manager = BlockManager(num_blocks=6, block_size=4, num_cpu_blocks=3)
    seq = make_seq(0, range(9))
    admit(manager, seq)
    device_blocks = list(seq.block_table)
    assert manager.can_swap_out(seq)
    out = manager.swap_out(seq)
    assert [d for d, _ in out] == device_blocks and manager.num_free_blocks == 6
    assert seq.block_table == [c for _, c in out] and manager.cpu_free == []
    manager.check_invariants([], [seq])
    back = manager.swap_in(seq)
    assert [c for c, _ in back] == [c for _, c in out] and len(manager.cpu_free) == 3
    assert seq.block_table == [d for _, d in back]
    manager.check_invariants([seq], [])


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(2, 24), block_size=st.integers(1, 5), prefix=st.booleans(),
       ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10**6)), max_size=60))
def test_random_operations_keep_ownership_and_never_write_shared_blocks(
        num_blocks, block_size, prefix, ops):
    """Random admit / grow / fork / swap / free; a simulated KV store checks that every sequence
    reads back its own tokens through its block table and that no shared or cached block is
    written."""
    manager = BlockManager(num_blocks, block_size, num_cpu_blocks=num_blocks,
                           enable_prefix_caching=prefix)
    store = [[None] * block_size for _ in range(num_blocks)]
    cpu_store = [[None] * block_size for _ in range(num_blocks)]
    live, swapped, next_id = [], [], 0

    def write(seq, num_new):
        for copy_from, copy_to in manager.append_slots(seq, num_new):
            store[copy_to] = list(store[copy_from])
        for position in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            block = manager.blocks[seq.block_table[position // block_size]]
            assert block.ref_count == 1 and block.hash is None, "wrote a shared or cached block"
            # Like real K/V, a slot's content depends on the whole prefix.
            store[block.block_id][position % block_size] = tuple(seq.token_ids[:position + 1])
        manager.mark_computed(seq, num_new)
        assert [store[seq.block_table[p // block_size]][p % block_size]
                for p in range(seq.num_computed_tokens)] == [
                    tuple(seq.token_ids[:p + 1]) for p in range(seq.num_computed_tokens)]

    for op, value in ops:
        if op == 0:  # admit a new sequence over a small alphabet (so prefixes repeat)
            seq = make_seq(next_id, [value % 3 + (i * value) % 2 for i in range(1 + value % 9)])
            next_id += 1
            hits = manager.prefix_hits(seq)
            if manager.can_allocate(seq, hits, len(seq) - len(hits) * block_size, False):
                manager.allocate(seq, hits)
                write(seq, len(seq) - seq.num_computed_tokens)
                live.append(seq)
        elif op == 1 and live:  # decode one token
            seq = live[value % len(live)]
            seq.append_token(value % 3)
            if manager.can_append(seq, 1):
                write(seq, 1)
            else:
                seq.token_ids.pop()
        elif op == 2 and live:  # fork
            parent = live[value % len(live)]
            child = parent.fork(next_id, 1)
            next_id += 1
            manager.fork(parent, child)
            live.append(child)
        elif op == 3 and live:  # free
            manager.free(live.pop(value % len(live)))
        elif op == 4 and live:  # swap out
            seq = live[value % len(live)]
            if manager.can_swap_out(seq):
                for device, cpu in manager.swap_out(seq):
                    cpu_store[cpu] = list(store[device])
                live.remove(seq)
                swapped.append(seq)
        elif op == 5 and swapped:  # swap in
            seq = swapped[value % len(swapped)]
            if manager.blocks_for(seq.num_computed_tokens) <= manager.num_free_blocks:
                for cpu, device in manager.swap_in(seq):
                    store[device] = list(cpu_store[cpu])
                swapped.remove(seq)
                live.append(seq)
        manager.check_invariants(live, swapped)
        for block in manager.blocks:
            if block.hash is not None:
                assert tuple(slot[-1] for slot in store[block.block_id]) == block.tokens, (
                    "cached block overwritten")
    for seq in live:
        manager.free(seq)
    for seq in swapped:
        manager.free_swapped(seq)
    manager.check_invariants([], [])
    assert manager.num_free_blocks == num_blocks and len(manager.cpu_free) == num_blocks


def test_prompts_differing_only_in_a_blocks_last_token_each_get_their_own_hits():
    """The hash covers every token of a block: two prompts that differ only in the last token of
    their second block each cache that block, and a repeat of either hits both of its blocks."""
    manager = BlockManager(num_blocks=12, block_size=4)
    shared = [5, 6, 7, 8, 1, 2, 3]
    first, second = make_seq(0, shared + [4, 0]), make_seq(1, shared + [9, 0])
    admit(manager, first)
    hits, _ = admit(manager, second)
    assert hits == first.block_table[:1]  # the first block is the same, the second is not
    repeats = []
    for seq_id, original in ((2, first), (3, second)):
        repeats.append(make_seq(seq_id, original.token_ids))
        hits, _ = admit(manager, repeats[-1])
        assert hits == original.block_table[:2], seq_id
        assert repeats[-1].num_cached_tokens == 8
    assert manager.num_prefix_hits == 4 + 8 + 8
    manager.check_invariants([first, second, *repeats], [])


def test_a_prompt_that_fits_the_free_blocks_exactly_is_admitted():
    manager = BlockManager(num_blocks=3, block_size=4, watermark=0.0)
    waiting = make_seq(0, range(12))
    assert manager.can_allocate(waiting, [], 12, use_watermark=True)
    assert not manager.can_allocate(waiting, [], 13, use_watermark=True)
    # A hit on a freed, cached block revives it: that block is no longer free to allocate.
    admit(manager, waiting)
    manager.free(waiting)
    again = make_seq(1, list(range(8)) + [50, 51, 52, 53, 54])  # 2 hits + 5 new tokens
    hits = manager.prefix_hits(again)
    assert len(hits) == 2 and manager.num_free_blocks == 3
    assert not manager.can_allocate(again, hits, 5, use_watermark=False)
    assert manager.can_allocate(again, hits, 4, use_watermark=False)


def test_blocks_swapped_back_in_rejoin_the_prefix_cache():
    # A pool the sequence fills: swapping in evicts the cached copies it left behind, so its
    # prefix stays findable only if the blocks it comes back to are registered again.
    manager = BlockManager(num_blocks=3, block_size=4, num_cpu_blocks=3)
    seq = make_seq(0, range(9))
    admit(manager, seq)
    manager.swap_out(seq)
    manager.swap_in(seq)
    assert manager.prefix_hits(make_seq(1, range(9))) == seq.block_table[:2]
    manager.check_invariants([seq], [])
