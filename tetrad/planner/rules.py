"""The one set of rules a parallel layout obeys against a model and a sequence length, shared by
the planner and the runtime, and the layout resolved once for a run.

`ParallelConfig` checks what its degrees and knobs must satisfy on their own; `check_layout` adds
what depends on the model. Some layouts can be planned but not run by tetrad's runtime: the
planner evaluates Megatron-style runs too (its vocabulary padded, no dense FFN split rule). Tensor
parallelism beyond the kv heads (multi-query attention's one head over tp 8) replicates each kv
head on tp / num_kv_heads ranks, as tetrad's runtime and Megatron's multi-query attention do,
counted in memory, FLOPs and communication (tetrad.planner.flops, memory, training); `kv_replicas=False` is a stack that needs tp to divide the kv heads. Those differences are the
`runtime` flag's, on top of the shared rules, never a second copy of them.

`resolve_layout` is what a run does once, before any process starts: check the layout for the
model, cut the pipeline, and hand the result (`ResolvedLayout`) to every rank, to `parallelize`
and to the planner's prediction, so the three read the very same object.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tetrad.spec.model import ModelConfig, ParallelConfig
from tetrad.errors import ConfigError
from tetrad.planner.partition import check_stages, partition


def divisors(n: int, at_most: int | None = None) -> list[int]:
    """The divisors of `n` (those up to `at_most`), ascending, in O(min(sqrt(n), at_most))
    steps: the search asks for the divisors of GPU counts and batches of millions."""
    limit = n if at_most is None else min(n, at_most)
    if limit * limit <= n:
        return [d for d in range(1, limit + 1) if n % d == 0]
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if d * d != n and n // d <= limit]
    return small + large


def _options(values: list[int]) -> str:
    return ", ".join(str(v) for v in values[:12]) + (" ..." if len(values) > 12 else "")


def _kv_fits(kv: int, tp: int, kv_replicas: bool) -> bool:
    """Each rank needs whole kv heads: tp divides them, or (kv_replicas, tetrad's runtime) is a
    multiple of them, each kv head then replicated on tp / num_kv_heads ranks."""
    return kv % tp == 0 or (kv_replicas and tp % kv == 0)


def tp_fits(config: ModelConfig, tp: int, training: bool = True, kv_replicas: bool = True,
            runtime: bool = True) -> bool:
    """Whether tp can split `config`. Serving (not `training`) replicates kv heads when tp exceeds
    them (vLLM), so only the query heads count there; tetrad's runtime also splits the vocabulary
    and the dense MLP's hidden units evenly."""
    if config.num_heads % tp:
        return False
    if (runtime or training and config.attention == "mha") and \
            not _kv_fits(config.num_kv_heads, tp, kv_replicas):
        return False
    if not runtime:
        return True
    dense = any(not config.is_moe_layer(layer) for layer in range(config.num_layers))
    return config.vocab_size % tp == 0 and not (dense and config.ffn_hidden_size % tp) \
        and not shared_expert_size(config) % tp


def shared_expert_size(config: ModelConfig) -> int:
    """Hidden units of an MoE layer's shared experts (one MLP, split over tp like a dense one)."""
    return config.num_shared_experts * (config.moe_ffn_hidden_size or config.ffn_hidden_size) \
        if config.is_moe else 0


def valid_tp_degrees(config: ModelConfig, training: bool = True, kv_replicas: bool = True,
                     runtime: bool = False) -> list[int]:
    return [t for t in divisors(config.num_heads)
            if tp_fits(config, t, training, kv_replicas, runtime)]


def check_tensor_parallel(config: ModelConfig, tp: int, sequence_parallel: bool = False,
                          seq_len: int | None = None, training: bool = True,
                          kv_replicas: bool = True, runtime: bool = True) -> None:
    """Raise ConfigError, before anything starts, when `config` cannot be split over `tp` ranks."""
    if tp == 1 or (tp_fits(config, tp, training, kv_replicas, runtime)
                   and not (sequence_parallel and seq_len and seq_len % tp)):
        return
    valid = valid_tp_degrees(config, training, kv_replicas, runtime)
    hint = f"; tp values that fit this model: {_options(valid)}"
    kv = config.num_kv_heads
    if config.num_heads % tp:
        raise ConfigError(f"tp {tp} does not divide num_heads {config.num_heads}: attention is "
                          f"split by heads{hint}")
    if not tp_fits(config, tp, training, kv_replicas, runtime=False):
        if kv_replicas:
            raise ConfigError(f"tp {tp} and num_kv_heads {kv} do not fit: tp must divide the kv "
                              f"heads or be a multiple of them (each kv head then replicated on "
                              f"tp / num_kv_heads ranks){hint}")
        raise ConfigError(f"tp {tp} does not divide num_kv_heads {kv} (each TP rank needs whole "
                          f"KV heads){hint}")
    if config.vocab_size % tp:
        padded = -(-config.vocab_size // tp) * tp
        raise ConfigError(f"tp {tp} does not divide vocab_size {config.vocab_size}: pad the "
                          f"vocabulary to {padded} (a multiple of tp){hint}")
    shared = shared_expert_size(config)
    if shared % tp:
        raise ConfigError(f"tp {tp} does not divide the shared experts' {shared} hidden units "
                          f"(num_shared_experts x moe_ffn_hidden_size): they are split like a "
                          f"dense MLP{hint}")
    if not tp_fits(config, tp, training, kv_replicas, runtime):
        raise ConfigError(f"tp {tp} does not divide ffn_hidden_size {config.ffn_hidden_size}: "
                          f"the MLP is split by its hidden units{hint}")
    raise ConfigError(f"--sequence-parallel splits the sequence over tp {tp} ranks, but seq_len "
                      f"{seq_len} is not a multiple of {tp}: change --seq-len or drop "
                      f"--sequence-parallel")


def check_sequence_length(config: ModelConfig, seq_len: int, runtime: bool = True) -> None:
    """One rule, with or without context parallelism: tetrad's runtime and learned positions
    stop at the model's max_seq_len; the planner times a rope model beyond it (a run that
    extends the context, as long-context training does), whatever cp is."""
    if seq_len > config.max_seq_len and (runtime or config.position == "learned"):
        raise ConfigError(f"sequence length {seq_len} is longer than the model's max_seq_len "
                          f"{config.max_seq_len}: shorten --seq-len")


def check_context_parallel(config: ModelConfig, cp: int, seq_len: int,
                           runtime: bool = True) -> None:
    """What can be wrong with context parallelism for this model and sequence length."""
    if cp < 1:
        raise ConfigError(f"cp must be a positive integer, got {cp}")
    check_sequence_length(config, seq_len, runtime)
    if seq_len % (2 * cp):
        raise ConfigError(
            f"sequence length {seq_len} does not split into 2*cp = {2 * cp} equal chunks (the "
            f"load-balanced causal layout): make --seq-len a multiple of {2 * cp} or change --cp")


def check_expert_parallel(config: ModelConfig, ep: int,
                          capacity_factor: float | None = None) -> None:
    """What can be wrong with expert parallelism for this model."""
    if ep > 1 and not config.is_moe:
        raise ConfigError(f"--ep {ep} needs a mixture-of-experts model (num_experts > 0), but "
                          f"{config.name} is dense: set --ep 1")
    if config.is_moe and config.num_experts % ep:
        raise ConfigError(f"ep {ep} does not divide num_experts {config.num_experts}: choose ep "
                          f"among {', '.join(map(str, divisors(config.num_experts)))}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ConfigError(f"capacity factor must be positive, got {capacity_factor}: use None "
                          f"for dropless routing")


def check_degrees(config: ModelConfig, tp: int, pp: int, ep: int, training: bool = True,
                  kv_replicas: bool = True, runtime: bool = False) -> None:
    """The model-shape constraints of the degrees, whatever the GPU count."""
    check_tensor_parallel(config, tp, training=training, kv_replicas=kv_replicas,
                          runtime=runtime)
    if pp > config.num_layers:
        raise ConfigError(f"pp {pp} is more than the model's {config.num_layers} layers: "
                          f"use pp <= {config.num_layers}")
    check_expert_parallel(config, ep)


def check_deepseek_features(config: ModelConfig, parallel: ParallelConfig) -> None:
    """The layouts DeepSeek's features cannot train under (dp, ZeRO, tp, pp, ep and their
    compositions all can). Ring attention exchanges each key with its value as one tensor of one
    width and scales scores by the query's width, while MLA's values are narrower than its keys
    and its softmax scale is its own (YaRN's mscale). Parameter servers hold the parameters
    but only see gradients, and the routing bias has none: each worker would move its own copy
    from its own tokens (and MLA under them is not checked yet)."""
    if parallel.cp > 1 and config.attention == "mla":
        raise ConfigError("context parallelism's ring attention needs keys and values of one "
                          "width and the query-width softmax scale, which multi-head latent "
                          "attention (MLA) does not have: drop --cp (use --dp, --tp, --pp or "
                          "--ep)")
    if parallel.strategy == "ps" and config.router_bias_update_rate > 0:
        raise ConfigError("--strategy ps cannot move aux-loss-free balancing's routing bias: "
                          "its servers only see gradients and the bias has none, so each worker "
                          "would move its own copy from its own tokens; use --dp (and --zero)")
    if parallel.strategy == "ps" and config.attention == "mla":
        raise ConfigError("--strategy ps has not been checked against one-process training "
                          "for multi-head latent attention (MLA) yet: use --dp (and --zero)")


def check_runtime_model(config: ModelConfig) -> None:
    """The block shapes the planner times and tetrad's layers do not build."""
    unbuilt = [name for name, value in (("parallel_block", config.parallel_block),
                                        ("rotary_fraction", config.rotary_fraction != 1),
                                        ("qk_norm", config.qk_norm)) if value]
    if unbuilt:
        raise ConfigError(f"tetrad's runtime does not build {', '.join(unbuilt)} (the planner "
                          f"times them: tetrad plan): train or serve a model without them")


def check_layout(config: ModelConfig, parallel: ParallelConfig, seq_len: int,
                 runtime: bool = True, kv_replicas: bool = True) -> None:
    """Everything about `parallel` that can be wrong for this model and sequence length, as one
    ConfigError saying the fix. `runtime` adds what tetrad's runtime needs beyond the planner."""
    if runtime:
        check_deepseek_features(config, parallel)
        check_runtime_model(config)
    if parallel.pp == 1 and (parallel.vpp > 1 or runtime and parallel.microbatches > 1):
        raise ConfigError("--microbatches and --vpp are the pipeline's, but --pp is 1: add --pp "
                          "(or use --grad-accum for gradient accumulation)")
    if runtime and parallel.sequence_parallel and parallel.tp == 1:
        raise ConfigError("--sequence-parallel splits the sequence over the tensor-parallel "
                          "ranks, but --tp is 1: add --tp 2 or more, or drop it")
    check_sequence_length(config, seq_len, runtime)
    if parallel.cp > 1:
        check_context_parallel(config, parallel.cp, seq_len, runtime)
    check_tensor_parallel(config, parallel.tp, parallel.sequence_parallel and runtime,
                          seq_len // parallel.cp, kv_replicas=kv_replicas, runtime=runtime)
    check_stages(config.num_layers, parallel.pp * parallel.vpp, parallel.stage_layers or None)
    check_expert_parallel(config, parallel.ep)


@dataclass(frozen=True)
class ResolvedLayout:
    """A layout checked against its model and sequence length, with the pipeline cut: made once
    by `resolve_layout` and read by every rank, `parallelize` and the planner alike."""

    model: ModelConfig
    parallel: ParallelConfig  # stage_layers holds the pipeline cut (one count per stage)
    seq_len: int


def resolve_layout(config: ModelConfig, parallel: ParallelConfig, seq_len: int,
                   runtime: bool = True, kv_replicas: bool = True) -> ResolvedLayout:
    check_layout(config, parallel, seq_len, runtime, kv_replicas)
    cut = partition(config, parallel.pp * parallel.vpp, seq_len, parallel.stage_layers or None)
    if parallel.pp > 1:
        parallel = dataclasses.replace(parallel, stage_layers=cut.stage_layers)
    return ResolvedLayout(config, parallel, seq_len)
