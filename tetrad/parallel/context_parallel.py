"""Context parallelism: ring attention (Liu et al. 2023) over the cp ranks of a sequence.

Layout. A sequence of S tokens is cut into 2*cp chunks of c = S / (2*cp) tokens, and cp rank i
holds chunks i and 2*cp-1-i, concatenated ([2c] tokens). Under a causal mask a rank holding only
early chunks would have little to attend to and one holding late chunks a lot; pairing an early
chunk with its mirror gives every rank the same work (the "zigzag" layout of Megatron-CP and
ring-flash-attn). Positions (RoPE or learned) are the chunks' global positions.

Forward. Queries stay put; K/V blocks travel right around the cp ring, one hop per step, and
each rank folds each block into its running output with the online-softmax rule: it keeps
(out, lse), lse being the log-sum-exp of its scores so far (the running max and the sum of
exponentials in one number), and merges a block's (out_b, lse_b) as

    lse' = logaddexp(lse, lse_b),  out' = out * exp(lse - lse') + out_b * exp(lse_b - lse').

At step s rank r holds the K/V of rank src = r - s (mod cp). With the zigzag layout every step
costs the same half block: src == r is plain causal attention over the local [2c] tokens (its two
chunks are in increasing order); src < r: both local query chunks see src's front chunk entirely
and its back chunk not at all; src > r: only the local back chunk sees anything, src's whole
[2c]. The next block's send/receive is posted before this block's compute, so they overlap.

Backward (flash-attention style): probabilities are recomputed per block from the saved lse, so
nothing of size S^2 is ever kept. dQ stays on its rank; the dK/dV of a block must reach its owner
with every rank's share added. The block of rank b travels as in the forward (b -> b+1 -> ...),
its dK/dV accumulator riding along from b+1 and the last hop bringing it home to b, which adds its
own share last; so each rank sends (cp-1) K/V blocks and (cp-1) dK/dV blocks per backward.

Bytes sent per rank per layer, with KV = the bytes of this rank's k and v:
    forward (cp-1) * KV,   backward (cp-1) * KV + (cp-1) * KV_fp32 (dK/dV are fp32 accumulators).
Full recomputation runs the forward (and its ring) once more during backward.

The trainer's side (docs/context_expert_parallel.md): call `apply_context_parallel` on the full
model, then per microbatch `inputs, targets, positions = context.shard(window)`, run
`model(inputs, positions=positions)`, take the mean loss over the local tokens, and average
gradients (and the reported loss) over the dp*cp ranks: every rank holds the same number of
tokens, so the mean of the ranks' means is the full-sequence loss.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from tetrad.models.layers import causal_attention
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm, Handle
from tetrad.parallel.mesh import Group
from tetrad.planner.rules import check_context_parallel

TAG = "ring_attention"  # the K/V and dK/dV blocks on the ring
ROUTING_TAG = "routing"  # MoE routed fractions averaged over the cp ranks


def chunk_positions(seq_len: int, cp: int, index: int) -> torch.Tensor:
    """Global positions of the tokens cp rank `index` holds: chunks index and 2*cp-1-index."""
    chunk = seq_len // (2 * cp)
    back = 2 * cp - 1 - index
    return torch.cat([torch.arange(index * chunk, (index + 1) * chunk),
                      torch.arange(back * chunk, (back + 1) * chunk)])


# The block math, in fp32 whatever the input dtype. Queries are grouped by the K/V head they
# share (GQA: query head j reads K/V head j // group, as SDPA's enable_gqa), so K/V are never
# repeated: q [b, kv_heads, group, sq, d], k and v [b, kv_heads, sk, d].

def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    scores = q @ k.unsqueeze(2).transpose(-1, -2) * scale  # [b, kv_heads, group, sq, sk]
    if causal:
        sq, sk = scores.shape[-2:]
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _attend_block(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> out [b, kv_heads, group, sq, d], lse [b, kv_heads, group, sq]."""
    scores = _scores(q, k, causal, scale)
    lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp() @ v.unsqueeze(2), lse


