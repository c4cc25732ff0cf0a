"""The parameters one rank of tetrad's runtime holds, tensor by tensor, as its layout leaves them
(the `tetrad` runtime profile: tetrad.planner.eager).

A rank holds the blocks of its pipeline stages (stage s on pipeline rank s % pp), the embedding on
the first stage (and a copy of a tied one on the last), the final norm and head on the last.
Tensor parallelism keeps 1/tp of the vocabulary rows of the embedding and head, of the query heads
and the MLP units (kv heads split, or replicated on tp / num_kv_heads ranks when fewer than tp),
and leaves norms, row-parallel biases, learned positions and MoE layers whole: an MoE layer runs
whole on every tp rank, its routed experts divided over the ep ranks (E / ep each), its shared
experts split like a dense MLP. MLA is split by heads, its low-rank down-projections and their
norms whole. Tensors come in
registration order, which decides ZeRO's buckets.

ZeRO-3's units (tetrad.parallel.fsdp) are, without a pipeline, transformer_units': the embeddings,
each block, final norm and head, a tied embedding making one root unit of embedding, positions and
final norm. Under a pipeline they are each stage's (stage_units): its embeddings (a tied one and
the positions a unit each), its blocks, its final norm (and head); a tied embedding's copy on the
last stage is that stage's root unit. ZeRO-2 under a pipeline buckets each stage's tensors apart,
a tied embedding's copy alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from tetrad.spec.model import ModelConfig
from tetrad.planner.layout import TrainLayout, stage_layer_counts
from tetrad.planner.model_stats import norm_params
from tetrad.planner.precision import FP8_BLOCK
from tetrad.planner.rules import shared_expert_size
from tetrad.schedules.generate import V_SHAPED
from tetrad.spec import runtime_rules


@dataclass(frozen=True)
class Param:
    """One parameter tensor on one rank. `partial`: elements of its gradient summed over the tp
    group once backward is done (sequence-parallel replicas that saw a shard of the tokens, kv
    rows several ranks hold). `unit`: its ZeRO-3 unit within its stage, numbered in forward order
    (None for experts, which ZeRO leaves alone); `root`: that unit stays gathered around the
    stage's whole forward (FSDP's root, a tied embedding's). `tied`: a tied embedding's copy under
    a pipeline, whose gradient the first and last pipeline ranks sum."""

    elements: int
    expert: bool = False
    matmul: bool = False  # a matmul weight: autocast casts it in every forward that uses it
    fp8_blocks: int = 0  # 128x128 blocks of a weight --dtype fp8 quantizes (block linears only)
    partial: int = 0
    stage: int = 0
    unit: int | None = None
    root: bool = False
    tied: bool = False
    frozen: bool = False  # no gradient, no optimizer state: the routing bias of sigmoid routing


def stage_layers(config: ModelConfig, layout: TrainLayout) -> tuple[int, ...]:
    """Blocks per pipeline stage (pp * vpp stages): the layout's own cut (the runtime's balanced
    partition: the trainer passes it, and pipeline_ranks, eager_step_time and evaluate_training
    fill it in, layout.with_runtime_cut), else the even one that Megatron-style stacks run."""
    return layout.stage_layers or stage_layer_counts(config.num_layers, layout.pp * layout.vpp)


def rank_stages(layout: TrainLayout, pp_rank: int) -> tuple[int, ...]:
    """The stages pipeline rank `pp_rank` runs: pp_rank, pp_rank + pp, ..., or the V's two
    (the runtime's)."""
    return runtime_rules.rank_stages(pp_rank, layout.pp * layout.vpp, layout.pp,
                                     layout.schedule in V_SHAPED)


def stage_blocks(config: ModelConfig, layout: TrainLayout, stage: int) -> range:
    counts = stage_layers(config, layout)
    first = sum(counts[:stage])
    return range(first, first + counts[stage])


def kv_heads_per_rank(config: ModelConfig, tp: int) -> int:
    """Kv heads a tp rank holds: its share, or the one its query heads read (replicated)."""
    return max(config.num_kv_heads // tp, 1)


def _linear(rows: int, cols: int, bias: bool, partial_bias: bool = False,
            shared_rows: int = 0) -> list[Param]:
    """A linear layer's weight [rows, cols] and bias: `partial_bias` when the bias is whole on
    every rank and sequence parallelism hands it a shard of the tokens; `shared_rows` of the
    weight's (and bias's) rows other tp ranks hold too."""
    weight = Param(rows * cols, matmul=True, partial=shared_rows * cols,
                   fp8_blocks=-(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK))
    if not bias:
        return [weight]
    return [weight, Param(rows, partial=rows if partial_bias else shared_rows)]


def _norm(config: ModelConfig, partial: bool) -> list[Param]:
    h = config.hidden_size
    return [Param(h, partial=h if partial else 0)
            for _ in range(norm_params(config) // h)]  # weight (and bias)


def _mlp(config: ModelConfig, ffn: int, tp: int = 1, sequence_parallel: bool = False,
         expert: bool = False) -> list[Param]:
    """An MLP with `ffn` units, column- then row-parallel over `tp` (1: whole)."""
    h, bias = config.hidden_size, config.bias
    width = (2 if config.mlp == "swiglu" else 1) * ffn // tp
    params = _linear(width, h, bias) + _linear(h, ffn // tp, bias, sequence_parallel)
    return [replace(p, expert=expert) for p in params]


def _attention(config: ModelConfig, tp: int, sp: bool) -> list[Param]:
    """Attention's tensors split by heads (qkv column-, out row-parallel)."""
    d, kv_heads, h = config.head_dim, kv_heads_per_rank(config, tp), config.hidden_size
    q = config.num_heads // tp * d
    # With fewer kv heads than tp ranks, every k and v row lives on several ranks.
    shared = 2 * config.kv_size if config.num_kv_heads < tp else 0
    return (_linear(q + 2 * kv_heads * d, h, config.qkv_bias or config.bias, shared_rows=shared)
            + _linear(h, q, config.bias, sp))


def _latent_attention(config: ModelConfig, tp: int) -> list[Param]:
    """MLA's tensors (tetrad.models.mla, registration order) split by heads: q_up (or q), kv_up
    column-parallel, out row-parallel; the down-projections and their norms whole on every rank,
    where with tp > 1 they compute for the rank's heads only (gradients summed over tp)."""
    h, heads = config.hidden_size, config.num_heads // tp
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    latent, q_rank = config.kv_lora_rank, config.q_lora_rank

    def whole(elements: int, matmul: bool = True) -> Param:
        return Param(elements, matmul=matmul, partial=elements if tp > 1 else 0)

    query = ([whole(q_rank * h), whole(q_rank, matmul=False),
              Param(heads * qk * q_rank, matmul=True)] if q_rank
             else [Param(heads * qk * h, matmul=True)])
    return query + [whole((latent + config.qk_rope_head_dim) * h), whole(latent, matmul=False),
                    Param(heads * (config.qk_nope_head_dim + config.v_head_dim) * latent,
                          matmul=True),
                    Param(h * heads * config.v_head_dim, matmul=True)]


def block_params(config: ModelConfig, layout: TrainLayout, layer: int) -> list[Param]:
    """A block's tensors on one rank, in registration order."""
    tp, sp, h = layout.tp, layout.sequence_parallel, config.hidden_size
    params = _norm(config, sp)
    params += (_latent_attention(config, tp) if config.attention == "mla"
               else _attention(config, tp, sp))
    params += _norm(config, sp)
    if not config.is_moe_layer(layer):
        return params + _mlp(config, config.ffn_hidden_size, tp, sp)
    # An MoE layer stays whole on every tp rank (under SP it gathers the sequence first); only
    # expert parallelism takes the experts out of the replicated parameters.
    router = [Param(config.num_experts * h, matmul=True)]
    if config.router_score == "sigmoid":  # the balancing bias, the router's own (listed first)
        router.insert(0, Param(config.num_experts, frozen=True))
    # The shared experts are split over tp like a dense MLP (their input is whole inside).
    shared_mlp = (_mlp(config, shared_expert_size(config), tp) if config.num_shared_experts
                  else [])
    experts = [p for _ in range(config.num_experts // layout.ep)
               for p in _mlp(config, config.moe_ffn_hidden_size, expert=layout.ep > 1)]
    # ExpertParallelMoE registers the router, the shared expert, then the experts.
    return params + router + (shared_mlp + experts if layout.ep > 1 else experts + shared_mlp)


@lru_cache(maxsize=1024)
def rank_parameters(config: ModelConfig, layout: TrainLayout, pp_rank: int) -> tuple[Param, ...]:
    """Every parameter tensor of one rank of pipeline rank `pp_rank`, in registration order, each
    with its stage and ZeRO-3 unit (see the module doc): unit 0 the embedding (and the root unit
    of a tied one), 1 the positions where they are a unit of their own, 2 + layer each block,
    2 + num_layers the final norm and head."""
    tp, sp, h = layout.tp, layout.sequence_parallel, config.hidden_size
    last = layout.pp * layout.vpp - 1
    vocab_rows = config.vocab_size // tp
    tied, pipelined = config.tie_embeddings, layout.pp > 1
    head_unit = 0 if tied and not pipelined else 2 + config.num_layers
    params: list[Param] = []
    for stage in rank_stages(layout, pp_rank):
        if stage == 0:
            params.append(Param(vocab_rows * h, stage=stage, unit=0, root=tied and not pipelined,
                                tied=tied and pipelined))
        elif stage == last and tied:
            params.append(Param(vocab_rows * h, stage=stage, unit=0, root=True, tied=True))
        if stage == 0 and config.position == "learned":
            params.append(Param(config.max_seq_len * h, partial=config.max_seq_len * h
                                if sp else 0, stage=stage, unit=1 if tied and pipelined else 0,
                                root=tied and not pipelined))
        for layer in stage_blocks(config, layout, stage):
            params += [replace(p, stage=stage, unit=None if p.expert else 2 + layer)
                       for p in block_params(config, layout, layer)]
        if stage == last:
            params += [replace(p, stage=stage, unit=head_unit, root=head_unit == 0)
                       for p in _norm(config, sp)]
            if not tied:
                params.append(Param(vocab_rows * h, matmul=True, stage=stage, unit=head_unit))
    return tuple(params)


def data_parallel_parameters(config: ModelConfig, layout: TrainLayout, pp_rank: int
                             ) -> list[Param]:
    """The rank's trainable parameters outside the experts: what the data-parallel group reduces
    and ZeRO shards (experts reduce over their own group; frozen ones have no gradient)."""
    return [p for p in rank_parameters(config, layout, pp_rank) if not p.expert and not p.frozen]
