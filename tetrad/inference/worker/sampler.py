"""Next-token sampling for a whole batch at once, on the device: the logits processors in HF's
order (repetition penalty, temperature, top-k, top-p), then one draw per row.

Every processor is a batched tensor operation over [rows, vocab] with per-row parameters (one
host-to-device copy of a [5, rows] table per step); nothing here reads a device value back, so the
caller's `.tolist()` of the sampled ids is the step's only device-to-host copy.

Draws use the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is a draw from p, one kernel
with no cumulative sums. Rows whose request brings a seed draw their noise from the sequence's own
torch.Generator (seeded from the request's seed and sample index), so that a seeded request's
output depends only on its seed, never on which other requests share the batch, and a sequence
preempted by recompute continues its stream where it left off. All other rows share one draw from
the engine's generator (seeded from the engine's seed): reproducible for the same workload.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

# Mixes the sample index into the seed, so the n samples of one request draw different streams.
_INDEX_STRIDE = 0x9E3779B97F4A7C15


@dataclass
class SamplerOutput:
    """Device tensors: token_ids [rows]; with logprobs asked for, the model's log-probability of
    each chosen token [rows] and the top-N tokens and their log-probabilities [rows, N] (the raw
    model distribution, before penalty and temperature, as vLLM reports them)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
                             ) -> torch.Tensor:
    """HF's rule (CTRL paper): seen tokens' logits are divided by the penalty when positive,
    multiplied when negative. logits, seen (bool): [rows, vocab]; penalty: [rows]."""
    penalty = penalty[:, None]
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def warp(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
         top_p: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus): filtered tokens get -inf. logits [rows,
    vocab]; per row: temperature > 0, top_k (0 or >= vocab: off), top_p (1: off). `filtered`
    False (no row filters) skips the sort."""
    logits = logits / temperature[:, None]
    if not filtered:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))  # ties stay
    probs = sorted_logits.softmax(-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
    # (top_p 1 is off: a float cumulative sum can reach 1 before the last token.)
    drop = (probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p < 1)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def upload(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without waiting for it: through pinned memory on a GPU."""
    if device.type == "cuda":
        values = values.pin_memory()
    return values.to(device, non_blocking=True)


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        # Seeds of sample streams: reproducible per engine seed.
        self._seeds = random.Random(seed)
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, seq, device: torch.device) -> torch.Generator:
        """A seeded request's own stream (created at its first draw, kept across preemption)."""
        if seq.generator is None:
            seq.generator = torch.Generator(device).manual_seed(
                (seq.params.seed + seq.index * _INDEX_STRIDE) % 2**63)
        return seq.generator

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(
                self._seeds.getrandbits(63))
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, seqs: list, num_logprobs: int | None = None
                 ) -> SamplerOutput:
        """logits: [len(seqs), vocab] -> one token id per sequence, on the device.
        num_logprobs: None for no log-probabilities; N >= 0 for the chosen token's and the
        top N's."""
        logits = logits.float()
        output = SamplerOutput(self._choose(logits, seqs))
        if num_logprobs is not None:
            logprobs = logits.log_softmax(-1)
            output.logprobs = logprobs.gather(1, output.token_ids[:, None])[:, 0]
            if num_logprobs:
                output.top_logprobs, output.top_ids = logprobs.topk(num_logprobs, dim=-1)
        return output

    def _choose(self, logits: torch.Tensor, seqs: list) -> torch.Tensor:
        device = logits.device
        params = [seq.params for seq in seqs]
        penalized = any(p.repetition_penalty != 1 for p in params)
        sampled = [row for row, p in enumerate(params) if not p.greedy]
        if not penalized and not sampled:
            return logits.argmax(dim=-1)
        # One upload of every row's parameters; greedy rows get temperature 1 (argmax unchanged).
        table = torch.tensor([[1.0 if p.greedy else p.temperature for p in params],
                              [float(p.top_k) for p in params], [p.top_p for p in params],
                              [p.repetition_penalty for p in params],
                              [float(p.greedy) for p in params]])
        temperature, top_k, top_p, penalty, greedy = upload(table, device)
        if penalized:
            seen = torch.zeros_like(logits, dtype=torch.bool)
            vocab = logits.shape[-1]  # ids past it (not sampleable) have no logit to penalize
            pairs = [(row, token) for row, (seq, p) in enumerate(zip(seqs, params))
                     if p.repetition_penalty != 1 for token in seq.token_ids if token < vocab]
            if pairs:
                index = upload(torch.tensor(pairs, dtype=torch.long), device)
                seen[index[:, 0], index[:, 1]] = True
            logits = apply_repetition_penalty(logits, seen, penalty)
        if not sampled:
            return logits.argmax(dim=-1)
        filtered = any(0 < p.top_k < logits.shape[-1] or p.top_p < 1 for p in params)
        probs = warp(logits, temperature, top_k, top_p, filtered).softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=self._shared_generator(device))
        for row in sampled:
            if params[row].seed is not None:
                noise[row].exponential_(generator=self.generator(seqs[row], device))
        drawn = (probs / noise).argmax(dim=-1)
        return torch.where(greedy.bool(), logits.argmax(dim=-1), drawn)
