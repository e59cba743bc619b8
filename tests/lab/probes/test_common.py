"""Every probe opens its model through one rule: a path that is not a checkpoint, or a family the probe cannot
read, ends in the probe's usage error naming it, before anything is measured."""

from __future__ import annotations

import argparse
import importlib
import re
import sys

import pytest

from acache.paths import REPO_ROOT
from acache_lab.probes.common import open_llm, open_model

SSM = str(REPO_ROOT / "models" / "acache-tiny-ssm")


@pytest.mark.parametrize("opener", [open_llm, open_model])
def test_a_missing_model_and_a_state_family_are_usage_errors(opener, capsys, tmp_path):
    parser = argparse.ArgumentParser(prog="probe")
    with pytest.raises(SystemExit) as exc:
        opener(parser, str(tmp_path / "nothing"))
    assert exc.value.code == 2 and "model directory not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        opener(parser, SSM, attention=True)
    assert "carries a state instead of per-layer K/V" in capsys.readouterr().err
    opened = opener(parser, SSM)  # a probe that reads no K/V opens it
    assert (opened if opener is open_model else opened.model).family == "blockdiff_ssm"


@pytest.mark.parametrize(("argv", "message"), [
    (["selection_time", "--repeats", "0"], "not a positive integer"),
    (["engine_phases", "--batch", "0"], "not a positive integer"),
    (["one_pass_cost", "--selector", "random"], "invalid choice: 'random'"),
    (["one_pass_cost", "--anchor-depth", "0"], r"--anchor-depth must be in \(0, 1\]"),
    (["shift", "--questions", "0"], "not a positive integer"),
    (["shift", "--model", SSM], "no rotary positions"),
    (["layer_updates", "--model", SSM], "carries a state"),
    (["anchor_words", "--model", SSM], "carries a state"),
    (["anchor_overlap", "--model", "no/such/model"], "model directory not found"),
    (["two_affix_answers", SSM, "--requests", "2"], "is not supported for the blockdiff_ssm family"),
    (["answer_columns", "no/such/model"], "model directory not found"),
    (["binding", "--eval-every", "0"], "not a positive integer"),
    (["step_paths_ab", "--repeats", "0"], "not a positive integer"),
    (["fused_tiny_ab", "--rounds", "0"], "not a positive integer"),
    (["lookup_key", "--questions", "0"], "not a positive integer"),
    (["recency", "--questions", "0"], "not a positive integer"),
    (["reuse_binding", "--examples", "0"], "not a positive integer"),
])
def test_bad_input_to_a_probe_is_a_usage_error(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(f"acache_lab.probes.{argv[0]}").main()
    assert exc.value.code == 2, capsys.readouterr()
    assert re.search(message, capsys.readouterr().err)
