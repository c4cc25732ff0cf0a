"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022) for a tetrad Transformer. docs/tensor_parallel.md has the tables and the numbers.

Every rank builds the full model with the same seed; `apply_tensor_parallel` then swaps, inside
that Transformer, each matmul for this rank's slice of it (sliced from the full weights, so the
start equals the single-process model). Transformer.forward runs unchanged and parameter names
stay the full model's. Over the tp ranks of a group:

  attention  split by heads: qkv column-parallel, each of q, k, v sliced on its own; out
             row-parallel. With fewer kv heads than ranks, each kv head is replicated on the
             tp / num_kv_heads ranks whose q heads read it; their gradients are summed over those
             ranks, so the copies stay equal.
  MLP        up column-parallel (gate and up sliced on their own), down row-parallel.
  vocabulary the embedding and an untied head split by vocabulary rows; a tied head multiplies by
             the embedding's own shard. The loss is vocab-parallel (tetrad.parallel.vocab_parallel):
             full logits never exist on one rank.
  MLA        split by heads too: q_up (or q) and kv_up column-parallel, out row-parallel; the
             low-rank down-projections, their norms and the shared rope key whole on every rank,
             computing for the rank's heads after the block's input entered once (their
             gradients are partial, summed over tp like SP's).
  MoE        routed experts stay whole and every tp rank computes them for every token (the same
             numbers on each): experts are spread by expert parallelism, not cut by tp, and
             sharding them would need the router's gradient summed across ranks too. Shared
             experts are split like the MLP, entering by f and leaving by g inside the layer.
  replicated norms, row-parallel biases, learned positions.

The operators between them are tetrad.parallel.tp_operators': f (identity forward, all-reduce
backward) into a column-parallel layer, g (all-reduce forward, identity backward) out of a
row-parallel one. With --sequence-parallel the stretch between the layers (norms, residual adds)
holds a sequence shard [b, s/tp, h] and the pair becomes all-gather / reduce-scatter along the
sequence: the same bytes (an all-reduce is a reduce-scatter plus an all-gather), and the
activations the norms keep are 1/tp each. With `overlap` the parallel layers run those
collectives chunk by chunk behind their own matmuls instead (tetrad.parallel.tp_overlap).

Traffic per microbatch, each of one [b, s, h] activation: per dense layer 2 all-reduces forward
(g after attention and after the MLP) and 2 backward (f before each), one forward after the
embedding and one backward at the head's input; per MoE layer only attention's. The loss adds two
forward all-reduces over the tokens (the max logit; the sum of exponentials with the target
logit). Under SP each all-reduce is a reduce-scatter/all-gather pair, and an MoE layer gathers its
input forward and its output gradient backward. Once per step `sum_partial_gradients` (called by
the data-parallel engine just before it reduces a bucket) all-reduces the gradients each rank
holds only part of: replicated kv rows, and under SP the replicated parameters applied to a
sequence shard.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.spec.model import ModelConfig
from tetrad.errors import ConfigError
from tetrad.models.fp8_layers import FP8Linear
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm
from tetrad.parallel.mesh import Group, Mesh
from tetrad.parallel.tp_operators import TensorParallel, keep_moe_whole
from tetrad.parallel.tp_overlap import OverlappedColumnLinear, OverlappedRowLinear
from tetrad.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
from tetrad.planner.rules import check_tensor_parallel


def matmul_of(full: nn.Linear) -> Callable[..., torch.Tensor]:
    """The shard runs its matmul as the layer it was cut from did: FP8 in its recipe (each rank
    scales its own shard's blocks or tensor, so FP8 tensor parallelism is close to, not equal to,
    one process). FP8 shards run their collectives unchunked: the overlapped path's chunks are
    bf16 matmuls."""
    return full.matmul if isinstance(full, FP8Linear) else F.linear


# The layers. Each remembers which rows (or columns) of the full weight every rank holds:
# `indices[r]` for rank r, along `dim`, which is what gathering a whole checkpoint needs.

