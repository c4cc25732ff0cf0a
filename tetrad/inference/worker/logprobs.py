"""Log-probabilities for the requests that ask for them (OpenAI's `logprobs`, `top_logprobs` and
`echo`): a log-softmax of the model's raw logits for just those rows, one host copy.

Generated tokens are scored on the step's sampling rows. Prompt tokens need the logits of every
prompt position: the runner returns all rows of a chunk for a sequence whose plan entry is
`PROMPT_LOGITS` (see `logits_layout`), and the row of position p scores prompt token p + 1.
"""

from __future__ import annotations

import torch

from tetrad.inference.core.output import TokenLogprob
from tetrad.inference.worker.runner import PROMPT_LOGITS, StepPlan


def score(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """logits [rows, vocab]; the token to score in each row and how many of the most likely
    tokens to list with it."""
    logprobs = logits.float().log_softmax(-1)
    targets = torch.tensor(token_ids, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    k = max(num_top, default=0)
    values, indices = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    values, indices = values.tolist(), indices.tolist()
    return [TokenLogprob(token, logprob, list(zip(indices[row][:n], values[row][:n])))
            for row, (token, logprob, n) in enumerate(zip(token_ids, chosen, num_top))]


def sampled_logprobs(logits: torch.Tensor, seqs, tokens: list[int]) -> list[list[TokenLogprob]]:
    """For each sampled row: [the sampled token's score] if its sequence asks for logprobs, []
    otherwise (those rows cost nothing)."""
    asking = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not asking:
        return [[] for _ in seqs]
    scored = dict(zip(asking, score(logits[asking], [tokens[row] for row in asking],
                                    [seqs[row].params.logprobs for row in asking])))
    return [[scored[row]] if row in scored else [] for row in range(len(seqs))]


def logits_layout(plan: StepPlan) -> list[tuple[int, int]]:
    """(first row, rows) of each planned sequence in the runner's logits: every token's row for
    PROMPT_LOGITS, the last token's for a sampling one, none otherwise."""
    layout, row = [], 0
    for num_new, samples in zip(plan.num_tokens, plan.samples):
        count = num_new if samples == PROMPT_LOGITS else samples
        layout.append((row, count))
        row += count
    return layout


def sample_rows(layout: list[tuple[int, int]], samples: list[bool]) -> list[int]:
    """The logits row of each sampling sequence, in batch order (the scheduler numbers them
    0, 1, ... as if each had one row)."""
    return [first + count - 1 for (first, count), sampled in zip(layout, samples) if sampled]


def prompt_logprobs(logits: torch.Tensor, plan: StepPlan, layout: list[tuple[int, int]], seqs
                    ) -> list[tuple[object, int, list[TokenLogprob]]]:
    """(sequence, first prompt position scored, log-probabilities) for every PROMPT_LOGITS entry
    of the plan: the row of position p scores prompt token p + 1 (the last prompt position's row
    is the sampling row, not a prompt score)."""
    rows, targets, num_top, spans = [], [], [], []
    for seq, start, samples, (first, count) in zip(seqs, plan.starts, plan.samples, layout):
        if samples != PROMPT_LOGITS:
            continue
        end = min(start + count, seq.num_prompt_tokens - 1)  # positions start..end-1
        if end <= start:
            continue
        rows += range(first, first + end - start)
        targets += seq.token_ids[start + 1:end + 1]
        num_top += [seq.params.prompt_logprobs] * (end - start)
        spans.append((seq, start + 1, end - start))
    if not rows:
        return []
    scored = score(logits[torch.tensor(rows, device=logits.device)], targets, num_top)
    out, offset = [], 0
    for seq, position, length in spans:
        out.append((seq, position, scored[offset:offset + length]))
        offset += length
    return out
