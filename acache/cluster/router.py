"""The span-aware request router, on Ray Serve's ``RequestRouter`` API: each request carries the content
hashes of its affixes (the frontend extracts them as the single server does), the router asks the affix
directory which replica holds them and ranks the replicas by :func:`acache.cluster.affinity.rank_replicas`.
Requests routed but not finished count as held by their replica, so that a burst of requests for a new
document lands on one replica before its first one has been admitted."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import ray
from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import RequestRouter

from acache.cluster.affinity import Balance, rank_replicas

log = logging.getLogger("acache.cluster")
DIRECTORY_TIMEOUT_S = 1.0  # a slow directory costs a request its affinity, not its latency
IN_FLIGHT_TTL_S = 600.0  # a routed request not reported finished by then is forgotten


def request_spans(pending: PendingRequest | None) -> dict[str, int]:
    """The affix spans (content hash -> tokens) the frontend attached to a forwarded request."""
    if pending is None or not pending.args:
        return {}
    return dict(getattr(pending.args[0], "spans", ()) or ())


class SpanAwareRouter(RequestRouter):
    """Each pending request is matched to the replica chosen for it (by request id), not to the oldest one."""

    def initialize_state(self, directory: str, namespace: str, balance_absolute: int = 64,
                         balance_relative: float = 1.5) -> None:
        self._directory_name, self._namespace = directory, namespace
        self._directory = None
        self._balance = Balance(balance_absolute, balance_relative)
        self._in_flight: dict[str, tuple[str, dict[str, int], float]] = {}  # request id -> (replica, spans, since)
        # (request, replica) that finished before its routing was recorded (a try the replica rejected ends before
        # the retry is routed elsewhere: only a completion from the replica routed to cancels the record)
        self._done_early: dict[tuple[str, str], float] = {}

    @property
    def directory(self):
        if self._directory is None:
            self._directory = ray.get_actor(self._directory_name, namespace=self._namespace)
        return self._directory

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Queue lengths the replicas reported (cached or probed); a replica that did not answer is absent."""
        loads: dict[str, int] = {}
        unknown = []
        for r in replicas:
            cached = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if cached is None:
                unknown.append(r)
            else:
                loads[r.replica_id.unique_id] = cached
        for r, queue_len in await self._probe_queue_lens(unknown, 0) if unknown else []:
            if queue_len is not None:
                loads[r.replica_id.unique_id] = queue_len
        return loads

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_id:
            return []
        if pending_request is not None:  # every replica is offered: a pass they all refuse waits before the next
            pending_request.routing_context.should_backoff = True
        try:
            order = await self._rank(by_id, request_spans(pending_request))
        except Exception as exc:  # a routing fault must not strand the request: any replica will do
            log.warning("span-aware routing failed (%s: %s); trying every replica", type(exc).__name__, exc)
            return [candidate_replicas]
        return [[by_id[r]] for r in order]

    async def _rank(self, by_id: dict[str, RunningReplica], spans: dict[str, int]) -> list[str]:
        loads = await self._loads(list(by_id.values()))
        holdings = {}
        if spans:
            self._expire()
            in_flight: dict[str, dict[str, int]] = defaultdict(dict)
            for replica, theirs, _ in self._in_flight.values():
                in_flight[replica].update(theirs)
            try:
                holdings = await asyncio.wait_for(
                    self.directory.holdings.remote(spans, list(by_id), dict(in_flight)), DIRECTORY_TIMEOUT_S)
            except (ray.exceptions.RayError, ValueError, asyncio.TimeoutError) as exc:
                log.warning("affix directory unavailable (%s); routing by load", exc)
        answered = [r for r in by_id if r in loads]
        silent = [r for r in by_id if r not in loads]  # no queue length: tried last, never "the least loaded"
        return rank_replicas(answered, loads, holdings, self._balance) + silent

    def _expire(self) -> None:
        cutoff = time.monotonic() - IN_FLIGHT_TTL_S
        self._in_flight = {k: v for k, v in self._in_flight.items() if v[2] >= cutoff}
        self._done_early = {k: t for k, t in self._done_early.items() if t >= cutoff}

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        spans = request_spans(pending_request)
        request_id = pending_request.metadata.internal_request_id
        if spans and self._done_early.pop((request_id, replica_id.unique_id), None) is None:
            self._in_flight[request_id] = (replica_id.unique_id, spans, time.monotonic())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        entry = self._in_flight.get(internal_request_id)
        if entry is None:
            self._done_early[(internal_request_id, replica_id.unique_id)] = time.monotonic()
            while len(self._done_early) > 4096:  # most are requests without spans, never routed by them
                del self._done_early[next(iter(self._done_early))]
        elif entry[0] == replica_id.unique_id:  # not a rejected earlier try of the same request
            del self._in_flight[internal_request_id]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new set of replicas: those that left it (replaced after a failed health check, on a redeploy or
        a scale-down, which never reach :meth:`on_replica_actor_died`) are forgotten too."""
        before = {r.unique_id for r in getattr(self, "_replica_id_set", set())}
        super().update_replicas(replicas)
        for gone in before - {r.replica_id.unique_id for r in replicas}:
            self._forget(gone)

    def _forget(self, replica: str) -> None:
        self._in_flight = {k: v for k, v in self._in_flight.items() if v[0] != replica}
        try:
            self.directory.forget.remote(replica)
        except (ray.exceptions.RayError, ValueError) as exc:
            log.warning("could not tell the affix directory that replica %s left: %s", replica, exc)
