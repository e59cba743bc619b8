"""``acache bench scoring``: lm-eval's multiple-choice requests, served by this tree and by an exported commit."""

from __future__ import annotations

import json
from argparse import Namespace

from acache.paths import default_model
from acache_lab.bench.scoring import accuracy, lm_eval_choices
from acache_lab.cli import _cmd_bench_scoring
from tests.server.helpers import free_port


def test_the_choices_are_lm_evals():
    choices = lm_eval_choices(str(default_model()), 2)
    qa1 = [c for c in choices if c.task == "acache_qa1_mc"]
    arith = [c for c in choices if c.task == "acache_arith_mc"]
    assert len(qa1) == 2 * 8 and len(arith) == 2 * 4  # every place; the right total and three wrong ones
    for c in choices:
        same_doc = [d for d in choices if d.task == c.task and d.document == c.document]
        assert all(d.token_ids[:c.context_length] == c.token_ids[:c.context_length] for d in same_doc)
        assert len(c.token_ids) > c.context_length
    assert {len(c.token_ids) - c.context_length for c in qa1} == {1}
    assert min(len(c.token_ids) - c.context_length for c in arith) > 1
    right = {i: float(c.choice == c.label) for i, c in enumerate(choices)}
    assert accuracy(choices, right, "acache_qa1_mc") == 1.0
    assert accuracy(choices, {i: -v for i, v in right.items()}, "acache_arith_mc") == 0.0


def test_a_baseline_commit_beside_this_tree_serves_the_same_estimates(tmp_path, capsys):
    out = tmp_path / "scoring.json"
    args = Namespace(model=None, limit=1, seed=0, samples=2, baseline_ref="HEAD", per_request=2, concurrency=2,
                     pause=0.0, port=free_port(), json=str(out), overwrite=False)
    assert _cmd_bench_scoring(args) == 0
    report = json.loads(out.read_text())
    baseline, here = report["sides"]
    assert baseline["name"] == "baseline HEAD" and baseline["tree"] != here["tree"]
    assert len(baseline["scores"]) == len(here["scores"]) == 12 and len(here["latencies"]) == 6
    assert report["agreement"]["max_abs_difference"] < 1e-4 and report["agreement"]["max_abs_z"] < 1e-3
    assert "speed-up" in capsys.readouterr().out


def test_a_port_another_server_holds_is_refused_and_a_bad_ref_named(tmp_path):
    """The bench's own server failed to bind a port another server held, and the other one's answers were timed as
    this tree's; a ref git cannot archive ended in a CalledProcessError."""
    import http.server
    import threading
    from pathlib import Path

    import pytest

    from acache_lab.bench.scoring import export_tree, start_server

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ValueError, match=f"a server already answers on port {other.server_port}"):
            start_server(Path.cwd(), str(default_model()), other.server_port, 4)
    finally:
        other.shutdown()
    with pytest.raises(ValueError, match="--baseline-ref 'no-such-ref': git archive failed"):
        export_tree("no-such-ref", Path(__file__).resolve().parents[3])
