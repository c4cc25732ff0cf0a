"""Serving a model: weights and KV cache per GPU, time to first token, time per output token and
decode throughput, for a layout of tensor, pipeline, expert and data (replica) parallelism.

Prefill is compute bound; decode reads every weight a step touches and each sequence's KV cache
once per token, so it is bandwidth bound until the batch is large: both fall out of the same
roofline per kernel (compute.py). With pipeline parallelism the batch is split into pp microbatches
that occupy the stages in turn (vLLM), so a token takes pp stage-times and the throughput is
batch / (pp * stage time). Experts are split over `ep` ranks and, where 1 < ep < tp, each expert
over tp / ep ranks; ep > tp spreads experts over replicas (attention data parallel, as in
DeepSeek's serving); with ep = 1 every tp rank holds and computes every expert whole (tetrad's
engine under --tp alone). Memory: a fraction of each GPU is usable, vLLM's
--gpu-memory-utilization (0.9 by default); the largest batch is the largest whose weights, scratch
and whole-context KV cache fit that budget (the scratch grows with the batch, so it is searched).
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.spec.model import ModelConfig
from tetrad.errors import ConfigError
from tetrad.hardware.catalog import Cluster
from tetrad.planner import comm
from tetrad.planner.compute import bandwidth_time, gemm_time, layer_times
from tetrad.planner.flops import attention_head_dims, head_gemm, layer_gemms
from tetrad.planner.layout import stage_first_layer, stage_layer_counts
from tetrad.planner.memory import kv_bytes_per_token, stages_to_check
from tetrad.planner.model_stats import (embedding_params, head_params, kv_replica_params,
                                        layer_params, norm_params, position_params,
                                        unquantized_layer_params)
from tetrad.planner.precision import COMPUTE_DTYPE, element_bytes, unquantized_bytes, weight_bytes
from tetrad.planner.quantized import QUANTIZED_DTYPES, check_quantizable, quantized_layer_bytes
from tetrad.planner.rules import check_degrees
from tetrad.spec.serving import ServeLayout  # the engine's layout too (its ServeConfig extends it)

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
MAX_BATCH = 256  # vLLM's default max_num_seqs
PREFILL_CHUNK = 8192  # tokens per prefill step (vLLM's chunked-prefill budget on large GPUs)


@dataclass(frozen=True)
class ServeWorkload:
    context_len: int  # longest sequence (prompt + output) the KV cache must hold
    prompt_len: int
    output_len: int
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    batch: int = 0  # concurrent sequences; 0 means as many as fit (at most MAX_BATCH)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION  # share of each GPU usable
    host_step_s: float = 0.0  # host work per engine step the GPU waits for (planner/stacks.py)
    request_rate: float = 0.0  # requests per second over all replicas; 0: a static `batch`

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 0:
            raise ConfigError(f"--prompt-len must be at least 1 and --output-len at least 0, got "
                              f"{self.prompt_len} and {self.output_len}")
        if self.context_len < self.prompt_len + self.output_len:
            raise ConfigError(f"--context-len {self.context_len} cannot hold the prompt and the "
                              f"output ({self.prompt_len} + {self.output_len} tokens)")
        if self.batch < 0:
            raise ConfigError(f"--batch must be a number of concurrent sequences (at least 1), "
                              f"or 0 for as many as fit; got {self.batch}")
        if self.request_rate < 0 or (self.request_rate and self.batch):
            raise ConfigError(f"--request-rate must be positive and replaces --batch (the "
                              f"running batch follows from the rate), got {self.request_rate} "
                              f"with --batch {self.batch}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be a fraction in (0, 1], got "
                              f"{self.gpu_memory_utilization}")


@dataclass(frozen=True)
class ServingEstimate:
    layout: ServeLayout
    weights: float  # bytes per GPU, fullest stage
    activations: float
    kv_cache: float  # bytes per GPU for `batch` sequences at context_len
    usable_memory: float
    max_concurrent_sequences: int  # over all replicas
    batch: int  # concurrent sequences per replica used for the timings
    ttft_s: float
    tpot_s: float
    batch_ttft_s: float  # prefill of the whole batch at once (a static batch's first tokens)
    request_s: float  # a static batch from its prompts to its last output token
    request_tokens: tuple[int, int]  # prompt and output tokens of one request

    @property
    def fits(self) -> bool:
        """Weights, scratch and the KV cache of `batch` sequences per replica fit."""
        return self.batch >= 1 and self.total_memory <= self.usable_memory

    @property
    def total_memory(self) -> float:
        return _memory_per_gpu(self.weights, self.activations, self.kv_cache)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.layout.dp * self.batch / self.tpot_s if self.tpot_s else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        """Whole requests: every replica's batch of outputs over prefill plus decode."""
        return (self.layout.dp * self.batch * self.request_tokens[1] / self.request_s
                if self.request_s else 0.0)

    @property
    def total_tokens_per_s(self) -> float:
        """Prompt and output tokens over prefill plus decode (published tables' "total")."""
        return (self.layout.dp * self.batch * sum(self.request_tokens) / self.request_s
                if self.request_s else 0.0)


