"""Many models behind one server (tetrad.inference.entrypoints.model_pool): stored models loaded
when a request names them, each answering as its own engine does; the memory budget (the least
recently used idle model unloads first, a 503 when a model cannot fit); a streamed answer holds
its model; a request for a model being loaded waits while other models answer; keep_alive;
nothing left running after shutdown."""

import asyncio
import math
import threading

import pytest
from model_pool_helpers import (NAMES, assert_nothing_left_running, completion, counted_bytes,
                                loaded, make_pool, stored_models, wait_until)
from serving import events, post, request, running

from tetrad.inference.entrypoints.api import ApiError
from tetrad.inference.entrypoints.served import parse_keep_alive, request_scope
from tetrad.inference.entrypoints.server import build_server

pytest.importorskip("uvicorn")
ALPHA, BETA, GAMMA = NAMES


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    yield from stored_models(tmp_path_factory)


@pytest.fixture(scope="module")
def size(expected):
    return counted_bytes(ALPHA)


def test_stored_models_answer_alternately_each_as_its_own_engine(expected, size):
    pool, hook, _ = make_pool()
    with running(build_server(pool, pool.config)) as port:
        status, listed, _ = request(port, "GET", "/v1/models")
        assert status == 200 and [model["id"] for model in listed["data"]] == list(NAMES)
        for name in [ALPHA, BETA, ALPHA, BETA, "alpha"]:
            status, answer = post(port, "/v1/completions", completion(name))
            assert status == 200, answer
            assert answer["choices"][0]["text"] == expected[name if ":" in name else ALPHA]
        assert "".join(event["choices"][0]["text"] for event in events(
            port, "/v1/completions", completion(BETA)) if event != "[DONE]") == expected[BETA]
        assert hook.calls == [ALPHA, BETA]  # each loaded once
        assert loaded(pool) == {ALPHA, BETA}
        assert [served.size_bytes for served in pool.loaded()] == [size, size]
        status, listed, _ = request(port, "GET", "/v1/models")
        assert {model["id"] for model in listed["data"] if "max_model_len" in model} == \
            {ALPHA, BETA}
        status, answer = post(port, "/v1/completions", completion("delta"))
        assert status == 404 and "delta" in answer["error"]["message"]
        status, answer = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 400 and "name one" in answer["error"]["message"]
    assert pool.loaded() == []
    assert_nothing_left_running()


