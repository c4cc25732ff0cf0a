"""Multi-head latent attention (DeepSeek-V2/V3), single-device.

Keys and values come from one low-rank latent per token (kv_lora_rank wide, after kv_down and
kv_norm), expanded per head by kv_up into a no-rope key part and a value. Position enters through
a decoupled rope key (qk_rope_head_dim wide) that kv_down also produces and that all heads share.
Queries go through their own low rank (q_down, q_norm, q_up) when q_lora_rank > 0.

Two equal ways to compute it:
- expanded (training, and any call without a KV cache): build every head's key and value from the
  latent and run causal attention;
- absorbed (the serving engine's paged cache): fold kv_up's key half into the query and its value
  half into the output, so attention runs over the latent itself. That is multi-query attention
  with one key of [latent | rope key] (kv_lora_rank + qk_rope_head_dim) and the latent as value:
  the cache stores exactly that per token and layer, never a per-head key or value.

Parameter names: attn.q (or attn.q_down, attn.q_norm, attn.q_up), attn.kv_down, attn.kv_norm,
attn.kv_up, attn.out. q_up's and kv_down's rope rows are in tetrad's half-split rope layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.spec.model import ModelConfig
from tetrad.models.layers import RMSNorm, apply_rotary
from tetrad.models.rope import mla_softmax_scale


def scaled_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Causal attention whose value width may differ from the query's."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_dim, self.v_dim = self.nope_dim + self.rope_dim, config.v_head_dim
        self.latent_dim = config.kv_lora_rank
        self.scale = mla_softmax_scale(config)
        hidden, heads, eps = config.hidden_size, config.num_heads, 1e-6  # DeepSeek's latent norms
        self.low_rank_q = config.q_lora_rank > 0
        if self.low_rank_q:
            self.q_down = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(config.q_lora_rank, eps)
            self.q_up = nn.Linear(config.q_lora_rank, heads * self.qk_dim, bias=False)
        else:
            self.q = nn.Linear(hidden, heads * self.qk_dim, bias=False)
        self.kv_down = nn.Linear(hidden, self.latent_dim + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.latent_dim, eps)
        self.kv_up = nn.Linear(self.latent_dim, heads * (self.nope_dim + self.v_dim), bias=False)
        self.out = nn.Linear(heads * self.v_dim, hidden, bias=False)
        # As Attention.core: causal attention over this call's tokens, swappable from outside
        # (selective recompute wraps it).
        self.core: Callable = partial(scaled_causal_attention, scale=self.scale)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                attend: Callable | None = None) -> torch.Tensor:
        """With `attend(q, k, v)` (the serving engine's attention over its paged cache) the
        absorbed form runs: k is the per-token cache entry [latent | rope key]."""
        batch, seq, _ = x.shape
        query = self.q_up(self.q_norm(self.q_down(x))) if self.low_rank_q else self.q(x)
        query = query.view(batch, seq, self.num_heads, self.qk_dim).transpose(1, 2)
        q_nope, q_rope = query.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_down(x).split([self.latent_dim, self.rope_dim], dim=-1)
        latent = self.kv_norm(latent).unsqueeze(1)  # [batch, 1, seq, latent]: one shared "head"
        k_rope = k_rope.unsqueeze(1)
        if rope is not None:
            q_rope, k_rope = apply_rotary(q_rope, *rope), apply_rotary(k_rope, *rope)
        if attend is None:
            y = self._expanded(q_nope, q_rope, latent, k_rope)
        else:
            y = self._absorbed(q_nope, q_rope, latent, k_rope, attend)
        return self.out(y.transpose(1, 2).reshape(batch, seq, self.num_heads * self.v_dim))

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_up split per head: key part [heads, nope, latent], value part [heads, v, latent]."""
        weight = self.kv_up.weight.view(self.num_heads, self.nope_dim + self.v_dim,
                                        self.latent_dim)
        return weight[:, :self.nope_dim], weight[:, self.nope_dim:]

    def _expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                  k_rope: torch.Tensor) -> torch.Tensor:
        batch, _, seq, _ = latent.shape
        kv = self.kv_up(latent[:, 0]).view(batch, seq, self.num_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.num_heads, -1, -1)), dim=-1)
        return self.core(q, k, v)

    def _absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                  k_rope: torch.Tensor, attend: Callable) -> torch.Tensor:
        key_up, value_up = self._up_weights()
        # q_nope . (key_up @ latent) = (q_nope @ key_up) . latent: the query moves to latent space.
        q_latent = torch.einsum("bhsn,hnc->bhsc", q_nope, key_up)
        q = torch.cat((q_latent, q_rope), dim=-1)
        # The paged attention kernels scale scores by 1/sqrt(their query width); MLA's own scale
        # (head dim nope + rope, YaRN's mscale) goes into the query instead.
        q = q * (self.scale * math.sqrt(q.shape[-1]))
        k = torch.cat((latent, k_rope), dim=-1)  # [batch, 1, seq, latent + rope]: the cache entry
        y_latent = attend(q, k, latent)  # [batch, heads, seq, latent]
        return torch.einsum("bhsc,hvc->bhsv", y_latent, value_up)
