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


def test_the_table_names_a_server_it_did_not_start_as_such():
    """Against --base-url the header named `acache serve models/acache-tiny --loglikelihood-samples 8`, a command
    that was never run."""
    from acache_lab.eval.lm import markdown

    results = {"acache_qa1_mc": {"acc,none": 0.5, "acc_stderr,none": 0.1}}
    own = markdown(results, "models/acache-tiny", 8, 10, 60.0)
    assert "against `acache serve models/acache-tiny --loglikelihood-samples 8`" in own
    other = markdown(results, "models/acache-tiny", 8, 10, 60.0, "http://gpu-box:8000")
    assert "against the server at http://gpu-box:8000 (started elsewhere" in other and "acache serve" not in other
    assert "| acache_qa1_mc | multiple_choice | acc | 0.500 | 0.100 |" in other
