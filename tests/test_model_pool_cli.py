"""`tetrad serve` of the store's models (no model named, or several) as a process of its own, and
`tetrad ps` against it; the flags of many models refused in one line."""

import os
import signal
import socket
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest
from model_pool_helpers import ENGINE, NAMES, completion, counted_bytes, fill_store, wait_until
from serving import post, request

from tetrad.cli.main import main
from tetrad.cli.ps import until
from tetrad.spec.presets import resolve_model

pytest.importorskip("uvicorn")
ALPHA, BETA, _ = NAMES


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    home, sources = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("sources")
    return home, sources, fill_store(home / "models", sources)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(port: int) -> bool:
    try:
        return request(port, "GET", "/health")[0] == 200
    except OSError:
        return False


def test_serve_with_no_model_serves_the_store_and_ps_lists_what_is_loaded(store, capsys):
    home, sources, expected = store
    port = free_port()
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE.items()]
    server = subprocess.Popen(
        [sys.executable, "-m", "tetrad.cli.main", "serve", "--port", str(port), *flags,
         "--keep-alive", "-1"], env={**os.environ, "TETRAD_HOME": str(home)},
        stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: answers(port) or server.poll() is not None, 120)
        assert server.poll() is None, server.stderr.read()
        status, listed, _ = request(port, "GET", "/v1/models")
        assert [model["id"] for model in listed["data"]] == list(NAMES)
        assert main(["ps", "--port", str(port)]) == 0
        assert capsys.readouterr().out.splitlines()[1:] == []  # nothing loaded yet
        for name in (BETA, ALPHA):
            status, answer = post(port, "/v1/completions", completion(name))
            assert status == 200 and answer["choices"][0]["text"] == expected[name]
        assert main(["ps", "--port", str(port)]) == 0
        header, *rows = capsys.readouterr().out.splitlines()
        assert header.split() == ["NAME", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
        assert sorted(row.split()[0] for row in rows) == [ALPHA, BETA]
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TETRAD_HOME", str(home))
            size = counted_bytes(ALPHA)  # the tiny models' shapes are alike
        context = resolve_model("tiny").max_seq_len
        assert all(row.split()[1:] == [f"{size / 2**20:.1f}", "MiB", "CPU", str(context),
                                       "Forever"] for row in rows), rows
    finally:
        server.send_signal(signal.SIGINT)
        _, errors = server.communicate(timeout=60)
    assert server.returncode == 130 and errors.endswith("tetrad serve: interrupted\n"), errors
    assert "Traceback" not in errors and f"serving 3 models ({', '.join(NAMES)})" in errors


def test_ps_says_when_a_model_unloads_as_ollama_does():
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    at = lambda delta: (now + delta).isoformat().replace("+00:00", "Z")  # noqa: E731
    assert until(None, now) == "Forever"
    assert until(at(timedelta(minutes=4, seconds=59)), now) == "4 minutes from now"
    assert until(at(timedelta(hours=1)), now) == "1 hour from now"
    assert until(at(timedelta(seconds=-1)), now) == "Stopping..."


def test_ps_without_a_server_is_one_line(capsys):
    assert main(["ps", "--port", str(free_port())]) == 2
    error = capsys.readouterr().err
    assert error.startswith("tetrad ps: error: no answer from a server at") and \
        error.count("\n") == 1


@pytest.mark.parametrize("flags, message", [
    (["--served-model-name", "x"], "--served-model-name goes with one model"),
    (["--keep-alive", "soon"], "keep_alive 'soon' is not a duration"),
    (["--max-loaded-memory", "lots"], "lots"),
])
def test_flags_of_many_models_are_checked_in_one_line(store, flags, message, capsys,
                                                      monkeypatch):
    monkeypatch.setenv("TETRAD_HOME", str(store[0]))
    monkeypatch.setattr("uvicorn.Server.run", lambda server: pytest.fail("it served"))
    assert main(["serve", ALPHA, str(store[1] / "beta"), "--device", "cpu", *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("tetrad serve: error: ") and message in error and \
        error.count("\n") == 1, error
