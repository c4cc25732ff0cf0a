"""Tokenizers and text sources: byte and BPE round trips, save/load, the `tokenizer train` CLI."""

import json

import pytest

from tetrad.cli.main import main
from tetrad.errors import ConfigError
from tetrad.text_sources import iter_texts
from tetrad.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog. " * 5,
          "Naïve café owners serve crème brûlée — 東京 ok! " * 5,
          "def add(a, b):\n    return a + b\n" * 5]
UNSEEN = "The lazy café dog returns — 大阪 🎉\n\tmixed   spaces"


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("héllo 世界")
    assert ids == list("héllo 世界".encode("utf-8"))
    assert tokenizer.decode(ids) == "héllo 世界"
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (256, None)
    assert tokenizer.decode([104, 0xE4, 0xB8]) == "h\ufffd"  # a cut character is replaced
    with pytest.raises(ConfigError, match="token id 300"):
        tokenizer.decode([300])


def test_bpe_train_round_trip_save_load(tmp_path):
    tokenizer = BPETokenizer.train(CORPUS, vocab_size=320)
    assert tokenizer.vocab_size == 320
    assert tokenizer.eos_id == tokenizer.tokenizer.token_to_id("<|endoftext|>")
    for text in CORPUS + [UNSEEN, ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    # Merges were learned: frequent text takes fewer tokens than bytes.
    assert len(tokenizer.encode(CORPUS[0])) < len(CORPUS[0].encode()) / 2
    # The eos token survives a round trip, so a document boundary decodes faithfully.
    text = "end<|endoftext|>start"
    assert tokenizer.eos_id in tokenizer.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text

    tokenizer.save(tmp_path / "tok")
    for spec in (tmp_path / "tok", tmp_path / "tok" / "tokenizer.json", str(tmp_path / "tok")):
        loaded = load_tokenizer(spec)
        assert isinstance(loaded, BPETokenizer)
        assert loaded.encode(UNSEEN) == tokenizer.encode(UNSEEN)
        assert (loaded.vocab_size, loaded.eos_id) == (320, tokenizer.eos_id)


def test_load_tokenizer_specs(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    ByteTokenizer().save(tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)  # no tokenizer.json: byte-level
    step = tmp_path / "step_00000010"
    BPETokenizer.train(CORPUS, vocab_size=300).save(step)
    (tmp_path / "latest").write_text("step_00000010\n")
    assert isinstance(load_tokenizer(tmp_path), BPETokenizer)  # a checkpoint root: latest step
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "broken.json")
    with pytest.raises(ConfigError, match="at least 257"):
        BPETokenizer.train(CORPUS, vocab_size=200)


def test_iter_texts_forms_and_errors(tmp_path):
    (tmp_path / "one.txt").write_text("alpha")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text("beta")
    (tmp_path / "docs" / "a.txt").write_text("gamma")
    (tmp_path / "docs" / "skip.md").write_text("not text data")
    (tmp_path / "data.jsonl").write_text('{"text": "x"}\n\n{"text": "y", "id": 2}\n')
    assert list(iter_texts(tmp_path / "one.txt")) == ["alpha"]
    assert list(iter_texts(tmp_path / "docs")) == ["gamma", "beta"]  # sorted by file name
    assert list(iter_texts(tmp_path / "data.jsonl")) == ["x", "y"]

    with pytest.raises(ConfigError, match="does not exist"):
        iter_texts(tmp_path / "missing")  # raised on the call, before iterating
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no .txt files"):
        iter_texts(tmp_path / "empty")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 has no string \"text\" field"):
        list(iter_texts(tmp_path / "bad.jsonl"))
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"\n')
    with pytest.raises(ConfigError, match="broken.jsonl:1 is not valid JSON"):
        list(iter_texts(tmp_path / "broken.jsonl"))
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        list(iter_texts(tmp_path / "latin1.txt"))


def test_cli_tokenizer_train(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in CORPUS))
    out = tmp_path / "my_tokenizer.json"
    assert main(["tokenizer", "train", "--data", str(data), "--vocab-size", "300",
                 "--out", str(out)]) == 0
    assert "300 tokens" in capsys.readouterr().out
    tokenizer = load_tokenizer(out)
    assert tokenizer.vocab_size == 300
    assert tokenizer.decode(tokenizer.encode(UNSEEN)) == UNSEEN
    # A folder --out gets tokenizer.json, which load_tokenizer finds.
    assert main(["tokenizer", "train", "--data", str(data), "--vocab-size", "300",
                 "--out", str(tmp_path / "tok")]) == 0
    assert load_tokenizer(tmp_path / "tok").encode(UNSEEN) == tokenizer.encode(UNSEEN)
    assert main(["tokenizer", "train", "--data", str(tmp_path / "nope"), "--vocab-size", "300",
                 "--out", str(out)]) == 2
    assert "data path" in capsys.readouterr().err
