"""``acache bench serve`` against a real server on the shipped model: its own task words, tokens counted."""

from __future__ import annotations

import json

from acache_lab.cli import _cmd_bench_serve
from tests.server.helpers import start_server


def test_bench_serve_loads_the_shipped_model_in_its_own_words(tmp_path, capsys):
    from argparse import Namespace

    proc, port = start_server(["--auto-reuse", "on"])  # the story reused from its second sighting, unchecked
    try:
        out = tmp_path / "serve.json"
        args = Namespace(url=f"http://127.0.0.1:{port}", concurrency=4, requests=8, api_key=None, max_tokens=2,
                         system_prompt=None, prompts="auto", seed=0, json=str(out))
        assert _cmd_bench_serve(args) == 0
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    report = json.loads(out.read_text())["report"]
    assert report["prompts"] == "tasks" and report["succeeded"] == 8 and report["failed"] == 0
    assert 8 <= report["output_tokens"] <= 16  # counted by the server: one or two tokens an answer
    assert report["first_block_p50_s"] > 0 and report["latency_p99_s"] >= report["latency_p50_s"]
    assert report["affix_queries"] >= 7 and report["affix_hits"] >= 6  # one story, reused from its second sighting
    assert "output_tokens_per_s" in capsys.readouterr().out
