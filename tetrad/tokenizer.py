"""Tokenizers behind one small interface: `encode`, `decode`, `vocab_size`, `eos_id`, `save`.

- ByteTokenizer: ids are the UTF-8 bytes (vocab 256), no special tokens, so no eos. It saves
  nothing: a folder without tokenizer.json means "byte", which keeps byte-level checkpoints free of
  marker files.
- BPETokenizer: an HF `tokenizers` Tokenizer, byte-level BPE when trained here (any text encodes,
  no unknown tokens), plus `<|endoftext|>` as the end-of-text token. Saved as tokenizer.json (+ a
  tokenizer_config.json, so transformers' AutoTokenizer loads an exported folder too).

No torch here: the data loader and the planner-side CLI use these.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tetrad.errors import ConfigError
from tetrad.spec.hf import resolve_checkpoint

EOS_TOKEN = "<|endoftext|>"


class ByteTokenizer:
    vocab_size = 256
    eos_id = None
    longest_token_bytes = 1  # the most bytes of text one token stands for

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the byte tokenizer's 0..255: the "
                              f"model and tokenizer do not match (pass --tokenizer)")
        # A model can emit a byte sequence that is not valid UTF-8 (a cut multi-byte character).
        return bytes(ids).decode("utf-8", errors="replace")

    def save(self, folder: str | Path) -> None:
        """Nothing to write: load_tokenizer reads a folder without tokenizer.json as byte-level."""


class BPETokenizer:
    def __init__(self, tokenizer: Tokenizer, eos_token: str | None = EOS_TOKEN):
        self.tokenizer = tokenizer
        self.eos_token = eos_token if eos_token and tokenizer.token_to_id(eos_token) is not None \
            else None
        self.eos_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        # 256 byte symbols + the end-of-text token come before any merge.
        if vocab_size < 257:
            raise ConfigError(f"--vocab-size {vocab_size} is too small for byte-level BPE: use "
                              f"at least 257 (256 bytes + {EOS_TOKEN}), or the byte tokenizer")
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(tokenizer)

    @classmethod
    def load(cls, file: str | Path) -> "BPETokenizer":
        file = Path(file)
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as error:  # tokenizers raises a bare Exception on a malformed file
            raise ConfigError(f"{file} is not a valid tokenizer.json: {error}") from None
        return cls(tokenizer, _configured_eos(file.parent) or EOS_TOKEN)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def longest_token_bytes(self) -> int | None:
        """The most bytes of text one token stands for, bounded by the UTF-8 length of the
        longest vocabulary entry as stored: byte-level BPE stores each byte as one character of
        1-2 bytes ('Ġ' for a space), SentencePiece-style BPE a space as '▁' (3 bytes) and a
        fallback byte as '<0x0A>'. None where no such bound holds: a model that maps any unknown
        text to one token (an unk token without byte fallback; WordPiece, Unigram)."""
        model = self.tokenizer.model
        if type(model).__name__ != "BPE" or (model.unk_token is not None
                                             and not model.byte_fallback):
            return None
        return max(len(entry.encode("utf-8"))
                   for entry in self.tokenizer.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        # A loaded HF tokenizer may add BOS through its post-processor, as transformers does.
        # encode_batch releases the GIL while it works (encode holds it: seconds for a long
        # text, during which the server's event loop cannot run).
        return self.tokenizer.encode_batch([text])[0].ids

    def decode(self, ids: Iterable[int]) -> str:
        # Special tokens are kept, so decode(encode(text)) == text even when text contains one.
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def save_json(self, file: str | Path) -> None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(file))

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.save_json(folder / "tokenizer.json")
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if self.eos_token:
            config["eos_token"] = self.eos_token
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _configured_eos(folder: Path) -> str | None:
    """The eos token an HF tokenizer_config.json names, if there is one next to tokenizer.json."""
    file = folder / "tokenizer_config.json"
    if not file.is_file():
        return None
    eos = json.loads(file.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def load_tokenizer(spec: str | Path) -> ByteTokenizer | BPETokenizer:
    """"byte", a tokenizer.json file, or a folder (a checkpoint root leads to its latest step):
    BPE when the folder holds tokenizer.json, byte-level otherwise."""
    if str(spec) == "byte":
        return ByteTokenizer()
    path = resolve_checkpoint(spec)
    if path.is_file():
        return BPETokenizer.load(path)
    if path.is_dir():
        file = path / "tokenizer.json"
        return BPETokenizer.load(file) if file.is_file() else ByteTokenizer()
    raise ConfigError(f"tokenizer {spec} does not exist: pass 'byte', a tokenizer.json file, or "
                      f"a folder that contains one")
