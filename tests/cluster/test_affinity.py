"""The affix directory and the routing rule, apart from Ray: what the router decides from what the replicas
reported."""

from __future__ import annotations

import pytest

from acache.cluster.affinity import Balance, rank_replicas
from acache.cluster.directory import AffixDirectory, Holding

R = ["a", "b", "c"]


def test_the_directory_follows_stored_evicted_and_seen_events_in_order():
    d = AffixDirectory(max_seen=2)
    d.report("a", [("stored", "doc1", 40), ("stored", "doc2", 20), ("evicted", "doc1", 40), ("stored", "doc1", 40)],
             {"hits": 3, "queries": 5})
    d.report("b", [("seen", "doc3", 30), ("stored", "doc2", 20), ("evicted", "doc9", 10)])
    h = d.holdings({"doc1": 40, "doc2": 20, "doc3": 30}, R)
    assert h == {"a": Holding(60, 0, 60), "b": Holding(20, 30, 20), "c": Holding(0, 0, 0)}
    d.report("c", [("seen", "x", 1), ("seen", "y", 1)])  # the oldest sighting (doc3 on b) falls out
    assert d.holdings({"doc3": 30}, ["b"])["b"].seen == 0
    snap = d.snapshot()
    assert snap["replicas"]["a"] == {"affixes": 2, "affix_tokens": 60, "affix_hits": 3, "affix_queries": 5}
    assert snap["affix_hit_rate"] == 3 / 5
    d.forget("a")
    assert d.holdings({"doc1": 40, "doc2": 20}, ["a", "b"]) == {"a": Holding(0, 0, 0), "b": Holding(20, 0, 20)}
    assert "a" not in d.snapshot()["replicas"]


def test_requests_in_flight_count_as_held_by_their_replica():
    d = AffixDirectory()
    d.report("a", [("stored", "doc1", 40)])
    h = d.holdings({"doc2": 10}, ["a", "b"], in_flight={"b": {"doc2": 10, "doc1": 40}})
    assert h == {"a": Holding(0, 0, 40), "b": Holding(10, 0, 50)}


def test_a_bad_event_is_refused():
    with pytest.raises(ValueError, match="unknown affix event 'moved'"):
        AffixDirectory().report("a", [("moved", "doc1", 3)])


def test_the_replica_holding_the_most_affix_tokens_comes_first():
    holdings = {"a": Holding(40, 0, 100), "b": Holding(60, 0, 60), "c": Holding(0, 60, 0)}
    assert rank_replicas(R, {"a": 0, "b": 5, "c": 0}, holdings) == ["b", "a", "c"]
    # held beats only-seen; seen beats nothing
    assert rank_replicas(R, {}, {"a": Holding(0, 0, 9), "b": Holding(0, 30, 0), "c": Holding()}) == ["b", "c", "a"]


def test_new_spans_go_to_the_replica_with_the_fewest_affix_tokens():
    holdings = {"a": Holding(0, 0, 80), "b": Holding(0, 0, 40), "c": Holding(0, 0, 120)}
    assert rank_replicas(R, {"a": 0, "b": 3, "c": 0}, holdings)[0] == "b"
    assert rank_replicas(R, {"a": 2, "b": 1, "c": 0}, {})[0] == "c"  # no spans: the least loaded


def test_affinity_yields_to_load_only_past_both_thresholds():
    holdings = {"a": Holding(40, 0, 40), "b": Holding(0, 0, 0)}
    balance = Balance(absolute=64, relative=1.5)
    assert rank_replicas(["a", "b"], {"a": 100, "b": 40}, holdings, balance)[0] == "a"  # 60 more: under 64
    assert rank_replicas(["a", "b"], {"a": 100, "b": 30}, holdings, balance)[0] == "b"  # 70 more and 3.3x
    assert rank_replicas(["a", "b"], {"a": 200, "b": 135}, holdings, balance)[0] == "a"  # 65 more, but 1.48x
    assert rank_replicas(["a", "b"], {"a": 3, "b": 0}, holdings, Balance(2, 1.0))[0] == "b"


@pytest.mark.parametrize("absolute, relative, why", [(-1, 1.5, "absolute"), (True, 1.5, "absolute"),
                                                     (64, 0.5, "relative"), (64, float("nan"), "relative")])
def test_bad_balance_thresholds_are_refused(absolute, relative, why):
    with pytest.raises(ValueError, match=f"the {why} balance threshold"):
        Balance(absolute, relative)


def test_sightings_and_stray_evictions_leave_no_entries_behind():
    d = AffixDirectory(max_seen=4)
    d.report("a", [("seen", f"doc{i}", 5) for i in range(100)] + [("evicted", "never-stored", 5)])
    assert d.held == {} and len(d.seen) == 4 and d.snapshot()["replicas"] == {}


def test_a_full_report_replaces_what_the_directory_had_of_the_replica():
    d = AffixDirectory()
    assert d.report("a", [("stored", "x", 5), ("stored", "y", 3)], full=True)
    assert d.report("a", [("evicted", "x", 5)])  # an increment: it knows the replica
    d.report("a", [("stored", "z", 4), ("seen", "w", 2)], full=True)  # e.g. after a report was lost
    assert set(d.held) == {"z"} and d.totals["a"] == 4 and d.seen[("w", "a")] == 2


def test_a_directory_restarted_empty_asks_each_replica_for_a_full_report():
    fresh = AffixDirectory()
    assert fresh.report("a", [("evicted", "x", 5)]) is False  # an increment from a replica it never heard in full
    assert fresh.report("a", [("stored", "y", 3)], full=True) is True


def test_a_forgotten_replica_stays_forgotten_when_its_late_report_arrives():
    d = AffixDirectory()
    d.report("a", [("stored", "x", 5)], full=True)
    d.forget("a")
    assert d.report("a", [("stored", "y", 3)], {"hits": 1, "queries": 2}) is True  # late: ignored, nothing resent
    assert dict(d.held) == {} and "a" not in d.totals and d.snapshot()["replicas"] == {}
