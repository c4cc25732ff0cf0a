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

# TrainWorkload fields per stack. Each is what that stack's published runs used.
STACKS: dict[str, dict] = {
    # Megatron-Core / NeMo (2024-): flash attention, distributed optimizer with overlapped
    # gradient reduce-scatter and parameter all-gather, TP communication overlap (userbuffers),
    # overlapped pipeline sends. NVIDIA's DGX-Cloud recipes, Llama 3.
    "megatron": dict(flash_attention=True, dropout=False, overlap_grad_reduce=True,
                     overlap_param_gather=True, overlap_tp_comm=True, overlap_p2p=True),
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
    # behind compute, whole blocks gathered; no TP overlap (async TP is opt-in).
    "torchtitan": dict(flash_attention=True, dropout=False, overlap_grad_reduce=True,
                       overlap_param_gather=True, overlap_tp_comm=False, overlap_p2p=True,
                       portable_attention=True),
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
