"""Tensor parallelism's operators and vocabulary split on N ranks simulated by N threads of one
process (no spawn, so cheap enough to try several group sizes and awkward targets), against the
same computation done whole: the loss and every gradient, not only the loss."""

import threading

import pytest
import torch
import torch.nn.functional as F

from tetrad.parallel.comm import Comm
from tetrad.parallel.mesh import Group
from tetrad.parallel.tp_operators import (GatherFromSequence, ScatterToSequence, TensorParallel,
                                          f, g, g_bar_seq, g_seq)
from tetrad.parallel.tp_overlap import row_chunks
from tetrad.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
from tetrad.planner.eager_overlap import TP_OVERLAP_CHUNKS


class ThreadComm(Comm):
    """The collectives the tp operators use, between threads: every member posts its tensor, and
    after a barrier each reads what the collective defines from all of them."""

    def __init__(self, size: int):
        super().__init__()
        self.barrier = threading.Barrier(size)
        self.posted: list = [None] * size

    def _everyone(self, group: Group, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.posted[group.index] = tensor.clone()
        self.barrier.wait()
        everyone = list(self.posted)
        self.barrier.wait()  # nobody posts the next collective before all have read this one
        return everyone

    def all_reduce(self, tensor, group, tag, op="sum", async_op=False):
        everyone = torch.stack(self._everyone(group, tensor))
        tensor.copy_(everyone.sum(0) if op == "sum" else everyone.max(0).values)

    def all_gather(self, output, input, group, tag, async_op=False):
        output.copy_(torch.cat([t.reshape(-1) for t in self._everyone(group, input)]))

    def reduce_scatter(self, output, input, group, tag, async_op=False):
        total = torch.stack(self._everyone(group, input)).sum(0)
        output.copy_(total.chunk(group.size)[group.index].view_as(output))


def on_threads(size: int, fn) -> list:
    """fn(tp) on `size` simulated tp ranks -> every rank's result, in rank order."""
    comm, results, errors = ThreadComm(size), [None] * size, []

    def rank(index):
        try:
            results[index] = fn(TensorParallel(Group("tp", tuple(range(size)), index), comm))
        except BaseException as error:  # noqa: BLE001 -- re-raised in the test's thread
            errors.append(error)
            comm.barrier.abort()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("tp", [2, 3])
def test_vocab_parallel_cross_entropy_is_cross_entropy_with_its_gradient(tp):
    generator = torch.Generator().manual_seed(tp)
    vocab = 4 * tp
    logits = torch.randn(7, 2, vocab, generator=generator) * 3
    targets = torch.randint(0, vocab, (7, 2), generator=generator)
    targets[0, 0], targets[0, 1] = 0, vocab - 1  # the first and last row of the vocabulary
    targets[1] = vocab // tp  # the first row of the second rank's slice
    whole = logits.clone().requires_grad_()
    expected = F.cross_entropy(whole.flatten(0, 1), targets.flatten())
    expected.backward(torch.tensor(2.5))

    def rank(group):
        piece = logits.chunk(group.size, dim=-1)[group.index].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(piece, targets, group)
        loss.backward(torch.tensor(2.5))
        return loss.detach(), piece.grad

    results = on_threads(tp, rank)
    for loss, _ in results:
        torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(torch.cat([grad for _, grad in results], dim=-1), whole.grad)


@pytest.mark.parametrize("tp", [2, 3])
def test_vocab_parallel_embedding_is_the_embedding_with_its_gradient(tp):
    full = torch.nn.Embedding(5 * tp, 6)
    tokens = torch.tensor([[0, 5 * tp - 1, 5, 4, 5 * tp - 5, 3]])
    grad_out = torch.randn(1, 6, 6)
    full(tokens).backward(grad_out)
    indices = list(torch.arange(5 * tp).chunk(tp))

    def rank(group):
        layer = VocabParallelEmbedding(full, indices, group)
        out = layer(tokens)
        out.backward(grad_out)
        return out.detach(), layer.weight.grad

    results = on_threads(tp, rank)
    for out, _ in results:
        torch.testing.assert_close(out, full(tokens).detach())
    torch.testing.assert_close(torch.cat([grad for _, grad in results]), full.weight.grad)


@pytest.mark.parametrize("tp, sequence_parallel", [(2, False), (3, False), (2, True), (3, True)])
def test_column_then_row_parallel_matmuls_equal_the_whole_ones(tp, sequence_parallel):
    """Megatron's MLP: x -> enter -> x @ A_i -> relu -> @ B_i -> leave, A split by columns and B
    by rows, against x @ A -> relu -> @ B done whole; input and weight gradients too."""
    generator = torch.Generator().manual_seed(10 * tp + sequence_parallel)
    x = torch.randn(2, 3 * tp, 4, generator=generator, dtype=torch.float64)
    a = torch.randn(4, 5 * tp, generator=generator, dtype=torch.float64)
    b = torch.randn(5 * tp, 4, generator=generator, dtype=torch.float64)
    grad_out = torch.randn(2, 3 * tp, 4, generator=generator, dtype=torch.float64)
    whole = [t.clone().requires_grad_() for t in (x, a, b)]
    (torch.relu(whole[0] @ whole[1]) @ whole[2]).backward(grad_out)

    def rank(group):
        group = TensorParallel(group.group, group.comm, sequence_parallel)
        shard = group.sequence_shard(x) if sequence_parallel else x
        mine = [shard.clone().requires_grad_(), a.chunk(tp, 1)[group.index].clone()
                .requires_grad_(), b.chunk(tp, 0)[group.index].clone().requires_grad_()]
        out = group.leave(torch.relu(group.enter(mine[0]) @ mine[1]) @ mine[2])
        out.backward(group.sequence_shard(grad_out) if sequence_parallel else grad_out)
        return out.detach(), *(t.grad for t in mine)

    results = on_threads(tp, rank)
    outs, x_grads, a_grads, b_grads = zip(*results)
    expected = torch.relu(x @ a) @ b
    if sequence_parallel:
        torch.testing.assert_close(torch.cat(outs, dim=1), expected)
        torch.testing.assert_close(torch.cat(x_grads, dim=1), whole[0].grad)
    else:
        for out, x_grad in zip(outs, x_grads):
            torch.testing.assert_close(out, expected)
            torch.testing.assert_close(x_grad, whole[0].grad)
    torch.testing.assert_close(torch.cat(a_grads, dim=1), whole[1].grad)
    torch.testing.assert_close(torch.cat(b_grads, dim=0), whole[2].grad)


def test_the_operators_forward_and_backward_by_their_definitions():
    """f: identity, gradient summed; g: summed, gradient kept; g_seq: gathered, gradient summed
    then sharded; g_bar_seq: summed then sharded, gradient gathered; a whole MoE's pair: gathered
    with the shard of the gradient kept, and sharded with the gradient gathered."""
    tp = 3
    inputs = [torch.randn(2, 6, 4, dtype=torch.float64) for _ in range(tp)]
    grads = [torch.randn(2, 6, 4, dtype=torch.float64) for _ in range(tp)]
    shards = [x[:, 2 * i:2 * i + 2] for i, x in enumerate(inputs)]
    total, total_grad = sum(inputs), sum(grads)

    def rank(group):
        i = group.index
        out = {}
        for name, op, given, grad in (
                ("f", f, inputs[i], grads[i]), ("g", g, inputs[i], grads[i]),
                ("g_seq", g_seq, shards[i], grads[i]),
                ("g_bar_seq", g_bar_seq, inputs[i], grads[i][:, :2]),
                ("gather_keep", lambda t, tp_: GatherFromSequence.apply(t, tp_, False), shards[i],
                 grads[0]),
                ("scatter", ScatterToSequence.apply, inputs[0], grads[i][:, :2])):
            leaf = given.clone().requires_grad_()
            result = op(leaf, group)
            result.backward(grad)
            out[name] = (result.detach(), leaf.grad)
        return out

    results = on_threads(tp, rank)
    gathered = torch.cat(shards, dim=1)
    gathered_grads = torch.cat([grad[:, :2] for grad in grads], dim=1)
    for i, out in enumerate(results):
        own = slice(2 * i, 2 * i + 2)
        expected = {"f": (inputs[i], total_grad), "g": (total, grads[i]),
                    "g_seq": (gathered, total_grad[:, own]),
                    "g_bar_seq": (total[:, own], gathered_grads),
                    "gather_keep": (gathered, grads[0][:, own]),
                    "scatter": (inputs[0][:, own], gathered_grads)}
        for name, (value, grad) in expected.items():
            torch.testing.assert_close(out[name][0], value, msg=f"{name} forward, rank {i}")
            torch.testing.assert_close(out[name][1], grad, msg=f"{name} backward, rank {i}")


def test_overlap_row_chunks_cover_the_rows_evenly_and_none_is_empty():
    for rows in range(1, 3 * TP_OVERLAP_CHUNKS + 2):
        chunks = row_chunks(rows)
        assert len(chunks) == min(TP_OVERLAP_CHUNKS, rows), rows  # the planner prices as many
        assert chunks[0][0] == 0 and chunks[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        sizes = [stop - start for start, stop in chunks]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1, (rows, sizes)