class ColumnParallelLinear(nn.Module):
    """A linear layer whose output features are split: this rank keeps rows `indices[index]` of
    the full nn.Linear's weight and bias. Its input enters through f (or g_seq); its output
    [..., rows] stays split, for a row-parallel layer or the vocab-parallel loss to consume."""

    dim = 0

    def __init__(self, full: nn.Linear, indices: list[torch.Tensor], tp: TensorParallel,
                 enters: bool = True):
        super().__init__()
        self.tp, self.indices, self.enters = tp, indices, enters  # enters: through f / g_seq
        rows = indices[tp.index]
        self.matmul = matmul_of(full)
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enters:  # the caller entered already (MLA's heads)
            return self.matmul(x, self.weight, self.bias)
        if self.tp.overlap and self.matmul is F.linear:
            return OverlappedColumnLinear.apply(x, self.weight, self.bias, self.tp)
        return self.matmul(self.tp.enter(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split: this rank keeps columns `indices[index]` of
    the full weight, reads a column-parallel layer's split output, and its partial products are
    summed by g (or g_bar_seq). The bias is whole on every rank and added once, after the sum."""

    dim = 1

    def __init__(self, full: nn.Linear, indices: list[torch.Tensor], tp: TensorParallel):
        super().__init__()
        self.tp, self.indices = tp, indices
        self.matmul = matmul_of(full)
        self.weight = nn.Parameter(full.weight.detach()[:, indices[tp.index]].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (OverlappedRowLinear.apply(x, self.weight, self.tp)
               if self.tp.overlap and self.matmul is F.linear
               else self.tp.leave(self.matmul(x, self.weight)))
        return out if self.bias is None else out + self.bias


def _sections(*ranges: tuple[int, int]) -> torch.Tensor:
    return torch.cat([torch.arange(start, stop) for start, stop in ranges])


def kv_heads_of(config: ModelConfig, tp: int, index: int) -> range:
    """The kv heads rank `index` needs: its own share, or (kv heads < tp) the one head its q heads
    read, held by tp / num_kv_heads neighbouring ranks."""
    if config.num_kv_heads >= tp:
        per_rank = config.num_kv_heads // tp
        return range(index * per_rank, (index + 1) * per_rank)
    head = index // (tp // config.num_kv_heads)
    return range(head, head + 1)


def qkv_rows(config: ModelConfig, tp: int, index: int) -> torch.Tensor:
    """Rows of the fused [q; k; v] weight for rank `index`: its q heads, then its kv heads' k and
    v rows, so the local weight is again [q; k; v] and Attention.forward splits it as before."""
    d, q_heads = config.head_dim, config.num_heads // tp
    kv = kv_heads_of(config, tp, index)
    k_start, v_start = config.q_size, config.q_size + config.kv_size
    return _sections((index * q_heads * d, (index + 1) * q_heads * d),
                     (k_start + kv.start * d, k_start + kv.stop * d),
                     (v_start + kv.start * d, v_start + kv.stop * d))


def up_rows(ffn: int, gated: bool, tp: int, index: int) -> torch.Tensor:
    """Rows of the MLP's up weight: [gate; up] sliced section by section, so the local weight is
    again [gate; up] and MLP.forward's chunk(2) pairs each gate with its own up."""
    per_rank = ffn // tp
    own = (index * per_rank, (index + 1) * per_rank)
    return _sections(own, (ffn + own[0], ffn + own[1])) if gated else _sections(own)


def even_split(size: int, tp: int) -> list[torch.Tensor]:
    per_rank = size // tp
    return [torch.arange(r * per_rank, (r + 1) * per_rank) for r in range(tp)]


def apply_tensor_parallel(model: Transformer, mesh_or_group: Mesh | Group, comm: Comm,
                          sequence_parallel: bool = False, seq_len: int | None = None,
                          overlap: bool = False) -> "TensorParallelSplit":
    """Split `model` (built with the same seed on every rank) over the tp group: its modules are
    swapped in place for their parallel versions, and `model` then computes this rank's
    vocabulary slice of the logits. `seq_len`, when given, is checked against SP up front.
    `overlap`: the parallel layers hide their collectives behind their matmuls
    (tetrad.parallel.tp_overlap)."""
    group = mesh_or_group["tp"] if isinstance(mesh_or_group, Mesh) else mesh_or_group
    check_tensor_parallel(model.config, group.size, sequence_parallel, seq_len)
    return TensorParallelSplit(model, TensorParallel(group, comm, sequence_parallel, overlap))


class SequenceShardedPositions(nn.Module):
    """Learned positions under SP: this rank's sequence shard of them, as the hidden states
    between the layers are. The parameter is the model's own (`pos_embed.weight`)."""

    def __init__(self, full: nn.Embedding, tp: TensorParallel):
        super().__init__()
        self.tp, self.weight = tp, full.weight

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.tp.sequence_shard(positions, 0), self.weight)


def _shard_block(block: nn.Module, config: ModelConfig, tp: TensorParallel) -> None:
    if config.attention == "mla":
        _shard_latent_attention(block.attn, config, tp)
    else:
        _shard_attention(block.attn, config, tp)
    if block.is_moe:
        if block.mlp.shared is not None:
            # Inside an MoE layer kept whole the input is the whole sequence on every rank
            # already (gathered under SP), so the shared expert enters by f and leaves by g,
            # never chunked (overlap hides expert parallelism's dispatch behind it instead).
            _shard_mlp(block.mlp.shared,
                       dataclasses.replace(tp, sequence_parallel=False, overlap=False))
        if tp.sequence_parallel:
            keep_moe_whole(block.mlp, tp)
        return
    _shard_mlp(block.mlp, tp)


def _shard_attention(attn: nn.Module, config: ModelConfig, tp: TensorParallel) -> None:
    size, d = tp.size, config.head_dim
    attn.qkv = ColumnParallelLinear(attn.qkv, [qkv_rows(config, size, r) for r in range(size)], tp)
    attn.out = RowParallelLinear(attn.out, even_split(config.q_size, size), tp)
    attn.num_heads = config.num_heads // size
    attn.num_kv_heads = len(kv_heads_of(config, size, tp.index))
    attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d


def _shard_latent_attention(attn: nn.Module, config: ModelConfig, tp: TensorParallel) -> None:
    """MLA split by heads: q_up (or q) and kv_up column-parallel, out row-parallel; the low-rank
    down-projections, their norms and the rope key all heads share stay whole on every rank. The
    block's input enters once, before them (f, or g_seq under SP), so everything inside computes
    this rank's heads only: the replicated weights' gradients are then partial (this rank's
    heads' share) and `sum_partial_gradients` sums them over tp."""
    size, heads = tp.size, config.num_heads

    def by_heads(width: int) -> list[torch.Tensor]:  # each head's rows are contiguous
        return even_split(heads * width, size)

    if attn.low_rank_q:
        attn.q_up = ColumnParallelLinear(attn.q_up, by_heads(attn.qk_dim), tp, enters=False)
    else:
        attn.q = ColumnParallelLinear(attn.q, by_heads(attn.qk_dim), tp, enters=False)
    attn.kv_up = ColumnParallelLinear(attn.kv_up, by_heads(attn.nope_dim + attn.v_dim), tp,
                                      enters=False)
    attn.out = RowParallelLinear(attn.out, by_heads(attn.v_dim), tp)
    attn.num_heads = heads // size
    attn.register_forward_pre_hook(lambda module, args: (tp.enter(args[0]), *args[1:]))


def _shard_mlp(mlp: nn.Module, tp: TensorParallel) -> None:
    size, ffn = tp.size, mlp.ffn_hidden_size
    mlp.up = ColumnParallelLinear(mlp.up, [up_rows(ffn, mlp.gated, size, r) for r in range(size)],
                                  tp)
    mlp.down = RowParallelLinear(mlp.down, even_split(ffn, size), tp)
    mlp.ffn_hidden_size = ffn // size


class TensorParallelSplit:
    """What tensor parallelism did to a Transformer, and what the layout needs of it: the
    vocab-parallel loss, the sum of the gradients ranks hold only in part, what each rank counts
    in a sum over the whole model, and how each split parameter is laid out over the ranks."""

    def __init__(self, model: Transformer, tp: TensorParallel):
        config = model.config
        self.config, self.tp = config, tp
        for block in model.layers:
            _shard_block(block, config, tp)
        vocab = even_split(config.vocab_size, tp.size)
        model.embed = VocabParallelEmbedding(model.embed, vocab, tp)  # a tied head with it
        if model.lm_head is not None:
            model.lm_head = ColumnParallelLinear(model.lm_head, vocab, tp)
        if tp.sequence_parallel:
            if model.pos_embed is not None:
                model.pos_embed = SequenceShardedPositions(model.pos_embed, tp)
            model.register_forward_pre_hook(self._check_sequence, with_kwargs=True)

        # Gradient bookkeeping, by the full model's parameter names: how each split parameter is
        # laid out over the ranks (dim, rows of the full tensor per rank).
        self.shards: dict[str, tuple[int, list[torch.Tensor]]] = {}
        for prefix, module in model.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear,
                                   VocabParallelEmbedding)):
                self.shards[f"{prefix}.weight"] = (module.dim, module.indices)
                if isinstance(module, ColumnParallelLinear) and module.bias is not None:
                    self.shards[f"{prefix}.bias"] = (0, module.indices)
        # Under SP every replicated parameter outside an MoE layer sees only a sequence shard
        # (whichever module holds the layer: expert parallelism swaps in its own).
        # MLA's replicated weights compute for this rank's heads only, SP or not.
        whole_moe = {id(p) for block in model.layers if block.is_moe
                     for p in block.mlp.parameters()}
        latent = {id(p) for block in model.layers if config.attention == "mla"
                  for p in block.attn.parameters()}
        self.partial_params = [p for name, p in model.named_parameters()
                               if (tp.sequence_parallel or id(p) in latent)
                               and name not in self.shards and id(p) not in whole_moe]
        # Rows several ranks hold (replicated kv heads): (param, local rows, their slots in the
        # union of shared rows, the union's size). And what this rank counts in the gradient
        # norm, where a row held by several ranks counts on the first: name -> positions along
        # the split dim, None for all.
        self.shared_rows = []
        self.owned: dict[str, torch.Tensor | None] = {}
        for name, param in model.named_parameters():
            if name in self.shards:
                dim, indices = self.shards[name]
                owned, shared = _overlaps(indices, tp.index, param.device)
                self.owned[name] = owned
                if shared is not None:
                    assert dim == 0, name  # only column-parallel rows are ever replicated
                    self.shared_rows.append((param, *shared))

    def _check_sequence(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before Transformer.forward under SP: a sequence the tp ranks can split, no serving."""
        input_ids = args[0] if args else kwargs["input_ids"]
        if (args[2] if len(args) > 2 else kwargs.get("cache")) is not None:
            raise ConfigError("sequence parallelism is for training: serve a model parallelized "
                              "with sequence_parallel=False")
        if input_ids.shape[-1] % self.tp.size:
            raise ConfigError(f"--sequence-parallel needs the sequence length "
                              f"({input_ids.shape[-1]}) to be a multiple of tp ({self.tp.size})")

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every token: F.cross_entropy(full logits, targets) without
        gathering the logits. logits: [batch, seq, vocab / tp]; targets: [batch, seq]."""
        return vocab_parallel_cross_entropy(logits, targets, self.tp)

    def sum_partial_gradients(self, grads: dict[int, torch.Tensor]) -> None:
        """Sum over the tp group the gradients each rank holds only part of (replicated kv rows;
        under SP the replicated parameters, which saw only this rank's tokens), among `grads`:
        id(parameter) -> its gradient, e.g. the views into one data-parallel bucket, summed here
        just before the bucket is reduced (the two sums commute). One all-reduce, tag "grads";
        none when nothing is partial. Every tp rank passes the same parameters."""
        replicated = [grads[id(p)] for p in self.partial_params if id(p) in grads]
        shared = [(grads[id(p)], *rest) for p, *rest in self.shared_rows if id(p) in grads]
        if not (replicated or shared):
            return
        pieces = list(replicated)
        for grad, local, slots, num_shared in shared:
            union = grad.new_zeros((num_shared, *grad.shape[1:]))
            pieces.append(union.index_copy_(0, slots, grad[local]))
        flat = torch.cat([piece.reshape(-1) for piece in pieces])
        self.tp.comm.all_reduce(flat, self.tp.group, "grads")
        sums = iter(flat.split([piece.numel() for piece in pieces]))
        for grad in replicated:
            grad.copy_(next(sums).view_as(grad))
        for grad, local, slots, num_shared in shared:
            grad[local] = next(sums).view(num_shared, *grad.shape[1:])[slots]

    def counted_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """What this rank counts of `tensor` (shaped like parameter `name`) when summing over the
        whole model across the tp group: a split parameter's rows that no lower rank holds too,
        a replicated one on the first rank only (None: nothing)."""
        if name not in self.shards:
            return tensor if self.tp.index == 0 else None
        owned = self.owned[name]
        return tensor if owned is None else tensor.index_select(self.shards[name][0], owned)

    def whole_shape(self, name: str, local_shape) -> tuple[int, ...]:
        """The single-process shape of split parameter `name`, from this rank's shape of it."""
        dim, indices = self.shards[name]
        shape = list(local_shape)
        shape[dim] = int(torch.cat(indices).max()) + 1
        return tuple(shape)

    def local_part(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a tensor shaped like the single-process parameter `name` (no
        communication)."""
        if name not in self.shards:
            return whole
        dim, indices = self.shards[name]
        return whole.index_select(dim, indices[self.tp.index].to(whole.device))


def _overlaps(indices: list[torch.Tensor], index: int, device: torch.device):
    """For rank `index` of a split parameter: the positions of its rows that no lower rank holds
    (None: all of them), and (positions of its rows another rank also holds, their slots in the
    sorted union of such rows, the union's size), or None when it shares no row."""
    mine = indices[index]
    earlier = torch.cat(indices[:index]) if index else mine[:0]
    owned = (~torch.isin(mine, earlier)).nonzero().flatten()
    rows, counts = torch.cat(indices).unique(return_counts=True)
    union = rows[counts > 1]
    local = torch.isin(mine, union).nonzero().flatten()
    shared = (None if not local.numel() else
              (local.to(device), torch.searchsorted(union, mine[local]).to(device), union.numel()))
    return None if len(owned) == len(mine) else owned.to(device), shared
