"""One engine replica of a cluster: the single server's app over its own engine, reporting what its affix
cache stores, evicts and sees to the affix directory. A replica started with a shared ``affix_cache_dir``
loads the affixes saved there (a warm start) and reports them at once, so the router sends their
documents to it from its first request."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from ray import serve

from acache.cluster.forwarding import ForwardedRequest, ResponseStart, call_app

log = logging.getLogger("acache.cluster")
#: how long a stopping replica waits for its running reuse checks: well inside Serve's graceful shutdown (20 s by
#: default), which also covers the requests in flight, the engine thread's stop and the save
CHECKS_GRACE_S = 5.0
#: how long an answer's end, or a replica's start, waits for its report to the affix directory (the router's own
#: directory calls wait as long): past it the report goes on in the background, and the answer is not held
REPORT_WAIT_S = 1.0


@dataclass(frozen=True)
class ReplicaSettings:
    """What every replica is built from: the arguments of ``LLM`` and of the server's app."""

    model: str
    served_model_name: str
    directory: str
    namespace: str
    llm: dict = field(default_factory=dict)  # LLM keyword arguments
    app: dict = field(default_factory=dict)  # create_app keyword arguments
    affix_cache_dir: str | None = None
    threads: int | None = None


class EngineReplica:
    def __init__(self, settings: ReplicaSettings) -> None:
        from acache import LLM
        from acache.server.app import create_app

        if settings.threads:
            torch.set_num_threads(settings.threads)
        cache_dir = Path(settings.affix_cache_dir) if settings.affix_cache_dir else None
        warm = cache_dir is not None and cache_dir.is_dir()
        self.llm = LLM(settings.model, affix_cache_dir=cache_dir if warm else None, affix_cache_quarantine=True,
                       **settings.llm)
        self.app = create_app(self.llm, settings.served_model_name, affix_cache_dir=cache_dir, **settings.app)
        self.cache_dir = cache_dir
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        affixes = self.llm.engine.affixes
        self._events: collections.deque = collections.deque()
        self._full = True  # the next report names every affix held: the first, and the one after a lost report
        affixes.listeners.append(lambda e: self._events.append((e.kind, e.key, e.num_tokens)))
        self.app.state.affixer.listeners.append(lambda key, n: self._events.append(("seen", key, n)))
        self._directory_name, self._namespace = settings.directory, settings.namespace
        self._started = False
        self._late_flushes: set[asyncio.Task] = set()
        if len(affixes):
            log.warning("replica %s loaded %d shared affixes from %s", self.replica_id, len(affixes), cache_dir)
        self._directory = None
        try:  # before its first request: the router knows at once what it holds
            ray.get(self._report(self._taken()), timeout=REPORT_WAIT_S)
        except Exception as exc:  # the directory is down: the replica serves, and reports in full once it is back
            self._full = True
            log.warning("replica %s could not report to the affix directory: %s", self.replica_id, exc)

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose engine stopped serving (its thread ended, or its ranks no
        longer agree) is replaced, and is not ready meanwhile. A step that failed its requests while the engine
        served on is not such a fault, as the single server's /health says: replacing the replica for it would lose
        its affix cache, and a client resending a request that fails a step could take every replica down in turn."""
        dead = self.app.state.engine.dead
        if dead is not None:
            raise RuntimeError(f"the engine of replica {self.replica_id} failed: {type(dead).__name__}: {dead}")

    def _taken(self) -> list[tuple[str, str, int]]:
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events

    def _report(self, events: list[tuple[str, str, int]]):
        """Sends ``events`` (those since the last report), and the cumulative hit counts, to the directory; a full
        report (``self._full``) names every affix held instead of the stored and evicted events. Returns the call,
        whose answer says whether the directory knows this replica."""
        full, self._full = self._full, False
        sent = events
        if full:  # the table copied in one C call, which no engine-thread store or eviction can interleave
            entries = list(self.llm.engine.affixes.entries.values())
            held = [("stored", h.key, len(h.token_ids)) for h in entries]
            sent = held + [e for e in events if e[0] == "seen"]
        stats = self.llm.engine.affixes.stats
        if self._directory is None:
            self._directory = ray.get_actor(self._directory_name, namespace=self._namespace)
        return self._directory.report.remote(self.replica_id, sent, {"hits": stats.hits, "queries": stats.queries},
                                             full)

    async def _flush(self) -> None:
        """Reports without failing the request it follows: a directory that is gone costs the router its map
        (it then routes by load), never an answer. A report that did not arrive puts its events back and makes
        the next one full, as does a directory that restarted empty."""
        events = self._taken()
        try:
            known = await self._report(events)
        except Exception as exc:
            self._events.extendleft(reversed(events))
            self._full, self._directory = True, None
            log.warning("replica %s could not report to the affix directory: %s", self.replica_id, exc)
            return
        if not known:
            self._full = True

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Serves one forwarded request; the directory hears of its affix events as the request ends, within
        ``REPORT_WAIT_S`` (those of the reuse checks it started, which can end later, when they end)."""
        if not self._started:
            self.app.state.engine.start()
            self._started = True
        if request.registered is not None:
            ids, messages, name = request.registered
            try:
                self.app.state.registry.register(list(ids), messages, name)
            except ValueError as exc:  # larger than this replica's registry: the app answers the unknown id
                log.warning("replica %s could not hold a registered affix: %s", self.replica_id, exc)
        try:
            async for item in call_app(self.app, request):
                yield item
        finally:
            await self._flush_within(REPORT_WAIT_S)
            checks = set(self.app.state.checks_running)
            if checks:  # a check can store the affix it computes after the answer: reported once it ends
                self._in_background(self._flush_after(checks))

    async def _flush_within(self, seconds: float) -> None:
        """Reports, waiting for the directory at most ``seconds``: one that is slow or restarting (it is retried for
        ever) holds no answer past that. The report goes on in the background; Ray runs a caller's calls to an
        actor in the order they were made, so a later report cannot overtake it."""
        await asyncio.wait({self._in_background(self._flush())}, timeout=seconds)

    def _in_background(self, report: Coroutine) -> asyncio.Task:
        """``report`` run as a task this replica holds until it ends (the loop keeps only a weak reference)."""
        task = asyncio.ensure_future(report)
        self._late_flushes.add(task)
        task.add_done_callback(self._late_flushes.discard)
        return task

    async def _flush_after(self, checks: set[asyncio.Task]) -> None:
        """Reports once ``checks`` have ended: what they stored after their answers went out."""
        await asyncio.wait(checks)
        await self._flush()

    def __del__(self) -> Coroutine[Any, Any, None] | None:
        """Ray Serve's graceful shutdown, after the requests in flight: let the reuse checks still running finish (a
        check outlives the answer it checks, and its request computes the shared affix the save is about to write),
        stop the engine thread, save the affixes and the registered ids to the shared directory. Serve calls it on
        the replica's event loop and awaits the coroutine it returns; collected anywhere else, it stops at once."""
        if getattr(self, "app", None) is None or getattr(self, "_stopping", False):  # not started, or stopped
            return None
        self._stopping = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop here to wait for the checks on
            self._stop_and_save()
            return None
        return self._stop_after_checks()

    async def _stop_after_checks(self) -> None:
        from acache.server.app import finish_checks

        await finish_checks(self.app.state.checks_running, CHECKS_GRACE_S)
        self._stop_and_save()

    def _stop_and_save(self) -> None:
        self.app.state.engine.shutdown()
        if self.cache_dir is not None:
            try:
                self.app.state.save_affixes()
            except Exception as exc:  # shutting down: say so, do not raise from __del__
                log.warning("replica %s could not save its affixes to %s: %s", self.replica_id, self.cache_dir, exc)
