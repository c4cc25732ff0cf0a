"""Next-token sampling: the logits processors in HF's order (repetition penalty, temperature,
top-k, top-p), then a draw from the sequence's own random stream.

Each sequence owns a torch.Generator seeded from its request's seed and its sample index, so a
request's output depends only on its seed, never on which other requests share the batch, and a
sequence preempted by recompute continues its stream where it left off.
"""

from __future__ import annotations

import random

import torch

from tetrad.inference.params import SamplingParams

# Mixes the sample index into the seed, so the n samples of one request draw different streams.
_INDEX_STRIDE = 0x9E3779B97F4A7C15


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float
                             ) -> torch.Tensor:
    """HF's rule (CTRL paper): seen tokens' logits are divided by the penalty when positive,
    multiplied when negative. logits: [vocab]."""
    seen = torch.tensor(sorted(set(token_ids)), device=logits.device, dtype=torch.long)
    scores = logits[seen]
    return logits.index_put((seen,), torch.where(scores < 0, scores * penalty, scores / penalty))


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus): filtered tokens get -inf. logits: [vocab]."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0):
        # Seeds for requests that bring none: reproducible per engine seed, different per request.
        self._seeds = random.Random(seed)

    def generator(self, seq, device: torch.device) -> torch.Generator:
        if seq.generator is None:
            seed = seq.params.seed if seq.params.seed is not None else self._seeds.getrandbits(63)
            seq.generator = torch.Generator(device).manual_seed(
                (seed + seq.index * _INDEX_STRIDE) % 2**63)
        return seq.generator

    def __call__(self, logits: torch.Tensor, seqs: list) -> list[int]:
        """logits: [len(seqs), vocab] -> one token id per sequence."""
        logits = logits.float()
        picks = logits.argmax(dim=-1)  # [rows]: right for the greedy rows with no penalty
        for row, seq in enumerate(seqs):
            params = seq.params
            if params.greedy and params.repetition_penalty == 1:
                continue
            scores = logits[row]
            if params.repetition_penalty != 1:
                scores = apply_repetition_penalty(scores, seq.token_ids, params.repetition_penalty)
            if params.greedy:
                picks[row] = scores.argmax()
                continue
            probs = warp(scores, params).softmax(-1)
            # argmax(p / E) with E ~ Exp(1) i.i.d. is a draw from p (the exponential race): one
            # kernel, no cumulative sums, and the same stream position however many tokens
            # were filtered.
            generator = self.generator(seq, probs.device)
            noise = torch.empty_like(probs).exponential_(generator=generator)
            picks[row] = (probs / noise).argmax()
        return picks.tolist()