def test_the_least_recently_used_idle_model_unloads_to_make_room(expected, size):
    pool, hook, lines = make_pool(budget=size * 5 // 2)  # two fit, not three
    with running(build_server(pool, pool.config)) as port:
        for name, after in [(ALPHA, {ALPHA}), (BETA, {ALPHA, BETA}), (ALPHA, {ALPHA, BETA}),
                            (GAMMA, {ALPHA, GAMMA}), (BETA, {GAMMA, BETA})]:
            status, answer = post(port, "/v1/completions", completion(name))
            assert status == 200 and answer["choices"][0]["text"] == expected[name]
            assert loaded(pool) == after, name
        assert hook.calls == [ALPHA, BETA, GAMMA, BETA]
        assert [line.split()[1] for line in lines if line.startswith("unloading")] == \
            [BETA, ALPHA]
    assert_nothing_left_running()


def test_a_model_over_the_budget_alone_is_refused_with_a_503(expected, size):
    pool, hook, _ = make_pool(budget=size - 1)
    with running(build_server(pool, pool.config)) as port:
        for _ in range(2):
            status, answer = post(port, "/v1/completions", completion(ALPHA))
            assert status == 503, answer
            assert f"takes {size / 2**20:.1f} MiB" in answer["error"]["message"]
            assert "--max-loaded-memory" in answer["error"]["message"]
        assert hook.calls == [ALPHA]  # the second refusal knew its counted size
        assert pool.loaded() == []
    assert_nothing_left_running()


def test_a_streamed_answer_holds_its_model_until_its_end(expected, size):
    pool, hook, _ = make_pool(budget=size * 3 // 2)  # one fits
    with running(build_server(pool, pool.config)) as port:
        assert post(port, "/v1/completions", completion(ALPHA))[0] == 200
        alpha = pool.loaded()[0]
        steps_may_run, step = threading.Event(), alpha.llm.step
        alpha.llm.step = lambda: (steps_may_run.wait(60), step())[1]
        streamed = []
        reader = threading.Thread(target=lambda: streamed.extend(
            events(port, "/v1/completions", completion(ALPHA))), daemon=True)
        reader.start()
        wait_until(lambda: alpha.pins == 1)
        status, answer, headers = request(port, "POST", "/v1/completions", completion(BETA))
        assert status == 503 and headers["retry-after"] == "1", answer
        assert "in use hold" in answer["error"]["message"]
        steps_may_run.set()
        reader.join(60)
        assert not reader.is_alive()
        assert "".join(e["choices"][0]["text"] for e in streamed if e != "[DONE]") == \
            expected[ALPHA]
        status, answer = post(port, "/v1/completions", completion(BETA))
        assert status == 200 and answer["choices"][0]["text"] == expected[BETA]
        assert loaded(pool) == {BETA}
    assert_nothing_left_running()


def test_a_request_for_a_loading_model_waits_while_another_model_answers(expected):
    pool, hook, _ = make_pool(held=(BETA,))
    with running(build_server(pool, pool.config)) as port:
        assert post(port, "/v1/completions", completion(ALPHA))[1]["choices"][0]["text"] == \
            expected[ALPHA]
        answers = []
        waiting = [threading.Thread(target=lambda: answers.append(
            post(port, "/v1/completions", completion(BETA)))) for _ in range(2)]
        for thread in waiting:
            thread.start()
        assert hook.started[BETA].wait(60)
        wait_until(lambda: pool.waiting.get(BETA) == 2)
        for _ in range(3):  # beta's load is under way, and alpha answers
            status, answer = post(port, "/v1/completions", completion(ALPHA))
            assert status == 200 and answer["choices"][0]["text"] == expected[ALPHA]
        assert answers == [] and all(thread.is_alive() for thread in waiting)
        hook.go[BETA].set()
        for thread in waiting:
            thread.join()
        assert [(status, answer["choices"][0]["text"]) for status, answer in answers] == \
            [(200, expected[BETA])] * 2
        assert hook.calls == [ALPHA, BETA]
    assert_nothing_left_running()


def test_keep_alive_zero_on_the_server_unloads_after_each_request(expected):
    pool, hook, _ = make_pool(keep_alive=0)
    with running(build_server(pool, pool.config)) as port:
        for _ in range(2):
            status, answer = post(port, "/v1/completions", completion(ALPHA))
            assert status == 200 and answer["choices"][0]["text"] == expected[ALPHA]
            wait_until(lambda: pool.loaded() == [])
        assert hook.calls == [ALPHA, ALPHA]
    assert_nothing_left_running()


def test_each_requests_keep_alive_sets_when_its_model_unloads(expected):
    pool, hook, _ = make_pool()

    async def scenario():
        pool.start()
        async with request_scope():
            kept = await pool.acquire(ALPHA, -1)
            short = await pool.acquire(BETA, "300ms")
            default = await pool.acquire(GAMMA)
            assert kept.expires_at is None and short.pins == 1
        assert abs((short.expires_at - 0.3) - (default.expires_at - 300)) < 5
        while BETA in loaded(pool):
            await asyncio.sleep(0.02)
        assert loaded(pool) == {ALPHA, GAMMA}
        assert short.health() == "the engine thread is not running"  # closed, not just dropped
        async with request_scope():
            assert await pool.acquire(GAMMA, 0) is default
        while GAMMA in loaded(pool):
            await asyncio.sleep(0.02)
        assert loaded(pool) == {ALPHA} and kept.health() is None
        async with request_scope():
            with pytest.raises(ApiError, match="not a duration"):
                await pool.acquire(ALPHA, "soon")
        pool.close()

    asyncio.run(scenario())
    assert hook.calls == [ALPHA, BETA, GAMMA]
    assert_nothing_left_running()


@pytest.mark.parametrize("value, seconds", [(0, 0.0), ("0", 0.0), (30, 30.0), (2.5, 2.5),
                                            ("10", 10.0), ("5m", 300.0), ("1h30m", 5400.0),
                                            ("1.5h", 5400.0), ("250ms", 0.25), (-1, math.inf),
                                            ("-1m", math.inf)])
def test_keep_alive_takes_ollamas_forms(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["", "soon", "5 m", "5mm", "m", True, None, [1]])
def test_a_keep_alive_that_is_no_duration_is_a_400(value):
    with pytest.raises(ApiError, match="is not a duration") as error:
        parse_keep_alive(value)
    assert error.value.status == 400
