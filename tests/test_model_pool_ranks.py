"""Many models behind one server whose engines run over several ranks (--tp 2 on the CPU): one
model loaded at a time (a process has one torch.distributed group, which a multi-rank engine
owns), each answering as its own one-process engine does, its memory counted over both ranks, and
no rank process left once it unloads or the server stops."""

import multiprocessing

import pytest
from model_pool_helpers import (ENGINE, NAMES, assert_nothing_left_running, completion, loaded,
                                make_pool, stored_models)
from serving import post, running

from tetrad.inference.entrypoints.server import build_server

pytest.importorskip("uvicorn")
ALPHA, BETA, _ = NAMES


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    yield from stored_models(tmp_path_factory)


@pytest.mark.slow
def test_multi_rank_models_load_one_at_a_time_and_leave_no_rank_behind(expected):
    pool, hook, lines = make_pool(engine={**ENGINE, "tp": 2})
    with running(build_server(pool, pool.config)) as port:
        for name in (ALPHA, BETA):
            status, answer = post(port, "/v1/completions", completion(name))
            assert status == 200 and answer["choices"][0]["text"] == expected[name]
            assert loaded(pool) == {name} and len(multiprocessing.active_children()) == 1
        served = pool.loaded()[0]
        pool_tensor = served.llm.runner.kv_cache.pool
        rank_bytes = (sum(p.numel() * p.element_size() for p in served.llm.model.parameters())
                      + pool_tensor.numel() * pool_tensor.element_size())
        assert served.size_bytes == 2 * rank_bytes  # the tiny model's two shares are alike
        assert [line.split()[1] for line in lines if line.startswith("unloading")] == [ALPHA]
    assert_nothing_left_running()
