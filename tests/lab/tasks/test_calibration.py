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
