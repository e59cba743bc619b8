"""The rule that decides when automatic reuse may answer: checks, trust, refusal, audits, bad settings."""

from __future__ import annotations

import pytest

from acache import SamplingParams
from acache.server.reuse_gate import Decision, ReuseGate

PARAMS = SamplingParams(gen_length=8, block_length=8, selector="attention")
SPANS = ("span-a",)


def test_a_span_is_checked_until_trusted_then_reused():
    gate = ReuseGate("verified", checks=3, audit_every=0)
    for n in range(3):
        plan = gate.plan(SPANS, PARAMS, deterministic=True, wants_logprobs=False)
        assert plan.decision is Decision.CHECK and f"check {n + 1} of 3" in plan.reason
        gate.record(plan.key, True)
    assert gate.state(plan.key) == "trusted"
    assert all(gate.plan(SPANS, PARAMS, True, False).decision is Decision.REUSE for _ in range(50))


def test_a_burst_runs_no_more_checks_than_it_needs():
    gate = ReuseGate("verified", checks=2, audit_every=0)
    plans = [gate.plan(SPANS, PARAMS, True, False) for _ in range(5)]  # five at once, none recorded yet
    assert [p.decision for p in plans] == [Decision.CHECK] * 2 + [Decision.RECOMPUTE] * 3
    assert "2 checks of this span are still running" in plans[2].reason
    gate.drop(plans[0].key)  # one check's client went away: its place is free again
    assert gate.plan(SPANS, PARAMS, True, False).decision is Decision.CHECK
    gate.record(plans[0].key, True)
    gate.record(plans[0].key, True)
    assert gate.state(plans[0].key) == "trusted"


def test_one_mismatch_refuses_the_span_for_good():
    gate = ReuseGate("verified", checks=4)
    plan = gate.plan(SPANS, PARAMS, True, False)
    gate.record(plan.key, True)
    gate.record(plan.key, False)
    assert gate.state(plan.key) == "refused"
    later = [gate.plan(SPANS, PARAMS, True, False) for _ in range(10)]
    assert all(p.decision is Decision.RECOMPUTE and "changed an answer" in p.reason for p in later)
    assert gate.counts() == {"trusted": 0, "refused": 1, "checking": 0, "checks": 2, "mismatches": 1}


def test_trust_is_per_policy():
    gate = ReuseGate("verified", checks=1)
    gate.record(gate.plan(SPANS, PARAMS, True, False).key, True)
    other = SamplingParams(gen_length=8, block_length=8, selector="attention", anchor_ratio=0.5)
    assert gate.plan(SPANS, PARAMS, True, False).decision is Decision.REUSE
    assert gate.plan(SPANS, other, True, False).decision is Decision.CHECK
    assert gate.plan(("span-b",), PARAMS, True, False).decision is Decision.CHECK
    shallower = SamplingParams(gen_length=8, block_length=8, selector="attention", anchor_depth=0.5)
    assert gate.plan(SPANS, shallower, True, False).decision is Decision.CHECK  # other anchors: not vouched for


@pytest.mark.parametrize("change", [{"gen_length": 16}, {"block_length": 4}, {"steps": 4}, {"threshold": 0.5},
                                    {"remasking": "low_confidence"}, {"refresh_interval": 4}, {"probe_step": True},
                                    {"far_mask_window": 1}, {"focus_layers": 1}, {"temperature": 0.7, "seed": 3},
                                    {"focus_layers": 1, "focus_ratio": 0.5}, {"stop_token_ids": (5,)},
                                    {"ignore_eos": True}])
def test_trust_is_per_decoding(change):
    """A check vouches for the canvas it decoded, as far as it decoded it: the same spans and anchors asked with
    another length, blocks, step count, commit rule, temperature, refresh interval, probe step, FOCUS, far-mask
    pruning or tokens that end decoding (a stop token, EOS ignored) are checked again."""
    gate = ReuseGate("verified", checks=1)
    base = {"gen_length": 8, "block_length": 8, "selector": "attention",
            **({"focus_layers": 1} if "focus_ratio" in change else {})}
    gate.record(gate.plan(SPANS, SamplingParams(**base), True, False).key, True)
    assert gate.plan(SPANS, SamplingParams(**base), True, False).decision is Decision.REUSE
    other = SamplingParams(**{**base, **change})
    assert gate.plan(SPANS, other, True, False).decision is Decision.CHECK
    # what does not change the tokens of a deterministic request keeps the trust: its seed
    same = SamplingParams(**base, seed=3)
    assert gate.plan(SPANS, same, True, False).decision is Decision.REUSE


