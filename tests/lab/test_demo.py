"""``acache demo`` (make run): every question with its expected answer and each policy's."""

from __future__ import annotations

from acache import LLM
from acache.paths import default_model
from acache_lab.demo import DEMOS, POLICIES, run


def test_the_demo_shows_each_policy_beside_the_expected_answer():
    lines = run(LLM(default_model()))
    rows = [line for line in lines if any(line.startswith(q) for d in DEMOS for q, _ in d.questions)]
    assert len(rows) == sum(len(d.questions) for d in DEMOS) == 8
    for row in rows:
        assert row.rstrip().endswith("ok")  # full recomputation, the last column, answers every question
    right = [line.split()[1:] for line in lines if line.startswith("right")]
    assert len(right) == 3 and all(len(r) == len(POLICIES) for r in right)
    assert right[0][0] == "0/3" and right[0][-1] == "3/3"  # qa1: direct reuse loses all three, full gets all


def test_the_header_explains_the_rows_and_the_token_counts_hold(capsys):
    import argparse

    from acache_lab.demo import main

    assert main(argparse.Namespace(model=str(default_model()), dtype="auto", device="cpu")) == 0
    out = capsys.readouterr().out
    head = out.split("\n==")[0]
    assert "tokens a refresh: the columns each block-boundary refresh computes" in head
    assert "forward ms/request: a demo's questions run as one batch, whose forward time is shared by its requests; " \
           "the fastest of 3 runs after a warm-up" in head
    assert "win" not in head  # no claim the table does not show
    assert "%" not in head  # nor a score some shipped model misses (the affix model's full recompute: 99-100%)
    from acache.models.loader import read_config

    layers = read_config(default_model())[1].num_layers
    assert f"On this {layers}-layer," in head  # the model's own depth, not a stale number
    tokens = [[float(x) for x in line.split()[3:]] for line in out.splitlines() if line.startswith("tokens a refresh ")]
    assert len(tokens) == 3 and all(row == sorted(row) and len(set(row)) == 4 for row in tokens)


def test_a_block_causal_model_reads_the_two_hop_story_in_the_middle():
    """As a suffix, text after the answer a block-causal model cannot read: every policy, full recompute too,
    answered nothing there."""
    lines = run(LLM("models/acache-tiny-blockdiff"))
    assert any(line.startswith("== two-hop") and "as the infix affix" in line for line in lines)
    right = [line.split()[1:] for line in lines if line.startswith("right")]
    assert right[2][-1] == "2/2"  # full recompute answers both two-hop questions


def test_a_model_without_shared_affixes_is_refused_before_the_header(capsys):
    import argparse

    import pytest

    from acache_lab.demo import main

    with pytest.raises(ValueError, match="acache demo shows affix reuse, which a blockdiff_ssm model does not"):
        main(argparse.Namespace(model="models/acache-tiny-ssm", dtype="auto", device="cpu"))
    assert capsys.readouterr().out == ""

