"""Rotary embedding as the config says: plain rope, or YaRN (Peng et al. 2023) as DeepSeek-V3 uses
it, following transformers' `_compute_yarn_parameters` so that HF checkpoints load exactly.

YaRN keeps the high frequencies (those that turn many times within the pretraining length
rope_original_max_seq_len) as they are, divides the low ones by rope_factor, and ramps linearly
between the two in the dimensions whose rotation counts lie between beta_slow and beta_fast. It
scales cos and sin by an attention factor, and MLA multiplies the softmax scale by
mscale(factor, mscale_all_dim)^2 (DeepSeek's `yarn_get_mscale`).
"""

from __future__ import annotations

import math

import torch

from tetrad.spec.model import ModelConfig
from tetrad.models.layers import RotaryEmbedding


def rotary_dim(config: ModelConfig) -> int:
    """Dimensions per head that rope rotates: MLA rotates only its decoupled rope part."""
    return config.qk_rope_head_dim if config.attention == "mla" else config.head_dim


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, theta: float, length: int) -> float:
    """The dimension whose frequency turns `rotations` times over `length` positions."""
    return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], attention factor) of YaRN."""
    dim, theta, factor = rotary_dim(config), config.rope_theta, config.rope_factor
    length = config.rope_original_max_seq_len
    low = max(math.floor(_correction_dim(config.yarn_beta_fast, dim, theta, length)), 0)
    high = min(math.ceil(_correction_dim(config.yarn_beta_slow, dim, theta, length)), dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / base, 1.0 / (factor * base)
    inv_freq = interpolated * ramp + extrapolated * (1 - ramp)
    if config.yarn_mscale and config.yarn_mscale_all_dim:
        attention_factor = (yarn_mscale(factor, config.yarn_mscale)
                            / yarn_mscale(factor, config.yarn_mscale_all_dim))
    else:
        attention_factor = yarn_mscale(factor)
    return inv_freq, attention_factor


def make_rotary(config: ModelConfig) -> RotaryEmbedding | None:
    if config.position != "rope":
        return None
    if config.rope_scaling == "yarn":
        inv_freq, attention_factor = yarn_frequencies(config)
        return RotaryEmbedding(rotary_dim(config), config.rope_theta, inv_freq, attention_factor)
    return RotaryEmbedding(rotary_dim(config), config.rope_theta)


def mla_softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale_all_dim correction squared (DeepSeek-V3)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if config.rope_scaling == "yarn" and config.yarn_mscale_all_dim:
        scale *= yarn_mscale(config.rope_factor, config.yarn_mscale_all_dim) ** 2
    return scale
