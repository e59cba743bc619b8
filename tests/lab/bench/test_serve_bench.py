"""``acache bench serve`` against a real server on the shipped model: its own task words, tokens counted."""

from __future__ import annotations

import json

import pytest

from acache.cli import main
from tests.server.helpers import start_server


def test_bench_serve_loads_the_shipped_model_in_its_own_words(tmp_path, capsys):
    proc, port = start_server(["--auto-reuse", "on"])  # the story reused from its second sighting, unchecked
    try:
        out = tmp_path / "serve.json"
        assert main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--concurrency", "4", "--requests", "8",
                     "--max-tokens", "2", "--json", str(out)]) == 0
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    report = json.loads(out.read_text())["report"]
    assert report["prompts"] == "tasks" and report["succeeded"] == 8 and report["failed"] == 0
    assert 8 <= report["output_tokens"] <= 16  # counted by the server: one or two tokens an answer
    assert report["first_block_p50_s"] > 0 and report["latency_p99_s"] >= report["latency_p50_s"]
    assert report["first_block_requests"] == 8  # timed at the first chunk carrying tokens, each request
    assert report["affix_queries"] >= 7 and report["affix_hits"] >= 6  # one story, reused from its second sighting
    assert "output_tokens_per_s" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--port", "8001"], "--port applies with --replicas"),
    (["--documents", "3"], "--documents applies with --replicas"),
    (["--replicas", "2", "--url", "http://127.0.0.1:8000"], "--url applies to a running server, without --replicas"),
    (["--replicas", "2", "--max-tokens", "4"], "--max-tokens applies to a running server"),
])
def test_an_option_of_the_other_mode_is_refused_not_ignored(argv, message, capsys):
    """``--port 8001`` without ``--replicas`` used to load whatever answered on the default --url."""
    assert main(["bench", "serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_no_server_at_the_url_is_named(capsys):
    from tests.server.helpers import free_port

    assert main(["bench", "serve", "--url", f"http://127.0.0.1:{free_port()}", "--requests", "1"]) == 2
    assert "no OpenAI server answers at" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--caches", ","], "--caches names none"),
    (["--repeats", "0"], "not a positive integer"),
    (["--prompt-length", "-3"], "not a positive integer"),
    (["--model", "models/acache-tiny", "--family", "dream"], "--model's own config says its family"),
])
def test_bench_decode_refuses_what_it_cannot_time(argv, message, capsys):
    """Each ended in a traceback or an unclear message (an empty median), or was ignored (--family with --model)."""
    try:
        code = main(["bench", "decode", *argv])
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
