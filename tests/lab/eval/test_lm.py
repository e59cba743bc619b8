"""``acache eval lm``'s variance study reads the documents of the held-out stream it is given."""

from types import SimpleNamespace

import pytest


class Stop(Exception):
    pass


@pytest.mark.parametrize("seed", [0, 7])
def test_the_variance_study_takes_the_seed_asked(seed, monkeypatch):
    """``--variance`` ignored ``--seed``: every run read seed 0's documents."""
    from acache.cli import main
    from acache_lab.eval import lm

    asked = []

    def records(task, limit, seed):
        asked.append((task, limit, seed))
        raise Stop

    monkeypatch.setattr(lm, "task_records", records)
    monkeypatch.setattr("acache.llm.LLM", lambda *a, **k: SimpleNamespace(inputs=SimpleNamespace(encode_text=list)))
    with pytest.raises(Stop):
        main(["eval", "lm", "--variance", "--limit", "3", "--seed", str(seed)])
    assert asked == [("acache_arith_mc", 3, seed)]