def test_every_nth_trusted_use_is_audited_and_a_failed_audit_revokes_trust():
    gate = ReuseGate("verified", checks=1, audit_every=4)
    gate.record(gate.plan(SPANS, PARAMS, True, False).key, True)  # trusted; that check counts as use 1
    decisions = [gate.plan(SPANS, PARAMS, True, False).decision for _ in range(3)]
    assert decisions == [Decision.REUSE, Decision.REUSE, Decision.CHECK]  # uses 2, 3, then the audit at 4
    audit = gate.plan(SPANS, PARAMS, True, False)
    assert audit.decision is Decision.REUSE  # one audit at a time: the next request is served while it runs
    gate.record(audit.key, False)
    assert gate.plan(SPANS, PARAMS, True, False).decision is Decision.RECOMPUTE


def test_a_request_that_cannot_be_checked_is_recomputed_until_trusted():
    gate = ReuseGate("verified", checks=1, audit_every=2)
    assert gate.plan(SPANS, PARAMS, deterministic=False, wants_logprobs=False).decision is Decision.RECOMPUTE
    gate.record(gate.plan(SPANS, PARAMS, True, False).key, True)
    # trusted: a sampled request reuses, and an audit that falls on it is passed to the next deterministic one
    assert [gate.plan(SPANS, PARAMS, False, False).decision for _ in range(3)] == [Decision.REUSE] * 3
    assert gate.plan(SPANS, PARAMS, True, False).decision is Decision.CHECK  # it waited a whole period before


