"""The ``acache`` command line, run in-process."""

from __future__ import annotations

import json

from acache.cli import main
from acache.models.loader import load_model


def test_make_random_checkpoint_and_generate(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["make-random-checkpoint", "--family", "dream", "--out", str(out), "--layers", "3",
                 "--hidden-size", "32", "--heads", "4", "--kv-heads", "2", "--shards", "2"]) == 0
    model = load_model(out)
    assert model.config.num_layers == 3 and model.config.num_kv_heads == 2
    assert (out / "model.safetensors.index.json").exists()
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt", "hello", "--prompt", "bye", "--gen-length", "16",
                 "--block-length", "8", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["prompt"] for r in lines] == ["hello", "bye"]
    assert all(r["nfe"] >= 2 for r in lines)


def test_cli_errors_are_one_line(tmp_path, capsys, llada_dir):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "error: model directory not found" in capsys.readouterr().err
    assert main(["generate", "--model", str(llada_dir), "--prompt", "x", "--gen-length", "30"]) == 2
    assert "gen_length (30) must be a multiple of block_length (32)" in capsys.readouterr().err
    assert main(["generate", "--model", str(llada_dir), "--prompt", "x", "--threshold", "2"]) == 2
    assert "threshold must be in (0, 1]" in capsys.readouterr().err
