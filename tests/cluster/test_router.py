"""The span-aware router's own records and a replica's reports, apart from Ray Serve: what they keep when a
try is rejected, a replica leaves, or the directory cannot be reached."""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")

from acache.cluster.replica import EngineReplica  # noqa: E402
from acache.cluster.router import SpanAwareRouter  # noqa: E402


def replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(unique_id=name)


def pending(request_id: str) -> SimpleNamespace:
    return SimpleNamespace(args=[SimpleNamespace(spans=(("doc", 40),))],
                           metadata=SimpleNamespace(internal_request_id=request_id))


def router() -> SpanAwareRouter:
    r = SpanAwareRouter.__new__(SpanAwareRouter)
    r._in_flight, r._done_early = {}, {}
    return r


def test_a_try_one_replica_rejected_does_not_cancel_the_record_of_the_retry():
    r = router()
    r.on_request_completed(replica("a"), "req-1")  # Serve ends the rejected try on a before routing the retry
    r.on_request_routed(pending("req-1"), replica("b"), None)
    assert r._in_flight["req-1"][0] == "b"  # counted as held by b while it runs
    r.on_request_completed(replica("b"), "req-1")
    assert r._in_flight == {}


def test_a_request_that_ends_before_its_routing_is_recorded_leaves_no_record():
    r = router()
    r.on_request_completed(replica("a"), "req-2")
    r.on_request_routed(pending("req-2"), replica("a"), None)
    assert r._in_flight == {} and r._done_early == {}


class Directory:
    """A directory that fails its first ``failures`` reports and records the others."""

    def __init__(self, failures: int, known: bool = True) -> None:
        self.failures, self.known, self.reports = failures, known, []
        self.report = SimpleNamespace(remote=self._remote)

    def _remote(self, replica_id, events, stats, full):
        async def answer():
            if self.failures:
                self.failures -= 1
                raise ConnectionError("directory gone")
            self.reports.append((list(events), full))
            return self.known
        return answer()


def fake_replica(directory: Directory, held: dict) -> EngineReplica:
    r = EngineReplica.__new__(EngineReplica)
    affixes = SimpleNamespace(entries=held, stats=SimpleNamespace(hits=0, queries=0))
    r.llm = SimpleNamespace(engine=SimpleNamespace(affixes=affixes))
    r.replica_id, r._events, r._full, r._directory = "r1", collections.deque(), False, directory
    return r


def test_a_lost_report_loses_no_event_and_the_next_one_is_full():
    directory = Directory(failures=1)
    held = {"x": SimpleNamespace(key="x", token_ids=(1, 2, 3))}
    r = fake_replica(directory, held)
    r._events.extend([("stored", "x", 3), ("seen", "s", 9)])
    asyncio.run(r._flush())  # fails: the events go back, the next report names every affix held
    assert list(r._events) == [("stored", "x", 3), ("seen", "s", 9)] and r._full
    r._directory = directory
    r._events.append(("evicted", "gone", 2))
    asyncio.run(r._flush())
    assert directory.reports == [([("stored", "x", 3), ("seen", "s", 9)], True)] and not r._full


def test_a_directory_that_does_not_know_the_replica_gets_a_full_report_next():
    directory = Directory(failures=0, known=False)
    r = fake_replica(directory, {})
    asyncio.run(r._flush())
    assert r._full


def test_a_family_without_shared_affixes_reads_as_an_empty_cache():
    from acache.engine.state_cache_manager import NoSharedAffixes

    table = NoSharedAffixes("ssm")
    table.listeners.append(print)
    assert list(table.entries.values()) == [] and len(table) == 0
