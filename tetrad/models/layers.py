"""Building blocks of the decoder: norms, rotary embeddings, attention, MLPs. Single-device only.

Projections are fused (one QKV matmul, one gate+up matmul for SwiGLU) because a few large matmuls
beat many small ones; the tensor-parallel code splits them by section when it shards them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.spec.model import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 whatever the compute dtype: the mean of squares overflows in fp16.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.hidden_size, config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.bias)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the half-split layout (the HF convention): the first and
    second halves of each head's dimensions form the rotated pairs."""

    def __init__(self, head_dim: int, theta: float, inv_freq: torch.Tensor | None = None,
                 attention_factor: float = 1.0):
        """`inv_freq` and `attention_factor` (which scales cos and sin) come from rope scaling
        (tetrad.models.rope); plain rope derives the frequencies from theta."""
        super().__init__()
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32)
                                        / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attention_factor

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [seq] or [batch, seq] -> cos, sin: [..., seq, head_dim]
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [batch, heads, seq, head_dim]; cos/sin broadcast over heads.
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [batch, heads, seq, head_dim]; k, v: [batch, kv_heads, seq, head_dim]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                             bias=config.qkv_bias or config.bias)
        self.out = nn.Linear(self.q_size, config.hidden_size, bias=config.bias)
        # softmax(QK^T)V over this call's tokens. Parallel runtimes swap it from outside: ring
        # attention (tetrad.parallel.context_parallel), a recomputed core (parallel.recompute).
        self.core: Callable = causal_attention

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                attend: Callable | None = None) -> torch.Tensor:
        """`attend(q, k, v)` replaces causal attention over this call's tokens: the serving engine
        passes attention over its paged KV cache."""
        qkv = self.qkv(x)
        # The shape comes from the projection, not from x: under sequence parallelism x is this
        # rank's sequence shard and the projection gathers the whole sequence.
        batch, seq, _ = qkv.shape
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        y = (attend or self.core)(q, k, v)  # [batch, heads, seq, head_dim]
        return self.out(y.transpose(1, 2).reshape(batch, seq, self.q_size))


class MLP(nn.Module):
    """SwiGLU (gate and up fused in one matmul) or GELU (tanh approximation, as GPT-2)."""

    def __init__(self, config: ModelConfig, ffn_hidden_size: int | None = None):
        super().__init__()
        self.ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        self.gated = config.mlp == "swiglu"
        width = 2 * self.ffn_hidden_size if self.gated else self.ffn_hidden_size
        self.up = nn.Linear(config.hidden_size, width, bias=config.bias)
        self.down = nn.Linear(self.ffn_hidden_size, config.hidden_size, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.down(h)


def init_weights(module: nn.Module, std: float, num_layers: int) -> None:
    """GPT-2 style: normal(std) everywhere, residual output projections scaled by
    1/sqrt(2 * num_layers) so the residual stream's variance does not grow with depth."""
    residual_std = std / math.sqrt(2 * num_layers)
    for name, child in module.named_modules():
        if isinstance(child, nn.Linear):
            is_residual = name.endswith(".out") or name.endswith(".down")
            nn.init.normal_(child.weight, 0.0, residual_std if is_residual else std)
            if child.bias is not None:
                nn.init.zeros_(child.bias)
        elif isinstance(child, nn.Embedding):
            nn.init.normal_(child.weight, 0.0, std)
