"""The tokenizer a GGUF file stores encodes as the tokenizer it was written from, and as
transformers' own GGUF conversion: llama.cpp's "gpt2" byte-level BPE (with merges) and its "llama"
SentencePiece-style BPE (scores, byte fallback, BOS)."""

import pytest

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_files import (byte_level_values, hf_llama, sentencepiece_values,  # noqa: E402
                        train_sentencepiece_bpe, write_gguf)
from tetrad.store.gguf import unpack_gguf  # noqa: E402
from tetrad.store.gguf_tokenizer import merges_from_scores  # noqa: E402
from tetrad.tokenizer import BPETokenizer, load_tokenizer  # noqa: E402

SAMPLES = ["To be, or not to be: that is the question.", "  two leading spaces",
           "tabs\tand\nnew lines\n\n", "numbers 1234567 and 3.14", "ünïcödé 日本語 emoji 🎉",
           "'s 't 're CAPS and MiXeD", ""]


@pytest.fixture(scope="module")
def texts(corpus_file):
    text = open(corpus_file).read()
    return [text[i:i + 2000] for i in range(0, len(text), 2000)]


def gguf_tokenizer_folder(tmp_path, values):
    file = write_gguf(tmp_path / "model.gguf", hf_llama(len(values["tokens"])), "F32", values)
    folder = tmp_path / "model"
    folder.mkdir()
    unpack_gguf(file, folder)
    return file, folder


def transformers_conversion(file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)


def test_byte_level_bpe_encodes_as_its_source(texts, tmp_path):
    source = BPETokenizer.train(texts, 400)
    file, folder = gguf_tokenizer_folder(tmp_path, byte_level_values(source.tokenizer))
    loaded = load_tokenizer(folder)
    theirs = transformers_conversion(file)
    samples = SAMPLES + texts[:5] + ["before <|endoftext|> after"]
    for text in samples:
        ids = source.encode(text)
        assert loaded.encode(text) == ids, text
        assert theirs(text)["input_ids"] == ids, text
        assert loaded.decode(ids) == text
    assert loaded.eos_id == source.eos_id is not None


def test_sentencepiece_bpe_encodes_as_its_source_with_bos(texts, tmp_path):
    source = train_sentencepiece_bpe(texts, 600)
    values = sentencepiece_values(source)
    file, folder = gguf_tokenizer_folder(tmp_path, values)
    loaded = load_tokenizer(folder)
    theirs = transformers_conversion(file)
    bos = values["bos_id"]
    for text in SAMPLES + texts[:5]:
        ids = source.encode(text).ids
        assert loaded.encode(text) == [bos] + ids, text
        assert theirs(text)["input_ids"] == [bos] + ids, text
        # a space in front of the text is the prefix, dropped when decoding ("  a" -> " a")
        assert loaded.decode(ids) == theirs.decode(ids) == text.replace(" ", "", text[:1] == " ")
    # text the vocabulary has no token for falls back to its bytes, <0xNN>
    assert all(loaded.tokenizer.id_to_token(i).startswith("<0x")
               for i in loaded.encode("日")[2:])
    assert loaded.eos_id == values["eos_id"]


def test_merges_from_scores_are_transformers(texts):
    from transformers.tokenization_utils_base import generate_merges

    source = train_sentencepiece_bpe(texts, 500)
    values = sentencepiece_values(source)
    tokens, scores = values["tokens"], values["scores"]
    vocab = {token: index for index, token in enumerate(tokens)}
    assert merges_from_scores(tokens, scores) == generate_merges(vocab, dict(zip(tokens, scores)))
