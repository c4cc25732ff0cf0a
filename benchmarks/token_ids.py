"""The benchmarks' tokenizer: they send token ids and never need text. A module of its own so
that a measuring process imports nothing else for it (gpu_serving.py brings transformers)."""

from __future__ import annotations


class Tokens:
    """Token ids in, token ids out: the benchmark never needs text."""

    eos_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError("the benchmark sends token ids")

    def decode(self, ids) -> str:
        return ""
