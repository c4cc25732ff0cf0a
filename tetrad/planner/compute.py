"""Time of the kernels of one microbatch on one GPU: matmuls, attention, memory-bound element-wise
work, the LM head and the optimizer step.

Each GEMM takes the roofline of its FLOPs and its bytes plus a fixed kernel overhead (the GPU's
efficiency profile), so small matmuls run below peak. Flash attention runs at the profile's
attention efficiency; its backward does 2.5x the forward's matmul work (it recomputes the scores).
Without flash attention the s x s scores go through HBM: batched GEMMs plus a softmax (and dropout)
that are bandwidth bound. Norms, residual adds, activations, rotary embedding and MoE token
permutation are bandwidth bound too; their backward moves about twice the forward's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from tetrad.spec.layout import FORWARD_AGAIN
from tetrad.spec.model import ModelConfig
from tetrad.hardware.catalog import GPU
from tetrad.planner.flops import Gemm, attention_core_flops, attention_head_dims, head_gemm, \
    layer_gemms
from tetrad.planner import op_checkpoint
from tetrad.planner.layout import stage_first_layer, stage_layer_counts
from tetrad.planner.unfused import activation_traffic, norm_traffic, rope_traffic

BACKWARD_ATTENTION_FACTOR = 2.5  # FlashAttention-2 paper, section 3.1.2: 5 matmuls vs 2


@dataclass(frozen=True, slots=True)
class KernelTimes:
    """Seconds per microbatch on one GPU."""

    forward: float
    backward: float
    recompute: float
    matmul_forward: float  # the part a tensor-parallel collective can hide behind
    attention_forward: float  # the part a context-parallel ring can hide behind

    def __add__(self, other: "KernelTimes") -> "KernelTimes":
        return KernelTimes(*(a + b for a, b in zip(self._tuple(), other._tuple())))

    def scaled(self, factor: float) -> "KernelTimes":
        return KernelTimes(*(a * factor for a in self._tuple()))

    def _tuple(self) -> tuple[float, ...]:
        return (self.forward, self.backward, self.recompute, self.matmul_forward,
                self.attention_forward)


ZERO = KernelTimes(0.0, 0.0, 0.0, 0.0, 0.0)


def gemm_time(gpu: GPU, gemm: Gemm, compute_dtype: str, act_bytes: float,
              weight_bytes: float, fp8_casts: str = "") -> float:
    """`gemm.count` equal matmuls run as one grouped (or batched) kernel: MoE experts as in
    Megatron's grouped GEMM and vLLM's fused MoE, attention heads as one batched GEMM."""
    bytes_moved = gemm.count * ((gemm.m * gemm.k + gemm.m * gemm.n) * act_bytes
                                + gemm.k * gemm.n * weight_bytes)
    time = gpu.efficiency.matmul_time(gemm.flops, bytes_moved, gpu.peak(compute_dtype),
                                      gpu.memory_bandwidth,
                                      compute_dtype == "fp8" and "fp8" in gpu.peak_flops)
    return time + (fp8_cast_time(gpu, gemm, act_bytes, fp8_casts) if fp8_casts else 0.0)


def fp8_cast_time(gpu: GPU, gemm: Gemm, act_bytes: float, casts: str = "inputs") -> float:
    """Quantizing one GEMM's operands in fp8 training (`casts`: "inputs" or "inputs+weights"),
    which keeps 16-bit activations and quantizes them on the fly: Transformer Engine's cast-transpose reads each 16-bit element
    and writes it twice in fp8 (as is, and transposed for the backward GEMMs), after an amax
    pass that reads it once more. Persistent weights are cast once per step and reused by every
    microbatch (Megatron's is_first_microbatch); ZeRO-3 frees each gathered weight after use, so
    its fp8 copy is cast again every microbatch ("inputs+weights"). Bandwidth-bound: a GEMM that
    fp8 makes twice as fast gains less than twice."""
    elements = gemm.count * (gemm.m * gemm.k + (gemm.k * gemm.n if "weights" in casts else 0))
    return bandwidth_time(gpu, elements * (2 * act_bytes + 2), 2)


def bandwidth_time(gpu: GPU, bytes_moved: float, num_kernels: int) -> float:
    profile = gpu.efficiency
    return (bytes_moved / (gpu.memory_bandwidth * profile.memory)
            + num_kernels * profile.kernel_overhead_s)


# Fused attention's share of the bf16 peak against the length of one kernel call, forward and
# backward apart, causal and full (a rectangle of queries by keys is read at the square of its
# area): PyTorch SDPA on [batch, 32 heads, length, 128] bf16, about 64K tokens a call, measured
# on one H200, whose SMs and clocks are the H100 SXM's (benchmarks/gpu_attention_efficiency.py,
# 2026-11-28; BENCHMARKS.md). "vendor": cuDNN's fused attention, the kernel Transformer Engine
# calls; "portable": FlashAttention-2. Used relative to ATTENTION_REFERENCE, so that a profile's
# `attention` keeps its meaning (the forward of a long causal sequence) and the curve adds what
# one number cannot say: the backward runs at a smaller share than the forward (cuDNN 0.49-0.55
# against 0.61-0.64 from 8K tokens on), and short calls, a context-parallel rank's ring steps,
# at less than long ones (cuDNN's causal backward 0.34 at 1K, 0.44 at 2K).
ATTENTION_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
ATTENTION_LENGTH_CURVE: dict[tuple[str, bool], tuple[tuple[float, ...], tuple[float, ...]]] = {
    ("vendor", True): ((0.481, 0.562, 0.617, 0.644, 0.630, 0.614, 0.618),
                       (0.337, 0.439, 0.459, 0.494, 0.525, 0.539, 0.549)),
    ("vendor", False): ((0.628, 0.662, 0.672, 0.623, 0.622, 0.631, 0.630),
                        (0.459, 0.486, 0.507, 0.542, 0.549, 0.552, 0.552)),
    ("portable", True): ((0.273, 0.320, 0.342, 0.348, 0.340, 0.344, 0.342),
                         (0.181, 0.233, 0.272, 0.301, 0.320, 0.322, 0.326)),
    ("portable", False): ((0.353, 0.353, 0.344, 0.349, 0.355, 0.353, 0.353),
                          (0.241, 0.280, 0.302, 0.316, 0.320, 0.323, 0.326)),
}
# The causal forward at 32K-64K tokens: what the curve is divided by.
ATTENTION_REFERENCE = {kind: (ATTENTION_LENGTH_CURVE[(kind, True)][0][-2]
                              + ATTENTION_LENGTH_CURVE[(kind, True)][0][-1]) / 2
                       for kind in ("vendor", "portable")}


def _interpolate(values: tuple[float, ...], length: float) -> float:
    """`values` at ATTENTION_LENGTHS, linear in log2 of the length, held beyond the ends."""
    position = min(max(math.log2(length / ATTENTION_LENGTHS[0]), 0.0),
                   len(ATTENTION_LENGTHS) - 1.0)
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (position - low) * (values[high] - values[low])


def attention_efficiencies(gpu: GPU, portable: bool, causal: bool,
                           length: float) -> tuple[float, float]:
    """(forward, backward) share of the bf16 peak of one fused attention call over `length`
    queries and keys: the profile's level times the measured curve's shape. A calibrated profile
    (one with a measured matmul curve) timed its own attention, forward and backward together
    at one shape, and is used flat."""
    level = gpu.efficiency.attention_efficiency(portable)
    if gpu.efficiency.matmul_curve:
        return level, level
    kind = "portable" if portable else "vendor"
    forward, backward = ATTENTION_LENGTH_CURVE[(kind, causal)]
    scale = level / ATTENTION_REFERENCE[kind]
    return scale * _interpolate(forward, length), scale * _interpolate(backward, length)


def ring_attention_calls(seq_len: int, cp: int) -> tuple[tuple[float, bool, float], ...]:
    """(share of the rank's attention FLOPs, causal, kernel length) of the calls one rank makes.
    Without cp, one causal call over the sequence. Context parallelism as Megatron-Core runs it
    (Transformer Engine's p2p ring, load-balanced: the sequence cut in 2cp chunks, rank r holding
    chunks r and 2cp-1-r; docs of Megatron-Core's context parallelism) and as torchtitan runs it
    (PyTorch's context_parallel, head-tail load balancing): a causal call over the rank's own
    s/cp tokens, then cp - 1 full calls of s/(2cp) queries against s/cp keys or the reverse, each
    the same work, so every ring step is 1/cp of it."""
    if cp == 1:
        return ((1.0, True, float(seq_len)),)
    chunk = seq_len / (2 * cp)
    return ((1 / cp, True, 2 * chunk), ((cp - 1) / cp, False, chunk * math.sqrt(2)))


@lru_cache(maxsize=4096)
def attention_times(config: ModelConfig, gpu: GPU, micro_batch: int, seq_len: int, tp: int,
                    cp: int, flash: bool, dropout: bool, act_bytes: float,
                    portable: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core (scores, softmax, weighted values);
    `portable`: FlashAttention-2 / Triton kernels instead of the vendor's. Flash attention under
    context parallelism also merges each later ring step's partial result into the running one
    (Transformer Engine's context_parallel.cu: the output rescaled by the log-sum-exps forward,
    dQ and dK/dV added step by step backward), a read of both and a write each."""
    heads = -(-config.num_heads // tp)
    peak = gpu.peak("bf16")  # attention stays 16-bit even in fp8 training (Transformer Engine)
    overhead = gpu.efficiency.kernel_overhead_s
    d_qk, d_v = attention_head_dims(config)
    if flash:
        flops = attention_core_flops(config, seq_len, heads) * micro_batch / cp
        forward = backward = 0.0
        for share, causal, length in ring_attention_calls(seq_len, cp):
            forward_efficiency, backward_efficiency = attention_efficiencies(gpu, portable,
                                                                             causal, length)
            forward += share * flops / (peak * forward_efficiency)
            backward += share * BACKWARD_ATTENTION_FACTOR * flops / (peak * backward_efficiency)
        tokens = micro_batch * seq_len / cp
        kv_heads = heads if config.attention == "mla" else -(-config.num_kv_heads // tp)
        merges = cp - 1
        forward += merges * bandwidth_time(gpu, 3 * tokens * heads * d_v * act_bytes, 1)
        backward += merges * bandwidth_time(
            gpu, 3 * tokens * (heads * d_qk + kv_heads * (d_qk + d_v)) * act_bytes, 2)
        return forward + cp * overhead, backward + 2 * cp * overhead
    queries = seq_len // cp
    count = micro_batch * heads
    scores = Gemm(queries, seq_len, d_qk, count)
    values = Gemm(queries, d_v, seq_len, count)
    matmuls = sum(gemm_time(gpu, g, "bf16", act_bytes, act_bytes) for g in (scores, values))
    elements = count * queries * seq_len
    # Softmax reads the scores and writes probabilities; dropout adds a mask and a copy.
    softmax_bytes = elements * (2 * act_bytes + (1 + 2 * act_bytes if dropout else 0))
    forward = matmuls + bandwidth_time(gpu, softmax_bytes, 2 if dropout else 1)
    backward = 2 * matmuls + bandwidth_time(gpu, 2 * softmax_bytes, 2 if dropout else 1)
    return forward, backward


def _elementwise_bytes(config: ModelConfig, layer: int, tp: int, sequence_parallel: bool,
                       dropout: bool, act_bytes: float, eager: bool = False) -> tuple[float, int]:
    """Forward bytes per token of a block's bandwidth-bound kernels, and their count (`eager`:
    unfused model code, tetrad.planner.unfused)."""
    h = config.hidden_size
    replicated_split = tp if sequence_parallel else 1
    norm, norm_kernels = norm_traffic(config, act_bytes, eager)
    # Two norms and two residual adds (two reads + one write); a parallel block adds
    # attention's and the MLP's outputs to the input in one three-way add.
    adds = (4 * h, 1) if config.parallel_block else (6 * h, 2)
    replicated = 2 * h * norm + adds[0] * act_bytes + (2 * h * (1 + act_bytes) if dropout else 0)
    kernels = 2 * norm_kernels + adds[1] + (2 if dropout else 0)
    heads = -(-config.num_heads // tp)
    kv_heads = -(-config.num_kv_heads // tp)
    if config.position == "rope":
        if config.attention == "mla":
            rotated = heads * config.qk_rope_head_dim + config.qk_rope_head_dim
        else:  # partial rotary reads and writes only the rotated dims
            rotated = (heads + kv_heads) * config.rotary_dims
        per_element, rope_kernels = rope_traffic(act_bytes, eager)
        sharded = rotated * per_element
        kernels += rope_kernels
    else:
        sharded = 0.0
    if config.qk_norm:  # every query and key head
        sharded += (heads + kv_heads) * config.head_dim * norm
        kernels += 2 * norm_kernels
    if config.is_moe_layer(layer):
        ffn = -(-config.moe_ffn_hidden_size // tp)
        k = config.num_experts_per_token
        width = k * ffn + ffn * config.num_shared_experts
        sharded += 4 * k * h * act_bytes / tp  # permute before, un-permute after the experts
        kernels += 4
    else:
        width = -(-config.ffn_hidden_size // tp)
    per_element, activation_kernels = activation_traffic(config, act_bytes, eager)
    sharded += width * per_element
    return replicated / replicated_split + sharded, kernels + activation_kernels


@lru_cache(maxsize=8192)
def layer_times(config: ModelConfig, gpu: GPU, layer: int, micro_batch: int, seq_len: int,
                tp: int, cp: int, ep: int, sequence_parallel: bool, recompute: str, flash: bool,
                dropout: bool, compute_dtype: str, act_bytes: float, weight_bytes: float,
                group_tokens: int | None = None, expert_tp: int | None = None,
                portable_attention: bool = False, fp8_casts: str = "",
                recompute_ops: tuple[str, ...] = (), eager: bool = False,
                selective_op: bool = False) -> KernelTimes:
    """One block, one microbatch (see layer_gemms for the expert-parallel arguments;
    fp8_cast_time for `fp8_casts`; `recompute_ops`: memory.RECOMPUTE_OPS run again; `eager`:
    element-wise work as unfused model code runs it, tetrad.planner.unfused; `selective_op`:
    selective recomputation as torchtitan's op-level policy, tetrad.planner.op_checkpoint)."""
    tokens = micro_batch * seq_len // cp
    matmul = sum(gemm_time(gpu, g, compute_dtype, act_bytes, weight_bytes, fp8_casts)
                 for g in layer_gemms(config, layer, tokens, tp, ep, group_tokens, expert_tp))
    attention_forward, attention_backward = attention_times(
        config, gpu, micro_batch, seq_len, tp, cp, flash, dropout, act_bytes, portable_attention)
    per_token, num_kernels = _elementwise_bytes(config, layer, tp, sequence_parallel, dropout,
                                                act_bytes, eager)
    elementwise = bandwidth_time(gpu, per_token * tokens, num_kernels)
    forward = matmul + attention_forward + elementwise
    backward = 2 * matmul + attention_backward + 2 * elementwise
    if recompute in FORWARD_AGAIN:
        again = forward
    elif recompute == "selective" and selective_op and op_checkpoint.applies(config, layer):
        # Every second matmul and every element-wise op again; the attention's output is kept.
        again = elementwise + sum(gemm_time(gpu, g, compute_dtype, act_bytes, weight_bytes,
                                            fp8_casts)
                                  for g in op_checkpoint.recomputed_matmuls(config, tokens, tp))
    elif recompute == "selective":
        again = attention_forward
    else:
        again = 0.0
    if recompute not in FORWARD_AGAIN:
        again += _pointwise_again(config, layer, tp, sequence_parallel, act_bytes, gpu, tokens,
                                  recompute_ops)
    return KernelTimes(forward, backward, again, matmul, attention_forward)


def _pointwise_again(config: ModelConfig, layer: int, tp: int, sequence_parallel: bool,
                     act_bytes: float, gpu: GPU, tokens: int, ops: tuple[str, ...]) -> float:
    """Op-level selective recomputation's extra kernels: each norm reads its input and writes its
    output again, the activation reads the up projection's output(s) and writes its own."""
    moved, kernels = 0.0, 0
    if "norm" in ops:
        moved += 2 * 2 * config.hidden_size * act_bytes / (tp if sequence_parallel else 1)
        kernels += 2
    if "activation" in ops:
        if config.is_moe_layer(layer):
            width = -(-config.moe_ffn_hidden_size // tp) * (config.num_experts_per_token
                                                            + config.num_shared_experts)
        else:
            width = -(-config.ffn_hidden_size // tp)
        moved += (3 if config.mlp == "swiglu" else 2) * width * act_bytes
        kernels += 1
    return bandwidth_time(gpu, moved * tokens, kernels) if kernels else 0.0


@lru_cache(maxsize=1024)
def head_times(config: ModelConfig, gpu: GPU, micro_batch: int, seq_len: int, tp: int, cp: int,
               compute_dtype: str, act_bytes: float, weight_bytes: float,
               eager: bool = False) -> KernelTimes:
    """The final norm, LM head and cross-entropy (fp32 logits, read and written both ways)."""
    tokens = micro_batch * seq_len // cp
    matmul = gemm_time(gpu, head_gemm(config, tokens, tp), compute_dtype, act_bytes, weight_bytes)
    logits = tokens * -(-config.vocab_size // tp)
    loss = bandwidth_time(gpu, logits * (act_bytes + 4 + 4), 2)
    per_element, norm_kernels = norm_traffic(config, act_bytes, eager)
    norm = bandwidth_time(gpu, tokens * config.hidden_size * per_element, norm_kernels)
    forward = matmul + loss + norm
    return KernelTimes(forward, 2 * matmul + loss + 2 * norm, 0.0, matmul, 0.0)


def stage_times(config: ModelConfig, gpu: GPU, num_stages: int, stage: int, micro_batch: int,
                seq_len: int, tp: int, cp: int, ep: int, sequence_parallel: bool, recompute: str,
                flash: bool, dropout: bool, compute_dtype: str, act_bytes: float,
                weight_bytes: float, expert_tp: int | None = None,
                portable_attention: bool = False, fp8_casts: str = "inputs",
                recompute_ops: tuple[str, ...] = (), eager: bool = False,
                selective_op: bool = False) -> KernelTimes:
    """Kernel time of one microbatch through one pipeline stage (its blocks, plus the LM head on
    the last stage). Dense and MoE blocks are timed once each and multiplied. `expert_tp` below
    tp: experts whole over tensor ranks too, each rank routing its 1/tp of the tokens; `eager`:
    unfused element-wise model code (tetrad.planner.unfused); `selective_op`: see layer_times."""
    counts = stage_layer_counts(config.num_layers, num_stages)
    first = stage_first_layer(counts, stage)
    layers = range(first, first + counts[stage])
    num_moe = sum(1 for layer in layers if config.is_moe_layer(layer))
    fp8 = fp8_casts if compute_dtype == "fp8" else ""  # fp8 training quantizes GEMM operands
    total = ZERO
    args = (micro_batch, seq_len, tp, cp, ep, sequence_parallel, recompute, flash, dropout,
            compute_dtype, act_bytes, weight_bytes)
    if num_moe:
        moe_layer = next(layer for layer in layers if config.is_moe_layer(layer))
        expert_args = (None, None)
        if expert_tp is not None and expert_tp != tp:
            expert_args = (micro_batch * seq_len // cp // tp * ep, expert_tp)
        total = total + layer_times(config, gpu, moe_layer, *args, *expert_args,
                                    portable_attention, fp8, recompute_ops, eager,
                                    selective_op).scaled(num_moe)
    if len(layers) - num_moe:
        dense_layer = next(layer for layer in layers if not config.is_moe_layer(layer))
        total = total + layer_times(config, gpu, dense_layer, *args, None, None,
                                    portable_attention, fp8, recompute_ops, eager,
                                    selective_op).scaled(len(layers) - num_moe)
    if stage == num_stages - 1:
        total = total + head_times(config, gpu, micro_batch, seq_len, tp, cp, compute_dtype,
                                   act_bytes, weight_bytes, eager)
    return total


def optimizer_time(gpu: GPU, num_params: float, grad_bytes: float, param_bytes: float,
                   state_bytes: float, offload: bool, host_bandwidth: float,
                   shards_on_host: bool = False) -> float:
    """Adam over this GPU's shard: read the gradient, read and write master weights and moments,
    write the 16-bit parameter. With offload the update runs from CPU memory and the gradient and
    parameter cross PCIe, unless the shards live on the host (parameter offload: they cross it
    at each gather and reduction instead, tetrad.planner.offload_time)."""
    moved = num_params * (grad_bytes + 2 * state_bytes + param_bytes)
    streaming = gpu.efficiency.optimizer_memory or gpu.efficiency.memory
    if not offload:
        return moved / (gpu.memory_bandwidth * streaming) + gpu.efficiency.kernel_overhead_s
    if shards_on_host:  # at the rate the optimizer streams (on a CPU: its own memory's)
        return moved / (host_bandwidth * streaming)
    transfer = num_params * (grad_bytes + param_bytes) / gpu.pcie_bandwidth
    return moved / host_bandwidth + transfer
