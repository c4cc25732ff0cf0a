"""The tokenizer a GGUF file stores (its tokenizer.ggml.* metadata) as an HF `tokenizers`
Tokenizer, saved as the tokenizer.json serving reads (torch-free).

Two kinds, as llama.cpp names them in tokenizer.ggml.model:
- "gpt2": byte-level BPE with the file's merges, text split by the regex its tokenizer.ggml.pre
  names (GPT-2's, Llama 3's, Qwen2's);
- "llama": SentencePiece-style BPE: a space is '▁' and one is put in front of the text, bytes
  without a token fall back to <0xNN> tokens, and the merges are the file's, or, when it has none
  (as SentencePiece models), recovered from the token scores the way transformers' converter
  does: every split of a token into two tokens, best score first.
Control tokens (<s>, <|im_end|>) match whole as special tokens, user-defined ones as added tokens;
BOS is put in front when tokenizer.ggml.add_bos_token says so (by default for "llama").
"""

from __future__ import annotations

from typing import Any

from tetrad.errors import ConfigError

# llama.cpp's token types
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex that splits text before merging (None: GPT-2's own)
PRE_SPLITS: dict[str, str | None] = {"default": None, "gpt-2": None, "gpt2": None,
                                     "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT,
                                     "llama-v3": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT,
                                     "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT}


def gguf_tokenizer(values: dict[str, Any], source: str):
    """A tokenizers.Tokenizer from the file's tokenizer.ggml.* values (keys without the prefix)."""
    from tokenizers import Tokenizer, models

    kind, tokens = values.get("model"), values.get("tokens")
    if not tokens:
        raise ConfigError(f"{source} stores no tokenizer (tokenizer.ggml.tokens): pass "
                          f"--tokenizer")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        # A repeated token (llama.cpp pads some vocabularies with copies) has its first id.
        vocab = {}
        for index, token in enumerate(tokens):
            vocab.setdefault(token, index)
    merges = [tuple(merge.split(" ", 1)) for merge in values.get("merges") or ()]
    if kind == "gpt2":
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        _byte_level(tokenizer, values.get("pre") or "default", source)
        add_bos = values.get("add_bos_token", False)
    elif kind == "llama":
        unknown = values.get("unknown_token_id")
        scores = values.get("scores")
        if not merges and scores is None:
            raise ConfigError(f"{source}: a 'llama' tokenizer needs its merges or token scores")
        tokenizer = Tokenizer(models.BPE(
            vocab=vocab, merges=merges or merges_from_scores(tokens, scores), fuse_unk=True,
            byte_fallback=True, unk_token=tokens[unknown] if unknown is not None else None))
        _sentencepiece(tokenizer, values.get("add_space_prefix", True))
        add_bos = values.get("add_bos_token", True)
    else:
        raise ConfigError(f"{source}: GGUF tokenizer {kind!r} is not supported (tetrad reads "
                          f"'gpt2' and 'llama' tokenizers): pass --tokenizer")
    _added_tokens(tokenizer, tokens, values.get("token_type") or ())
    bos = values.get("bos_token_id")
    if add_bos and bos is not None:
        from tokenizers import processors

        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)])
    return tokenizer


def _byte_level(tokenizer, pre: str, source: str) -> None:
    from tokenizers import Regex, decoders, pre_tokenizers

    if pre not in PRE_SPLITS:
        raise ConfigError(f"{source}: GGUF pre-tokenizer {pre!r} is not one tetrad knows "
                          f"({', '.join(PRE_SPLITS)}): pass --tokenizer")
    split = PRE_SPLITS[pre]
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()


def _sentencepiece(tokenizer, add_space_prefix: bool) -> None:
    from tokenizers import decoders, pre_tokenizers

    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)


def _added_tokens(tokenizer, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                  for token, kind in zip(tokens, types)
                                  if kind in (UNKNOWN, CONTROL)])
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False)
                          for token, kind in zip(tokens, types) if kind == USER_DEFINED])


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece merges a BPE reproduces: each way to cut a token into two tokens, ordered by
    the whole token's score, best first (ties: shorter left piece first, as transformers)."""
    ids = {token: index for index, token in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))
                 if token[:cut] in ids and token[cut:] in ids]
        pairs.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        found += [(left, right, score) for left, right in pairs]
    found.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in found]
