"""Training stacks: what the training code overlaps and stores, which the layout does not say.

The same layout runs at different speeds under different software: Megatron-Core hides its
gradient reduction, parameter gathers and TP collectives behind compute, Megatron-LM of 2021 hid
none of them, FSDP prefetches whole blocks while DeepSpeed's ZeRO-3 gathers sub-modules up to a
live-parameter budget. `tetrad plan train --stack NAME` picks one of these presets (the same ones
the published-run comparison uses, benchmarks/published_runs.py), and single flags override any
field of it.
"""

from __future__ import annotations

from tetrad.errors import ConfigError
from tetrad.planner.memory import RECOMPUTE_OPS

# TrainWorkload fields per stack. Each is what that stack's published runs used.
STACKS: dict[str, dict] = {
    # Megatron-Core / NeMo (2024-): flash attention, distributed optimizer with overlapped
    # gradient reduce-scatter and parameter all-gather, TP communication overlap (userbuffers),
    # overlapped pipeline sends; context parallelism as Transformer Engine's load-balanced p2p ring
    # (compute.ring_attention_calls); Transformer Engine's FP8 linears save FP8 inputs
    # (planner.fp8_inputs). NVIDIA's DGX-Cloud recipes, Llama 3.
    "megatron": dict(flash_attention=True, dropout=False, overlap_grad_reduce=True,
                     overlap_param_gather=True, overlap_tp_comm=True, overlap_p2p=True,
                     fp8_saved_inputs=True),
    # Megatron-LM and Megatron-DeepSpeed of 2021-22 (GPT-3 and MT-NLG era): scores materialized,
    # dropout, gradients reduced after the backward, blocking pipeline sends.
    "megatron-2021": dict(flash_attention=False, dropout=True, overlap_grad_reduce=False,
                          overlap_param_gather=False, overlap_tp_comm=False, overlap_p2p=False),
    # DeepSpeed of the same era (MT-NLG, BLOOM, ZeRO-3 of 175B/530B): as Megatron-LM 2021, but
    # communication overlapped (overlap_comm, ZeRO-3's parameter prefetch); ZeRO-3 gathers
    # parameter by parameter (TrainWorkload.zero3_per_parameter), at most
    # stage3_max_live_parameters (1e9) whole at a time.
    "deepspeed": dict(flash_attention=False, dropout=True, overlap_grad_reduce=True,
                      overlap_param_gather=True, overlap_tp_comm=False, overlap_p2p=False,
                      zero3_live_params=1e9, zero3_per_parameter=True),
    # torchtitan (FSDP2): flash attention, reduce-scatter and next-block all-gather prefetched
    # behind compute, whole blocks gathered; no TP overlap (async TP is opt-in); context
    # parallelism as PyTorch's context_parallel ring, head-tail load-balanced like TE's; eager
    # model code, whose norms, rotary embedding and SwiGLU run op by op (planner.unfused)
    # unless compiled (torch.compile takes the blocks, not the loss, which stays eager:
    # planner.unfused.loss_bytes_per_logit); selective recomputation as its op-level policy
    # (planner.op_checkpoint).
    "torchtitan": dict(flash_attention=True, dropout=False, overlap_grad_reduce=True,
                       overlap_param_gather=True, overlap_tp_comm=False, overlap_p2p=True,
                       portable_attention=True, eager_elementwise=True, selective_op=True,
                       eager_loss=True, zero3_whole_stage_under_pp=True),
    # tetrad's own runtime: bucketed async DDP, FSDP-style prefetch, isend/irecv pipeline, its
    # own tensors counted (tetrad.planner.eager).
    "tetrad": dict(flash_attention=True, dropout=False, overlap_grad_reduce=True,
                   overlap_param_gather=True, overlap_tp_comm=False, overlap_p2p=True,
                   portable_attention=True, runtime="tetrad"),
}
DEFAULT_STACK = "torchtitan"  # TrainWorkload's own defaults


def stack_fields(name: str, **overrides) -> dict:
    """TrainWorkload fields of stack `name`, with the non-None `overrides` on top."""
    if name not in STACKS:
        raise ConfigError(f"unknown training stack {name!r} (known: {', '.join(STACKS)})")
    return {**STACKS[name], **{key: value for key, value in overrides.items()
                               if value is not None}}


