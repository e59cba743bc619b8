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


def test_a_replica_whose_engine_served_past_a_failed_step_stays_healthy():
    """Serve replaces a replica whose health check raises, and its affix cache goes with it: a step that failed its
    requests while the engine served on (a client's batch out of memory) is not that, as the single server's
    /health says; an engine thread that stopped, or ranks that no longer agree, are."""
    r = EngineReplica.__new__(EngineReplica)
    r.replica_id = "r1"
    engine = SimpleNamespace(error=MemoryError("a batch out of memory"), dead=None)
    r.app, r._stopping = SimpleNamespace(state=SimpleNamespace(engine=engine)), True  # no shutdown at collection
    r.check_health()
    engine.dead = RuntimeError("the engine thread stopped")
    with pytest.raises(RuntimeError, match="the engine of replica r1 failed: RuntimeError"):
        r.check_health()


def test_an_answer_waits_for_a_slow_directory_no_longer_than_the_bound(monkeypatch):
    """A directory that is restarting (retried for ever) or slow used to hold the end of every answer; now the
    answer ends within the bound, and the report still arrives, in the background."""
    monkeypatch.setattr("acache.cluster.replica.REPORT_WAIT_S", 0.2)
    arrived = []

    class Slow:
        def _remote(self, replica_id, events, stats, full):
            async def answer():
                await asyncio.sleep(1.0)
                arrived.append(list(events))
                return True
            return answer()

        report = SimpleNamespace()

    directory = Slow()
    directory.report = SimpleNamespace(remote=directory._remote)
    r = fake_replica(directory, {})
    r._started, r._late_flushes, r._stopping = True, set(), True
    r.app = SimpleNamespace(state=SimpleNamespace(checks_running=set(), registry=None))

    async def answer(app, request):
        yield b"the answer"

    monkeypatch.setattr("acache.cluster.replica.call_app", answer)
    r._events.append(("stored", "x", 3))

    async def run():
        began = asyncio.get_running_loop().time()
        got = [item async for item in r.handle(SimpleNamespace(registered=None))]
        ended = asyncio.get_running_loop().time() - began
        await asyncio.gather(*r._late_flushes)
        return got, ended

    got, ended = asyncio.run(run())
    assert got == [b"the answer"] and ended < 0.8
    assert arrived == [[("stored", "x", 3)]] and not r._late_flushes



def test_a_routing_pass_every_replica_refused_backs_off_before_the_next():
    """The span router offers every replica in its order; Serve sleeps between passes only when the router says so,
    and without it a cluster whose replicas were all full re-ranked (and asked the directory) in a tight loop."""
    r = router()

    async def rank(by_id, spans):
        return list(by_id)

    r._rank = rank
    request = pending("req-3")
    request.routing_context = SimpleNamespace(should_backoff=False)
    replicas = [SimpleNamespace(replica_id=replica(name)) for name in ("a", "b")]
    order = asyncio.run(r.choose_replicas(replicas, request))
    assert [[x.replica_id.unique_id for x in group] for group in order] == [["a"], ["b"]]
    assert request.routing_context.should_backoff is True
