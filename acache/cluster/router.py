"""The span-aware request router, on Ray Serve's ``RequestRouter`` API: each request carries the content
hashes of its affixes (the frontend extracts them as the single server does), the router asks the affix
directory which replica holds them and ranks the replicas by :func:`acache.cluster.routing.rank_replicas`.
Requests routed but not finished count as held by their replica, so that a burst of requests for a new
document lands on one replica before its first one has been admitted."""

from __future__ import annotations

import logging
from collections import defaultdict

import ray
from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter

from acache.cluster.routing import Balance, rank_replicas

log = logging.getLogger("acache.cluster")


def request_spans(pending: PendingRequest | None) -> dict[str, int]:
    """The affix spans (content hash -> tokens) the frontend attached to a forwarded request."""
    if pending is None or not pending.args:
        return {}
    return dict(getattr(pending.args[0], "spans", ()) or ())


class SpanAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, directory: str, namespace: str, balance_absolute: int = 64,
                         balance_relative: float = 1.5) -> None:
        self._directory_name, self._namespace = directory, namespace
        self._directory = None
        self._balance = Balance(balance_absolute, balance_relative)
        self._in_flight: dict[str, tuple[str, dict[str, int]]] = {}  # request id -> (replica, spans)

    @property
    def directory(self):
        if self._directory is None:
            self._directory = ray.get_actor(self._directory_name, namespace=self._namespace)
        return self._directory

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
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
        spans = request_spans(pending_request)
        loads = await self._loads(candidate_replicas)
        in_flight: dict[str, dict[str, int]] = defaultdict(dict)
        for replica, theirs in self._in_flight.values():
            in_flight[replica].update(theirs)
        holdings = {}
        try:
            if spans:
                holdings = await self.directory.holdings.remote(spans, list(by_id), dict(in_flight))
        except ray.exceptions.RayError as exc:  # without the map, route by load rather than fail the request
            log.warning("affix directory unavailable (%s); routing by load", exc)
        order = rank_replicas(list(by_id), loads, holdings, self._balance)
        return [[by_id[r]] for r in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        spans = request_spans(pending_request)
        if spans:
            self._in_flight[pending_request.metadata.internal_request_id] = (replica_id.unique_id, spans)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        dead = replica_id.unique_id
        self._in_flight = {k: v for k, v in self._in_flight.items() if v[0] != dead}
        try:
            self.directory.forget.remote(dead)
        except ray.exceptions.RayError as exc:
            log.warning("could not tell the affix directory that replica %s died: %s", dead, exc)
