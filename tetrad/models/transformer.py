"""The decoder-only transformer, assembled from a ModelConfig. Read it top to bottom.

Parameter names (the checkpoint format and the HF mapping rely on them):
  embed.weight, pos_embed.weight (learned positions only),
  layers.{i}.attn_norm.*, layers.{i}.attn.qkv.*, layers.{i}.attn.out.*,
  (MLA instead of qkv: layers.{i}.attn.q_down/q_norm/q_up or attn.q, attn.kv_down/kv_norm/kv_up)
  layers.{i}.mlp_norm.*, layers.{i}.mlp.up.*, layers.{i}.mlp.down.*   (dense layers)
  layers.{i}.mlp.router.gate.weight, layers.{i}.mlp.experts.{e}.up/down.*, layers.{i}.mlp.shared.*
  (sigmoid routing adds layers.{i}.mlp.router.bias, its balancing bias)
  norm.*, lm_head.weight (absent when tied: the embedding is reused).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from tetrad.spec.model import ModelConfig
from tetrad.errors import ConfigError
from tetrad.models.layers import MLP, Attention, init_weights, make_norm
from tetrad.models.mla import MultiHeadLatentAttention
from tetrad.models.moe import MoE
from tetrad.models.rope import make_rotary


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = (MultiHeadLatentAttention(config) if config.attention == "mla"
                     else Attention(config))
        self.mlp_norm = make_norm(config)
        self.mlp = MoE(config) if config.is_moe_layer(layer) else MLP(config)
        self.is_moe = config.is_moe_layer(layer)
        self.aux_loss: torch.Tensor | None = None  # the router's load-balance loss, last forward

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                attend: Callable | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, attend)
        if self.is_moe:
            out, self.aux_loss = self.mlp(self.mlp_norm(x))
            return x + out
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Embedding):
    """The token embedding; with tied embeddings also the output head (`unembed`), so that a
    layout swapping in its own embedding (tensor parallelism's vocabulary split) brings its own
    head with it."""

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., hidden] -> logits [..., vocab], by the embedding matrix."""
        return x @ self.weight.t()


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config.vocab_size, config.hidden_size)
        self.pos_embed = (nn.Embedding(config.max_seq_len, config.hidden_size)
                          if config.position == "learned" else None)
        self.rotary = make_rotary(config)
        self.layers = nn.ModuleList(Block(config, layer) for layer in range(config.num_layers))
        self.norm = make_norm(config)
        self.lm_head = (None if config.tie_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        init_weights(self, config.init_std, config.num_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: Any = None) -> torch.Tensor:
        """input_ids: [batch, seq] -> logits [batch, seq, vocab]. With `cache` (the serving
        engine's paged KV cache; the batch is then one row of many sequences' tokens), attention
        is cache.attend(layer, q, k, v) and logits come only for the cache.logits_indices tokens."""
        seq = input_ids.shape[-1]
        if cache is None and seq > self.config.max_seq_len:
            raise ConfigError(f"sequence of {seq} tokens is longer than max_seq_len "
                              f"{self.config.max_seq_len}")
        if positions is None:
            positions = torch.arange(seq, device=input_ids.device)
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        rope = self.rotary(positions) if self.rotary is not None else None
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, None if cache is None else partial(cache.attend, index))
        if cache is not None:
            x = x[:, cache.logits_indices]  # only where a token is sampled: saves the vocab matmul
        return self.output(self.norm(x))

    def output(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.embed.unembed(x)
        return self.lm_head(x)

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the MoE layers' load-balance losses from the last forward, or None (dense)."""
        losses = [layer.aux_loss for layer in self.layers if layer.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
