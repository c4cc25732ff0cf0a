"""The KV cache as fixed-size blocks in one pool, and who owns which. Plain Python: no torch.

A block holds the K/V of `block_size` consecutive tokens of one sequence; a sequence's block table
maps its logical blocks to physical ones, so only the last block's free slots are wasted.

Prefix caching: a full block is registered under the hash chain of its token ids
(hash(parent hash, tokens)), so a request whose prompt starts with the same full blocks reuses them
(ref counts). A freed block that carries a hash stays in the cache, free but findable, until an
allocation evicts it, least recently freed first. Only full blocks are shared this way, and a
sequence only ever writes at positions >= its num_computed_tokens, so a cached block is never
written. Parallel samples (n > 1) also share their partial last block; the first sample to write
it copies it (copy-on-write) and the runner performs the copies the scheduler hands it.

Swap: with --preemption swap a sequence's blocks are copied to a CPU pool and back.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from tetrad.inference.core.sequence import Sequence

ROOT_HASH = 0


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    # Python's hash of a tuple of ints is the same in every process (no hash randomization).
    return hash((parent, tokens))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "tokens")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set while the block is in the prefix cache
        self.tokens: tuple[int, ...] = ()  # its token ids, checked on a hit (hash collisions)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Admission leaves this many blocks free so running sequences can keep decoding for a
        # while before anyone is preempted.
        self.watermark_blocks = int(watermark * num_blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_plain: deque[int] = deque(range(num_blocks))  # free, holding nothing reusable
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # free, cached; LRU first
        self.cached: dict[int, int] = {}  # hash -> block id
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks))
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # tokens found there

    # ---- accounting -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ---------------------------------------------------------------------------

    def _allocate(self) -> int:
        if self.free_plain:
            block_id = self.free_plain.popleft()
        else:
            block_id, _ = self.free_cached.popitem(last=False)  # evict the least recently freed
            block = self.blocks[block_id]
            del self.cached[block.hash]
            block.hash, block.tokens = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id

    def _share(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_cached[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.free_cached[block_id] = None
            else:
                self.free_plain.append(block_id)

    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """The first num_full_blocks entries of the sequence's hash chain (extended lazily)."""
        self._extend_hashes(seq, num_full_blocks)
        return seq.block_hashes[:num_full_blocks]

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        size = self.block_size
        while len(seq.block_hashes) < num_full_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else ROOT_HASH
            tokens = tuple(seq.token_ids[i * size:(i + 1) * size])
            seq.block_hashes.append(block_hash(parent, tokens))

    def _register(self, seq: Sequence, first: int, end: int) -> None:
        """Put the sequence's full blocks first..end-1 in the prefix cache (if no twin is there)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes(seq, end)
        for i in range(first, end):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.cached:
                block.hash = hashes[i]
                block.tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                self.cached[block.hash] = block.block_id

    def hash_prompt(self, seq: Sequence) -> None:
        """Compute the hash chain prefix_hits will look up (kept on the sequence): work that no
        step's outcome changes, which the engine does while a step computes."""
        if self.enable_prefix_caching:
            self._extend_hashes(seq, (len(seq) - 1) // self.block_size)

    def prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold the start of a sequence with no blocks yet. The block holding the
        last token is never matched: that token must be computed to give logits, and a cached
        block must not be written."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        size = self.block_size
        for i, h in enumerate(self._hashes(seq, (len(seq) - 1) // size)):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != tuple(
                    seq.token_ids[i * size:(i + 1) * size]):
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence, hits: list[int], num_new_tokens: int,
                     use_watermark: bool) -> bool:
        """Room for a waiting sequence: its prefix hits plus num_new_tokens computed tokens."""
        num_new_blocks = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        # A hit on a free cached block takes it off the free list too.
        num_revived = sum(1 for block_id in hits if self.blocks[block_id].ref_count == 0)
        reserve = self.watermark_blocks if use_watermark else 0
        return self.num_free_blocks - num_new_blocks - num_revived >= reserve

    def allocate(self, seq: Sequence, hits: list[int]) -> None:
        """Give a waiting sequence its prefix hits; append_slots then adds fresh blocks."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block_id in hits:
            self._share(block_id)
        seq.block_table = list(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self.num_prefix_queries += len(seq)
        self.num_prefix_hits += seq.num_cached_tokens

    def num_blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        computed = seq.num_computed_tokens
        count = self.blocks_for(computed + num_new_tokens) - len(seq.block_table)
        if computed % self.block_size and self.blocks[
                seq.block_table[computed // self.block_size]].ref_count > 1:
            count += 1  # copy-on-write of the shared partial block
        return max(count, 0)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_to_append(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make the slots of the next num_new_tokens tokens writable; returns the block copies
        (source, destination) that must happen before the write."""
        copies = []
        computed, table = seq.num_computed_tokens, seq.block_table
        if computed % self.block_size:
            index = computed // self.block_size
            if self.blocks[table[index]].ref_count > 1:
                source = table[index]
                table[index] = self._allocate()
                self._release(source)
                copies.append((source, table[index]))
        while len(table) * self.block_size < computed + num_new_tokens:
            table.append(self._allocate())
        return copies

    def mark_computed(self, seq: Sequence, num_new_tokens: int) -> None:
        """The runner wrote num_new_tokens more tokens: blocks that became full join the cache."""
        size = self.block_size
        before = seq.num_computed_tokens // size
        seq.num_computed_tokens += num_new_tokens
        self._register(seq, before, seq.num_computed_tokens // size)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for block_id in parent.block_table:
            self._share(block_id)
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        # Last blocks first: they are then evicted before the prefix blocks other requests share.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    # ---- swap ---------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.cpu_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Device -> CPU copies; the sequence's table then names CPU blocks."""
        mapping = [(block_id, self.cpu_free.pop()) for block_id in seq.block_table]
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = [cpu for _, cpu in mapping]
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return self.num_free_blocks - needed >= self.watermark_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """CPU -> device copies; full blocks rejoin the prefix cache."""
        mapping = [(cpu, self._allocate()) for cpu in seq.block_table]
        self.cpu_free.extend(cpu for cpu, _ in mapping)
        seq.block_table = [block_id for _, block_id in mapping]
        self._register(seq, 0, seq.num_computed_tokens // self.block_size)
        return mapping

    def free_swapped(self, seq: Sequence) -> None:
        self.cpu_free.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    # ---- checks -------------------------------------------------------------------------------

    def check_invariants(self, device_seqs: list[Sequence], swapped_seqs: list[Sequence]) -> None:
        """Every block is either free or owned, with a ref count equal to the number of tables
        that name it; the cache index points at blocks that carry that hash. For tests."""
        owners = [0] * self.num_blocks
        for seq in device_seqs:
            for block_id in seq.block_table:
                owners[block_id] += 1
        free = list(self.free_plain) + list(self.free_cached)
        free_set = set(free)
        assert len(free) == len(free_set), "a block is on the free lists twice"
        for block in self.blocks:
            assert block.ref_count == owners[block.block_id], (
                f"block {block.block_id}: ref count {block.ref_count}, "
                f"named by {owners[block.block_id]} tables")
            assert (block.ref_count == 0) == (block.block_id in free_set), (
                f"block {block.block_id} with ref count {block.ref_count} free-listed wrongly")
        assert all(self.blocks[b].hash is not None for b in self.free_cached)
        assert all(self.blocks[b].hash is None for b in self.free_plain)
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h
        assert sum(block.hash is not None for block in self.blocks) == len(self.cached)
        cpu_owned = [cpu for seq in swapped_seqs for cpu in seq.block_table]
        assert len(cpu_owned) == len(set(cpu_owned)), "a CPU block is owned twice"
        assert not set(cpu_owned) & set(self.cpu_free), "a CPU block is both free and owned"
        assert len(cpu_owned) + len(self.cpu_free) == self.num_cpu_blocks, "a CPU block leaked"