def check_serve_layout(config: ModelConfig, num_gpus: int, layout: ServeLayout) -> None:
    check_degrees(config, layout.tp, layout.pp, layout.ep, training=False)
    if layout.tp * layout.pp * layout.dp != num_gpus:
        raise ConfigError(f"tp*pp*dp = {layout.tp}*{layout.pp}*{layout.dp} = "
                          f"{layout.tp * layout.pp * layout.dp}, but there are {num_gpus} GPUs")
    if not experts_spread(layout.tp, layout.dp, layout.ep):
        raise ConfigError(f"ep {layout.ep} must divide tp*dp = {layout.tp * layout.dp} and be a "
                          f"multiple or divisor of tp {layout.tp}")


def experts_spread(tp: int, dp: int, ep: int) -> bool:
    """Whether ep ranks can hold the experts of a tp x dp group: ep divides tp*dp and either
    spreads whole experts from the tp group outward or splits within it."""
    return ep == 1 or ((tp * dp) % ep == 0 and (ep % tp == 0 or tp % ep == 0))


def model_weight_bytes(config: ModelConfig, dtype: str) -> float:
    """One copy of the served weights: linear layers in `dtype` (block scales included), the
    rest in 16 bits."""
    return weight_bytes_per_gpu(config, ServeLayout(), dtype, 0)


def _expert_split(layout: ServeLayout) -> int:
    """GPUs one layer's routed experts are spread over: ep ranks each hold whole experts, and
    below tp the remaining tp / ep ranks split each expert's columns. With ep = 1 every tp rank
    keeps every expert whole, as the engine's tensor-parallel layers do (ep = tp spreads them)."""
    return 1 if layout.ep == 1 else max(layout.ep, layout.tp)


def _expert_tp(layout: ServeLayout) -> int:
    """Ranks that split each expert's columns (1 < ep < tp); 1 where experts are whole."""
    return layout.tp // layout.ep if 1 < layout.ep < layout.tp else 1


def weight_bytes_per_gpu(config: ModelConfig, layout: ServeLayout, dtype: str,
                         stage: int) -> float:
    """One rank's weight bytes on pipeline stage `stage`. int8 and int4 are the engine's
    layouts counted matrix by matrix (planner/quantized.py): exactly what it holds."""
    counts = stage_layer_counts(config.num_layers, layout.pp)
    first = stage_first_layer(counts, stage)
    quantized, kept = weight_bytes(dtype), unquantized_bytes(dtype)
    total = 0.0
    for layer in range(first, first + counts[stage]):
        if dtype in QUANTIZED_DTYPES:
            total += quantized_layer_bytes(config, layer, layout, dtype)
            continue
        params = layer_params(config, layer)
        small = unquantized_layer_params(config, layer)
        matmul_replicated = params.replicated - small
        total += ((params.tp_sharded / layout.tp + matmul_replicated
                   + kv_replica_params(config, layout.tp)) * quantized
                  + params.experts / _expert_split(layout) * quantized + small * kept)
    if stage == 0:
        total += (embedding_params(config) / layout.tp + position_params(config)) * kept
    if stage == layout.pp - 1:
        head = head_params(config) or (embedding_params(config) if layout.pp > 1 else 0)
        total += (head / layout.tp + norm_params(config)) * kept
    return total


