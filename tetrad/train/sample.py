"""A few lines of text from a trained model, to see what it learned at the end of a run."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def sample_text(model: nn.Module, tokenizer, prompt: str, num_tokens: int, max_seq_len: int,
                temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> str:
    """Temperature + top-k sampling with the full context recomputed each token: slow but
    obviously right; the serving engine is the fast path. Only ids the tokenizer can decode are
    drawn: a model's vocabulary may be larger than its tokenizer's (rounded up, say), and a run
    must not fail at its closing sample over ids it was never trained to produce."""
    if num_tokens == 0:
        return ""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = tokenizer.encode(prompt) or [0]
    context = torch.tensor([ids], device=device)
    was_training = model.training
    model.eval()
    for _ in range(num_tokens):
        logits = model(context[:, -max_seq_len:])[0, -1, :tokenizer.vocab_size].float()
        logits /= temperature
        kth_largest = logits.topk(min(top_k, logits.numel())).values[-1]
        logits[logits < kth_largest] = float("-inf")
        next_id = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        if tokenizer.eos_id is not None and int(next_id) == tokenizer.eos_id:
            break
        context = torch.cat([context, next_id.view(1, 1)], dim=1)
    model.train(was_training)
    return tokenizer.decode(context[0].tolist())
