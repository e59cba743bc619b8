"""``acache bench context``: both variants at every length; the attention cache grows with the context by its
exact size, the state does not grow at all."""

from __future__ import annotations

import json

from acache.cli import main


def test_context_bench_points_and_cache_sizes(tmp_path, capsys):
    out, png = tmp_path / "ctx.json", tmp_path / "ctx.png"
    assert main(["bench", "context", "--lengths", "64,256", "--hidden-size", "64", "--layers", "2", "--heads", "2",
                 "--state-size", "8", "--block-length", "8", "--repeats", "1", "--json", str(out), "--plot",
                 str(png)]) == 0
    points = json.loads(out.read_text())["points"]
    by = {(p["variant"], p["context"]): p for p in points}
    assert set(by) == {(v, n) for v in ("attention", "state-space") for n in (64, 256)}
    # K and V: context x layers x 2 x heads x head dim x 4 bytes (float32)
    for n in (64, 256):
        assert by[("attention", n)]["cache_mib"] * 2**20 == n * 2 * 2 * 64 * 4
    # the state: layers x heads (2 x 64 / 64) x 64 channels x state 8 x 4 bytes, at any context
    assert by[("state-space", 64)]["cache_mib"] == by[("state-space", 256)]["cache_mib"] == 2 * 2 * 64 * 8 * 4 / 2**20
    assert all(p["step_ms"] > 0 for p in points) and png.stat().st_size > 0
    assert "| 256 |" in capsys.readouterr().out
    assert main(["bench", "context", "--lengths", "0"]) == 2
    assert "--lengths must be positive" in capsys.readouterr().err
