"""Embeddings for /api/embed: the model's final hidden state (after its last norm, before the
output head), mean-pooled over the input's tokens and L2-normalized. tetrad's models are decoders
trained to predict text, not embedding models: these vectors are what the decoder computes,
useful for similarity between texts a model knows, not tuned for retrieval."""

from __future__ import annotations

import torch

from tetrad.errors import TetradError


class _Captured(Exception):
    """Raised from the final norm's hook: the hidden state is all that is needed, and stopping
    there skips the output head's [tokens, vocab] matmul."""


def embed_texts(llm, prompts: list[list[int]], dimensions: int | None) -> list[list[float]]:
    """One unit vector per prompt (token ids); runs on the engine's thread, between two steps,
    on the model the engine holds (one rank's whole model: a split one holds a part)."""
    if llm.config.world_size > 1:
        raise TetradError("embeddings need the whole model on one rank: this engine is split "
                          f"over {llm.config.world_size} ranks ({llm.config.describe()})")
    model = llm.model
    hidden = model.config.hidden_size
    if dimensions is not None and not 1 <= dimensions <= hidden:
        raise TetradError(f"dimensions must be in 1..{hidden} (the model's hidden size), got "
                          f"{dimensions}")
    device = next(model.parameters()).device
    vectors = []
    for ids in prompts:
        states = []

        def keep(_module, _inputs, output):
            states.append(output)
            raise _Captured

        hook = model.norm.register_forward_hook(keep)
        try:
            with torch.inference_mode():
                model(torch.tensor([ids], device=device))
        except _Captured:
            pass
        finally:
            hook.remove()
        pooled = states[0][0].float().mean(0)[:dimensions]
        vectors.append(torch.nn.functional.normalize(pooled, dim=0).tolist())
    return vectors