def _block_grads(q, k, v, dout, lse, delta, causal: bool, scale: float):
    """Gradients of one block given the final lse and delta = rowsum(dout * out)."""
    probs = (_scores(q, k, causal, scale) - lse.unsqueeze(-1)).exp()
    dv = (probs.transpose(-1, -2) @ dout).sum(2)  # summed over the query heads of a group
    dscores = probs * (dout @ v.unsqueeze(2).transpose(-1, -2) - delta.unsqueeze(-1)) * scale
    return dscores @ k.unsqueeze(2), (dscores.transpose(-1, -2) @ q).sum(2), dv


class RingAttention:
    """The attention core of a context-parallel model: `ring(q, k, v)` with q [b, heads, 2c, d]
    and k, v [b, kv_heads, 2c, d] holding this rank's two chunks (RoPE already applied at their
    global positions); returns [b, heads, 2c, d], equal to those rows of full causal attention."""

    def __init__(self, group: Group, comm: Comm):
        self.group, self.comm = group, comm

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _RingAttentionFunction.apply(q, k, v, self)

    def _block(self, src: int, chunk: int) -> tuple[slice, slice, bool]:
        """(query rows, key columns, causal) that this rank's queries see of src's K/V."""
        if src == self.group.index:
            return slice(None), slice(None), True
        if src < self.group.index:
            return slice(None), slice(0, chunk), False
        return slice(chunk, None), slice(None), False

    def _exchange(self, outgoing: torch.Tensor) -> tuple[torch.Tensor, list[Handle]]:
        """Post a send to the right neighbour and a receive from the left one."""
        size, index = self.group.size, self.group.index
        incoming = torch.empty_like(outgoing)
        return incoming, [self.comm.exchange(outgoing, (index + 1) % size, incoming,
                                             (index - 1) % size, self.group, TAG)]

    def forward(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """-> out [b, heads, 2c, d] (q's dtype), lse [b, kv_heads, group, 2c] (fp32)."""
        batch, heads, seq, dim = q.shape
        kv_heads = k.shape[1]
        q5 = q.float().reshape(batch, kv_heads, heads // kv_heads, seq, dim)
        scale, chunk = dim ** -0.5, seq // 2
        kv = torch.stack([k, v])  # [2, b, kv_heads, 2c, d]: one message per hop
        out = lse = None
        for step in range(self.group.size):
            last = step == self.group.size - 1
            if not last:
                incoming, handles = self._exchange(kv)
            rows, cols, causal = self._block((self.group.index - step) % self.group.size, chunk)
            block_out, block_lse = _attend_block(q5[..., rows, :], kv[0, ..., cols, :].float(),
                                                 kv[1, ..., cols, :].float(), causal, scale)
            if out is None:  # step 0 is the local block, which covers every query row
                out, lse = block_out, block_lse
            else:
                merged = torch.logaddexp(lse[..., rows], block_lse)
                out[..., rows, :] = (out[..., rows, :] * (lse[..., rows] - merged).exp()[..., None]
                                     + block_out * (block_lse - merged).exp()[..., None])
                lse[..., rows] = merged
            if not last:
                for handle in handles:
                    handle.wait()
                kv = incoming
        return out.reshape(batch, heads, seq, dim).to(q.dtype), lse

    def backward(self, q, k, v, out, lse, dout) -> tuple[torch.Tensor, ...]:
        batch, heads, seq, dim = q.shape
        kv_heads = k.shape[1]
        grouped = (batch, kv_heads, heads // kv_heads, seq, dim)
        q5, out5, dout5 = (t.float().reshape(grouped) for t in (q, out, dout))
        delta = (dout5 * out5).sum(-1)  # [b, kv_heads, group, 2c]
        dq = torch.zeros_like(q5)
        scale, chunk = dim ** -0.5, seq // 2
        size, index = self.group.size, self.group.index

        def add_block(kv: torch.Tensor, src: int, dkv: torch.Tensor) -> None:
            rows, cols, causal = self._block(src, chunk)
            dq_b, dk_b, dv_b = _block_grads(q5[..., rows, :], kv[0, ..., cols, :].float(),
                                            kv[1, ..., cols, :].float(), dout5[..., rows, :],
                                            lse[..., rows], delta[..., rows], causal, scale)
            dq[..., rows, :] += dq_b
            dkv[0, ..., cols, :] += dk_b
            dkv[1, ..., cols, :] += dv_b

        own_kv = torch.stack([k, v])
        own_dkv = torch.zeros(own_kv.shape, dtype=torch.float32, device=q.device)
        if size > 1:
            # Visit the other ranks' blocks first (src = index-1, index-2, ...), each arriving
            # with the dK/dV its earlier visitors added; then the own block, whose dK/dV comes
            # back around the ring from the left neighbour.
            incoming_kv, handles = self._exchange(own_kv)
            incoming_dkv = None
            for step in range(1, size):
                for handle in handles:
                    handle.wait()
                kv = incoming_kv
                dkv = incoming_dkv if incoming_dkv is not None else torch.zeros_like(own_dkv)
                handles = []
                if step < size - 1:
                    incoming_kv, handles = self._exchange(kv)
                add_block(kv, (index - step) % size, dkv)
                incoming_dkv, dkv_handles = self._exchange(dkv)
                handles += dkv_handles
            for handle in handles:
                handle.wait()
            own_dkv = incoming_dkv
        add_block(own_kv, index, own_dkv)
        return (dq.reshape(q.shape).to(q.dtype), own_dkv[0].to(k.dtype),
                own_dkv[1].to(v.dtype))


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: RingAttention):
        # The block math is fp32 by construction; autocast would round its matmuls down.
        with torch.autocast(q.device.type, enabled=False):
            out, lse = ring.forward(q, k, v)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)  # O(seq): the S^2 part is recomputed
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            return (*ctx.ring.backward(q, k, v, out, lse, dout.contiguous()), None)


class ContextParallel:
    """Ring attention installed on every block of `model` (and, for MoE, routed fractions
    averaged over the cp group), plus the sequence slicing the trainer does."""

    def __init__(self, model: Transformer, group: Group, comm: Comm):
        self.model, self.group, self.comm = model, group, comm
        self.ring = RingAttention(group, comm)
        self._attach()

    def shard(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A microbatch window [batch, seq + 1] (inputs and next-token targets) -> this rank's
        inputs [batch, seq / cp], targets [batch, seq / cp] and their global positions
        [seq / cp], for model(inputs, positions=positions)."""
        seq_len = window.shape[1] - 1
        check_context_parallel(self.model.config, self.group.size, seq_len)
        positions = chunk_positions(seq_len, self.group.size, self.group.index).to(window.device)
        return window[:, :-1][:, positions], window[:, 1:][:, positions], positions

    @contextlib.contextmanager
    def whole_sequences(self) -> Iterator[None]:
        """Plain attention on whole sequences for a while: evaluation, or sampling on one rank."""
        self._detach()
        try:
            yield
        finally:
            self._attach()

    def _attach(self) -> None:
        for block in self.model.layers:
            block.attn.core = self.ring
            if block.is_moe:
                block.mlp.router.reduce_fraction = self._mean_over_ranks

    def _detach(self) -> None:
        for block in self.model.layers:
            block.attn.core = causal_attention
            if block.is_moe:
                block.mlp.router.reduce_fraction = None

    def _mean_over_ranks(self, fraction: torch.Tensor) -> torch.Tensor:
        """Every cp rank holds the same number of tokens, so the mean of the ranks' fractions is
        the fraction over the whole sequences (no gradient flows through it: it counts)."""
        total = fraction.detach().clone()
        self.comm.all_reduce(total, self.group, ROUTING_TAG)
        return total / self.group.size


def apply_context_parallel(model: Transformer, group: Group, comm: Comm) -> ContextParallel:
    """Make `model` (the full model, built with the same seed on every rank) attend across the
    cp `group` (mesh["cp"]). Apply before recompute and expert parallelism."""
    return ContextParallel(model, group, comm)