def check_recompute_ops(ops: tuple[str, ...], runtime: str) -> None:
    unknown = [op for op in ops if op not in RECOMPUTE_OPS]
    if unknown:
        raise ConfigError(f"--recompute-ops: unknown op {unknown[0]!r} (known: "
                          f"{', '.join(RECOMPUTE_OPS)})")
    if ops and runtime == "tetrad":
        raise ConfigError("--recompute-ops: tetrad's eager runtime recomputes no single op: "
                          "add --compile (inductor rematerializes them) or pick another --stack")


def compile_fields(name: str) -> dict:
    """TrainWorkload fields torch.compile changes on stack `name`. Inductor fuses each block's
    element-wise chains into kernels between the matmuls, and its min-cut partitioner
    (torch._functorch.partitioners.min_cut_rematerialization_partition) recomputes their
    pointwise outputs in the backward rather than saving them: the norms' and the activation's
    (memory.RECOMPUTE_OPS), inside backward kernels that read their inputs anyway, so at no
    kernel of their own (TrainWorkload.compiled); the element-wise chains eager model code runs
    op by op become one kernel each (TrainWorkload.eager_elementwise off). On tetrad's runtime
    that replaces the eager operators the `tetrad` profile counts by fused kernels: the megatron
    profile's, whose H100 step time was within 0.5% of tetrad's compiled step (BENCHMARKS.md,
    "Training on one GPU", 2026-11-26)."""
    fields: dict = {"recompute_ops": ("activation", "norm"), "compiled": True,
                    "eager_elementwise": False}
    if STACKS[name].get("runtime") == "tetrad":
        fields["runtime"] = "megatron"
    return fields


# Serving software generations: what the engine does on the host each step that the GPU waits
# for. vLLM's blog of 2024-09-05 ("vLLM v0.6.0: 2.7x Throughput Improvement and 5x Latency
# Reduction", blog.vllm.ai/2024/09/05/perf-update.html) profiled v0.5.3 serving Llama 3 8B on one
# H100: the HTTP API server took 33% of the time and scheduling 29%, the GPU's work 38%; v0.6.0
# overlaps them (a separate API process, multi-step scheduling, asynchronous output processing).
# The host's share is a fixed cost per engine step, so it is charged in seconds: 62/38 of the
# planner's own decode step on that profiled configuration (SERVING_REFERENCE; the blog's
# ShareGPT requests, a few hundred tokens each way, at vLLM's 256 sequences). The blog's 70B on
# four H100s (1.8x from v0.5.3 to v0.6.0) is not used: docs/planner.md compares against it.
SERVING_STACKS = (
    "vllm",  # v0.6.0 (2024-09) and later, TensorRT-LLM: the host's work overlapped
    "vllm-0.5",  # v0.5.3 (2024-07) and before: the host's work in series with the GPU's
)
DEFAULT_SERVING_STACK = "vllm"
VLLM_053_HOST_SHARE = (0.33 + 0.29) / 0.38  # host seconds per GPU second, the blog's profile
SERVING_REFERENCE = dict(model="llama3-8b", gpu="h100-sxm", prompt_len=256, output_len=256,
                         batch=256)


def serving_host_step_s(name: str) -> float:
    """Seconds per engine step the serving stack `name` spends on the host with the GPU idle."""
    if name not in SERVING_STACKS:
        raise ConfigError(f"unknown serving stack {name!r} (known: {', '.join(SERVING_STACKS)})")
    if name == "vllm":
        return 0.0
    from tetrad.hardware.profile import cluster
    from tetrad.planner.serving import ServeLayout, ServeWorkload, evaluate_serving
    from tetrad.spec.presets import resolve_model

    ref = SERVING_REFERENCE
    workload = ServeWorkload(ref["prompt_len"] + ref["output_len"], ref["prompt_len"],
                             ref["output_len"], batch=ref["batch"])
    estimate = evaluate_serving(resolve_model(ref["model"]), cluster(ref["gpu"], 1, None, None),
                                ServeLayout(), workload)
    return VLLM_053_HOST_SHARE * estimate.tpot_s
