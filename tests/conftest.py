import pytest
import torch

from tetrad.train.data import default_corpus

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    """60 KB of Hamlet: real text, small enough to tokenize in milliseconds."""
    path = tmp_path_factory.mktemp("corpus") / "hamlet.txt"
    path.write_text((default_corpus() / "hamlet_gut.txt").read_text()[:60_000])
    return str(path)