def _activation_bytes(config: ModelConfig, layout: ServeLayout, batch: int,
                      prompt_len: int) -> float:
    """Peak scratch of a forward pass: a prefill chunk's widest intermediates plus fp32 logits
    for sampling the batch."""
    tokens = min(PREFILL_CHUNK, max(prompt_len, batch))
    widest = max(2 * -(-config.ffn_hidden_size // layout.tp),
                 (config.num_heads + 2 * config.num_kv_heads) * config.head_dim // layout.tp)
    return (tokens * (4 * config.hidden_size + 2 * widest) * 2
            + batch * config.vocab_size / layout.tp * 4)


def _stage_forward_time(config: ModelConfig, cluster: Cluster, layout: ServeLayout,
                        workload: ServeWorkload, stage: int, tokens: int, sequences: int,
                        context: int, decode: bool) -> float:
    """One forward pass of `tokens` tokens from `sequences` sequences through one stage,
    communication included."""
    gpu = cluster.gpu
    counts = stage_layer_counts(config.num_layers, layout.pp)
    first = stage_first_layer(counts, stage)
    compute_dtype = COMPUTE_DTYPE[workload.weight_dtype]
    wbytes = weight_bytes(workload.weight_dtype)
    act = 2.0
    group_tokens = tokens * max(1, layout.ep // layout.tp)
    tp_group = comm.place_group(cluster, layout.tp, 1)
    ep_group = comm.place_group(cluster, layout.ep, 1)
    kv_per_layer = kv_bytes_per_token(config, element_bytes(workload.kv_dtype), layout.tp, 1)
    d_qk, d_v = attention_head_dims(config)
    heads = -(-config.num_heads // layout.tp)
    total = 0.0
    for layer in range(first, first + counts[stage]):
        if decode:
            gemms = layer_gemms(config, layer, tokens, layout.tp, layout.ep, group_tokens,
                                _expert_tp(layout))
            total += sum(gemm_time(gpu, g, compute_dtype, act, wbytes) for g in gemms)
            # Each sequence reads its whole KV cache; MLA attends in the latent space
            # (weight absorption), 2 * (kv_lora + rope + kv_lora) FLOPs per head and position.
            width = (2 * config.kv_lora_rank + config.qk_rope_head_dim
                     if config.attention == "mla" else d_qk + d_v)
            flops = 2.0 * heads * width * context * sequences
            total += max(flops / (gpu.peak("bf16") * gpu.efficiency.attention),
                         bandwidth_time(gpu, kv_per_layer * context * sequences, 1))
        else:
            times = layer_times(config, gpu, layer, sequences, tokens // sequences, layout.tp, 1,
                                layout.ep, True,
                                "none", True, False, compute_dtype, act, wbytes, group_tokens,
                                _expert_tp(layout))
            total += times.forward
        total += 2 * comm.all_reduce_time(cluster, tp_group, tokens * config.hidden_size * act)
        if config.is_moe_layer(layer) and layout.ep > layout.tp:
            # Experts on other replicas: dispatch and combine; each TP rank sends a slice.
            size = tokens * config.num_experts_per_token * config.hidden_size * act / layout.tp
            total += 2 * comm.all_to_all_time(cluster, ep_group, size)
    if stage == layout.pp - 1:
        # Logits only for each sequence's last position.
        total += gemm_time(gpu, head_gemm(config, sequences, layout.tp), "bf16", act, 2.0)
    if layout.pp > 1 and stage < layout.pp - 1:
        crosses = layout.tp * layout.dp >= cluster.node_size
        total += comm.p2p_time(cluster, crosses, tokens * config.hidden_size * act)
    return total


def _memory_per_gpu(weights: float, activations: float, kv_cache: float) -> float:
    """What a GPU holds; the one sum both the capacity search and `ServingEstimate.fits` use."""
    return weights + activations + kv_cache


def _max_batch_per_replica(config: ModelConfig, layout: ServeLayout, workload: ServeWorkload,
                           weights: float, per_sequence: float, usable: float) -> int:
    """The largest batch whose weights, scratch and KV cache fit `usable`: scratch grows with
    the batch (logits, the prefill chunk), so fitting is monotone in the batch and a bisection
    finds the edge exactly."""
    def fits(batch: int) -> bool:
        activations = _activation_bytes(config, layout, batch, workload.prompt_len)
        return _memory_per_gpu(weights, activations, batch * per_sequence) <= usable

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def evaluate_serving(config: ModelConfig, cluster: Cluster, layout: ServeLayout,
                     workload: ServeWorkload) -> ServingEstimate:
    check_quantizable(config, layout, workload.weight_dtype)
    usable = cluster.gpu.memory_bytes * workload.gpu_memory_utilization
    kv_per_token = max(
        kv_bytes_per_token(config, element_bytes(workload.kv_dtype), layout.tp, count)
        for count in stage_layer_counts(config.num_layers, layout.pp))
    stages = stages_to_check(config, layout.pp)
    weights = max(weight_bytes_per_gpu(config, layout, workload.weight_dtype, stage)
                  for stage in stages)
    per_sequence = workload.context_len * kv_per_token
    per_replica = _max_batch_per_replica(config, layout, workload, weights, per_sequence, usable)
    context = workload.prompt_len + workload.output_len // 2
    prefill = _prefill_time(config, cluster, layout, workload, 1)
    if workload.request_rate:
        batch, tpot = _steady_state(config, cluster, layout, workload, stages, context, prefill,
                                    per_replica)
        # A request waits out half a step on average; the next step decodes the running batch
        # and prefills its prompt.
        batch_ttft = (0.5 * tpot + prefill
                      + _decode_step(config, cluster, layout, workload, batch, stages, context))
    else:
        batch = workload.batch or min(per_replica, MAX_BATCH)
        batch_ttft = _prefill_time(config, cluster, layout, workload, batch) if batch else 0.0
        batch_ttft += workload.host_step_s if batch else 0.0  # a prefill is an engine step too
        tpot = _decode_step(config, cluster, layout, workload, batch, stages, context)
    activations = _activation_bytes(config, layout, max(batch, 1), workload.prompt_len)
    ttft = prefill + workload.host_step_s if batch else 0.0
    # The prefill gives each sequence its first token; the decode steps give the rest.
    request = batch_ttft + max(workload.output_len - 1, 0) * tpot
    return ServingEstimate(layout=layout, weights=weights, activations=activations,
                           kv_cache=batch * per_sequence,
                           usable_memory=usable, max_concurrent_sequences=per_replica * layout.dp,
                           batch=batch, ttft_s=ttft, tpot_s=tpot, batch_ttft_s=batch_ttft,
                           request_s=request,
                           request_tokens=(workload.prompt_len, workload.output_len))


def _decode_step(config: ModelConfig, cluster: Cluster, layout: ServeLayout,
                 workload: ServeWorkload, batch: int, stages, context: int) -> float:
    """One decode step of `batch` sequences per replica, in up to pp microbatches (0 if none)."""
    if not batch:
        return 0.0
    in_flight = max(1, -(-batch // layout.pp))
    stage_time = max(_stage_forward_time(config, cluster, layout, workload, stage, in_flight,
                                         in_flight, context, True) for stage in stages)
    return layout.pp * stage_time + workload.host_step_s


def _steady_state(config: ModelConfig, cluster: Cluster, layout: ServeLayout,
                  workload: ServeWorkload, stages, context: int, prefill: float,
                  limit: int) -> tuple[int, float]:
    """(running batch per replica, engine step seconds) of continuous batching at
    workload.request_rate, split evenly over the replicas. Each step decodes the running batch
    and prefills the prompts that arrived during the step before (rate x step of them), so a
    step lasts decode(b) / (1 - rate x prefill); a request stays output_len steps, and by
    Little's law the running batch is rate x output_len x step. The smallest batch that carries
    the rate; limit + 1 (which does not fit) when none up to `limit` does."""
    rate = workload.request_rate / layout.dp
    busy = rate * prefill  # the share of each step spent on arriving prompts

    def step(batch: int) -> float:
        return _decode_step(config, cluster, layout, workload, batch, stages, context) / (
            1 - min(busy, 0.999))

    def carries(batch: int) -> bool:
        return busy < 1 and rate * workload.output_len * step(batch) <= batch

    if not carries(max(limit, 1)):
        return limit + 1, step(limit + 1)
    low, high = 0, max(limit, 1)  # carries(high); not carries(low) for a positive rate
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if carries(middle) else (middle, high)
    return high, step(high)


def _prefill_time(config: ModelConfig, cluster: Cluster, layout: ServeLayout,
                  workload: ServeWorkload, sequences: int) -> float:
    """Prompts of `sequences` sequences through every stage: with pp > 1 they go as up to pp
    microbatches, one stage apart (a pipeline's fill, then its slowest stage per microbatch)."""
    microbatches = min(layout.pp, sequences)
    per_microbatch = -(-sequences // microbatches)
    stage_times = [_stage_forward_time(config, cluster, layout, workload, stage,
                                       per_microbatch * workload.prompt_len, per_microbatch,
                                       workload.prompt_len, False)
                   for stage in range(layout.pp)]
    return sum(stage_times) + (microbatches - 1) * max(stage_times)