def test_logprobs_and_modes():
    assert ReuseGate("verified").plan(SPANS, PARAMS, True, True).decision is Decision.RECOMPUTE
    assert ReuseGate("on").plan(SPANS, PARAMS, True, True).decision is Decision.RECOMPUTE
    assert ReuseGate("on").plan(SPANS, PARAMS, False, False).decision is Decision.REUSE
    assert ReuseGate("off").plan(SPANS, PARAMS, True, False).decision is Decision.RECOMPUTE


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "maybe"}, "auto reuse mode must be one of verified, on, off"),
    ({"checks": 0}, "checks must be an integer >= 1"),
    ({"checks": True}, "checks must be an integer >= 1"),
    ({"audit_every": -1}, "audit_every must be an integer >= 0"),
    ({"max_tracked": 0}, "max_tracked must be an integer >= 1"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReuseGate(**kwargs)


def test_the_records_stay_bounded():
    gate = ReuseGate("verified", max_tracked=8)
    for n in range(50):
        gate.plan((f"span-{n}",), PARAMS, True, False)
    assert sum(gate.counts()[k] for k in ("trusted", "refused", "checking")) == 8


def test_a_refusal_is_not_forgotten_for_new_spans_or_policies():
    """The records are bounded, but a refused span that gave way to others would be checked again from nothing and
    could be trusted: reuse would then change answers. Neither a flood of new policies (distinct temperatures,
    sampled or seeded) nor of new spans lets it go: refusals are kept apart from the records."""
    gate = ReuseGate("verified", checks=1, max_tracked=3)
    refused = gate.plan(SPANS, PARAMS, True, False)
    gate.record(refused.key, False)
    for n in range(20):
        sampled = SamplingParams(gen_length=8, block_length=8, selector="attention", temperature=0.1 + n / 100)
        gate.plan(SPANS, sampled, deterministic=False, wants_logprobs=False)
        fresh = gate.plan((f"span-{n}",), PARAMS, True, False)
        gate.record(fresh.key, True)
    again = gate.plan(SPANS, PARAMS, True, False)
    assert again.decision is Decision.RECOMPUTE and "changed an answer" in again.reason
    assert gate.counts()["refused"] == 1 and gate.counts()["trusted"] + gate.counts()["checking"] == 3


def test_refusals_cannot_fill_the_gate():
    """A client sending one mismatching request under ever new settings (threshold 0.9, 0.9 + 1e-9, ...) filled the
    gate with refusals, each kept for good, until no span was checked again. Refusals now give way, oldest first,
    to newer refusals only: the gate keeps checking, and a refusal forgotten is checked from the start again."""
    gate = ReuseGate("verified", checks=1, max_tracked=2)
    keys = []
    for n in range(5):
        params = SamplingParams(gen_length=8, block_length=8, selector="attention", threshold=0.9 + n * 1e-9)
        plan = gate.plan(SPANS, params, True, False)
        assert plan.decision is Decision.CHECK
        gate.record(plan.key, False)
        keys.append(plan.key)
    assert gate.counts()["refused"] == 2 and [gate.state(k) for k in keys] == ["unseen"] * 3 + ["refused"] * 2
    assert gate.plan(("another-span",), PARAMS, True, False).decision is Decision.CHECK


def test_a_request_that_cannot_be_checked_makes_no_record():
    gate = ReuseGate("verified", max_tracked=2)
    for n in range(5):
        assert gate.plan((f"span-{n}",), PARAMS, False, False).decision is Decision.RECOMPUTE
    assert gate.counts() == {"trusted": 0, "refused": 0, "checking": 0, "checks": 0, "mismatches": 0}


def test_the_least_recently_used_record_gives_way_and_a_running_check_never_does():
    gate = ReuseGate("verified", checks=1, audit_every=0, max_tracked=2)
    first, second = (gate.plan((name,), PARAMS, True, False) for name in ("a", "b"))
    assert gate.plan(("c",), PARAMS, True, False).decision is Decision.RECOMPUTE  # both checks still running
    assert "each being checked" in gate.plan(("c",), PARAMS, True, False).reason
    gate.record(first.key, True)
    gate.record(second.key, True)
    assert gate.plan(("a",), PARAMS, True, False).decision is Decision.REUSE  # "a" used after "b"
    assert gate.plan(("c",), PARAMS, True, False).decision is Decision.CHECK  # "b" gave way, not "a"
    assert gate.state(first.key) == "trusted" and gate.state(second.key) == "unseen"


def test_a_match_recorded_after_a_mismatch_does_not_trust_a_refused_span():
    """Four checks of a burst settle as same, same, different, same: the span stays refused, and no state count
    goes negative on /metrics."""
    gate = ReuseGate("verified", checks=4)
    plans = [gate.plan(SPANS, PARAMS, True, False) for _ in range(4)]
    assert [p.decision for p in plans] == [Decision.CHECK] * 4
    for same in (True, True, False, True):
        gate.record(plans[0].key, same)
    assert gate.state(plans[0].key) == "refused"
    assert gate.counts() == {"trusted": 0, "refused": 1, "checking": 0, "checks": 4, "mismatches": 1}
    assert gate.plan(SPANS, PARAMS, True, False).decision is Decision.RECOMPUTE


def test_one_request_sent_again_is_no_new_evidence():
    """Trust was earned by sending one chat four times, and then covered every other question on the same system
    prompt (their answers changed). A check counts once a request: the same prompt and seed again is recomputed,
    and only different requests (another question, another seed) are checked."""
    gate = ReuseGate("verified", checks=3, audit_every=0)
    first = gate.plan(SPANS, PARAMS, True, False, request="q1")
    assert first.decision is Decision.CHECK and first.request == "q1"
    gate.record(first.key, True)
    again = gate.plan(SPANS, PARAMS, True, False, request="q1")
    assert again.decision is Decision.RECOMPUTE and "checked already" in again.reason
    assert gate.state(first.key) == "checked 1"
    for request in ("q2", "q3"):
        plan = gate.plan(SPANS, PARAMS, True, False, request=request)
        assert plan.decision is Decision.CHECK
        gate.record(plan.key, True)
    assert gate.state(first.key) == "trusted"
    assert gate.plan(SPANS, PARAMS, True, False, request="q1").decision is Decision.REUSE


def test_a_dropped_check_lets_its_request_be_checked_again():
    gate = ReuseGate("verified", checks=2, audit_every=0)
    plan = gate.plan(SPANS, PARAMS, True, False, request="q1")
    assert gate.plan(SPANS, PARAMS, True, False, request="q1").decision is Decision.RECOMPUTE  # its check runs
    gate.drop(plan.key, plan.request)  # its client went away: nothing was learnt
    assert gate.plan(SPANS, PARAMS, True, False, request="q1").decision is Decision.CHECK


def test_a_refusal_whose_check_still_runs_is_not_forgotten():
    """Forgotten while a check of it still ran, a refusal came back as a new record when that check landed, and the
    old outcome counted towards trust."""
    gate = ReuseGate("verified", checks=2, max_tracked=1)
    running = gate.plan(("a",), PARAMS, True, False, request="q1")
    refused = gate.plan(("a",), PARAMS, True, False, request="q2")
    gate.record(refused.key, False)  # 'a' refused, one of its checks still running
    other = gate.plan(("b",), PARAMS, True, False, request="q1")
    gate.record(other.key, False)  # 'b' refused: 'a' would be the oldest refusal to give way
    assert gate.state(running.key) == gate.state(other.key) == "refused"
    gate.record(running.key, True)
    assert gate.state(running.key) == "refused"
    assert gate.plan(("a",), PARAMS, True, False, request="q3").decision is Decision.RECOMPUTE


def test_a_dropped_audit_counts_as_a_use():
    """An audit that ended without an outcome (a client gone) left the count where it was, so every later request
    of a trusted span was an audit again, decoded twice and never with reuse."""
    gate = ReuseGate("verified", checks=1, audit_every=4)
    gate.record(gate.plan(SPANS, PARAMS, True, False).key, True)
    decisions = []
    for _ in range(10):
        plan = gate.plan(SPANS, PARAMS, True, False)
        decisions.append(plan.decision)
        if plan.decision is Decision.CHECK:
            gate.drop(plan.key, plan.request)
    assert decisions.count(Decision.CHECK) <= 3 and decisions.count(Decision.REUSE) >= 7
