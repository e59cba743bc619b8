"""``acache eval auto-reuse``: in the verified mode only answers served from a trusted span can differ from the
server without reuse (by construction); unchecked reuse is counted."""

from __future__ import annotations

from acache.paths import SHIPPED_MODEL
from acache_lab.eval.auto_reuse import chat_workload, measure, report


def test_only_trusted_reuse_can_change_an_answer(tmp_path, capsys):
    results = {r.mode: r for r in measure(str(SHIPPED_MODEL), ["qa1", "arith"], stories=1, rounds=3,
                                          concurrency=4, checks=1, audit_every=4)}
    assert set(results) == {"off", "on", "verified"}
    shown = capsys.readouterr().err
    assert all(f"auto-reuse {mode}: 100%" in shown for mode in results)  # each mode's progress, as it goes
    off, on, verified = results["off"], results["on"], results["verified"]
    assert off.requests == on.requests == verified.requests == 3 * len(chat_workload(["qa1", "arith"], 1, 0))
    assert (off.changed, off.reused, off.checks) == (0, 0, 0)
    assert on.reused > 0 and on.checks == 0 and on.changed == on.changed_when_reused  # only reuse changes answers
    assert verified.changed == verified.changed_when_reused and verified.checks > 0
    assert verified.refused_spans <= verified.mismatches  # a mismatch refuses a span (checks in flight may add)
    text = report(list(results.values()), tmp_path / "auto_reuse.json")
    assert "| verified | " in text and (tmp_path / "auto_reuse.json").is_file()


def test_the_workload_asks_whole_stories_each_all_their_questions():
    """--stories N drew 3N questions a task, cutting a story short (one asked once can never be reused) and giving
    qa1 five stories for four."""
    from acache_lab.tasks.generators import held_out

    for task, stories in (("qa1", 4), ("twohop", 3), ("arith", 2)):
        bodies = chat_workload([task], stories, 0)
        contexts = [b["messages"][0]["content"] for b in bodies]
        assert len(set(contexts)) == stories
        per_story = {c: contexts.count(c) for c in contexts}
        firsts = held_out(task, len(bodies) + 3, 6, 0)
        assert len([e for e in firsts if " ".join(e.context + e.affix) in per_story]) == len(bodies)
