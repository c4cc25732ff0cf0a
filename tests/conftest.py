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


@pytest.fixture(scope="session", autouse=True)
def no_cached_hardware_profile(tmp_path_factory):
    """Runs predict step times from this machine's cached profile when it has one (tetrad
    calibrate); tests see an empty cache unless they pass --hardware."""
    import os

    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = before
