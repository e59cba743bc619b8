"""Calibration requests read from a JSONL file, and a bad record named by its line."""

from __future__ import annotations

import json

import pytest

from acache.models.tokenizer import Tokenizer
from acache_lab.tasks.calibration import calibration_prompts


def test_calibration_file(tmp_path, llada_dir):
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    tok = Tokenizer.from_dir(llada_dir)
    path = tmp_path / "cal.jsonl"
    path.write_text(json.dumps({"affix": "Mary went home.", "prompt": "Where is Mary?", "layout": "suffix"}) + "\n")
    (prompt,) = calibration_prompts(tok, model.config, path, samples=0)
    assert prompt.gen_at == len(tok.encode("Where is Mary?", add_special_tokens=False))
    path.write_text("{not json}\n")
    with pytest.raises(ValueError, match="cal.jsonl:1"):
        calibration_prompts(tok, model.config, path, samples=0)
    path.write_text("[1, 2]\n")  # JSON, but not a record: was an AttributeError from inside
    with pytest.raises(ValueError, match="cal.jsonl:1: not a calibration record .a JSON list, not an object"):
        calibration_prompts(tok, model.config, path, samples=0)


def test_task_calibration_meets_every_task_in_every_layout(monkeypatch):
    """The task and the layout both turned with the request's index, so qa1 was only ever calibrated as a prefix,
    arithmetic as an infix and two-hop as a suffix."""
    from acache_lab.tasks import calibration

    seen = []
    monkeypatch.setattr(calibration, "render_prompts", lambda tok, exs, layout: seen.append((exs[0], layout)) or [])
    calibration.task_calibration_prompts(None, 18)
    pairs = [(next(t for t in calibration.TASKS if ex in calibration.examples(t, seed=10_000, count=18)), layout)
             for ex, layout in seen]
    assert sorted(set(pairs)) == sorted((t, lay) for t in calibration.TASKS for lay in calibration.LAYOUTS)
    assert len({id(ex) for ex, _ in seen}) == 18 and len(set(pairs)) == 9  # no example drawn twice
