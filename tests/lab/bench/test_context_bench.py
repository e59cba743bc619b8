"""``acache bench context``: both variants at every length; the attention cache grows with the context by its
exact size, the state does not grow at all."""

from __future__ import annotations

import json

from acache.cli import main

STATE = 2 * (2 * 64 * 8 + 3 * (2 * 64 + 2 * 8)) * 4  # bytes of the state-space cache in these tests


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
    # the state, layers x (heads (2 x 64 / 64) x 64 channels x state 8, and the convolution's window of 3 inputs
    # of 2 x 64 + 2 x 8 channels) x 4 bytes, at any context
    assert by[("state-space", 64)]["cache_mib"] == by[("state-space", 256)]["cache_mib"] == STATE / 2**20
    assert all(p["step_ms"] > 0 for p in points) and png.stat().st_size > 0
    assert "| 256 |" in capsys.readouterr().out
    assert main(["bench", "context", "--lengths", "0"]) == 2
    assert "--lengths must be positive" in capsys.readouterr().err


def test_serving_under_one_budget_admits_by_cache_size(tmp_path):
    """With --serve, the budget holds one attention request of 256 tokens at a time (its K/V, 2 x 2 layers x 64
    x 4 bytes a token, in pages of 16) but every state-space request at once (a cache is 11 KiB, reserved with the
    three copies a batched step makes of it)."""
    out = tmp_path / "serve.json"
    assert main(["bench", "context", "--lengths", "64", "--hidden-size", "64", "--layers", "2", "--heads", "2",
                 "--state-size", "8", "--block-length", "8", "--repeats", "1", "--serve", "4",
                 "--serve-lengths", "256", "--cache-budget-mib", "0.3", "--json", str(out)]) == 0
    served = {p["variant"]: p for p in json.loads(out.read_text())["served"]}
    attention, state = served["attention"], served["state-space"]
    assert attention["most_at_once"] == 1 and state["most_at_once"] == 4
    assert attention["peak_cache_mib"] <= 0.3 and state["peak_cache_mib"] * 2**20 == 4 * 4 * STATE
    assert attention["requests"] == state["requests"] == 4 and state["tokens_per_s"] > 0


def test_both_steps_end_in_the_vocabulary_head(monkeypatch):
    """The state-space step computed the head and the attention step did not, so the two sides timed different
    work (the head is most of a small state-space step); each timed step now reads the head once."""
    import torch

    from acache.models.base import DiffusionLM
    from acache.models.ssm import SSMBlockDiffusionLM
    from acache_lab.bench import context

    heads = []
    real_logits = DiffusionLM.logits
    real_ssm = SSMBlockDiffusionLM.forward

    def logits(self, *args, **kwargs):
        heads.append("attention")
        return real_logits(self, *args, **kwargs)

    def ssm_forward(self, *args, **kwargs):
        heads.append("state-space" if kwargs.get("logits", True) else "state-space without its head")
        return real_ssm(self, *args, **kwargs)

    monkeypatch.setattr(DiffusionLM, "logits", logits)
    monkeypatch.setattr(SSMBlockDiffusionLM, "forward", ssm_forward)
    attention, ssm = context.models(64, 2, 2, 8, 8, torch.float32, torch.device("cpu"))
    context.measure(attention, ssm, 64, repeats=2)
    assert heads.count("attention") == heads.count("state-space") == 3 and len(heads) == 6  # warm-up + 2 each
