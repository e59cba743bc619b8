"""Runs the engine in one background thread and hands its outputs to asyncio request handlers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue as queue_module
import threading
from collections.abc import AsyncIterator

import torch

from acache.affix.prompt import AffixPrompt
from acache.engine import EngineOutput, LLMEngine, Status
from acache.engine.parallel import RankFault
from acache.sampling_params import SamplingParams
from acache.server.shutdown import ShuttingDown

log = logging.getLogger("acache.server")


class RequestFailed(RuntimeError):
    """The engine failed this request alone (the others in flight go on)."""


class EngineFailed(RuntimeError):
    """The engine itself failed (out of memory, a device error): every request in flight fails."""


class FairLock:
    """A lock granted in the order it was asked for (a ticket lock). The engine thread releases the engine's lock
    after each step and asks for it again at once; a plain ``threading.Lock`` then goes back to it nearly every
    time, and a request's add, a cancellation or a scoring forward waiting beside it waited for seconds (3 s and
    11 s measured behind one long request). Not reentrant."""

    def __init__(self) -> None:
        self._turns = threading.Condition(threading.Lock())
        self.issued = 0  # tickets given out, in order: the next one is this
        self._serving = 0  # the ticket that holds the lock
        self._abandoned: set[int] = set()  # tickets whose holder gave up waiting (an exception): skipped

    def acquire(self) -> None:
        with self._turns:
            ticket = None
            try:
                ticket, self.issued = self.issued, self.issued + 1
                while ticket != self._serving:
                    self._turns.wait(timeout=1.0)  # a wake-up an interrupt swallowed costs a second, not for ever
            except BaseException:  # e.g. KeyboardInterrupt while waiting: the turn is passed on, never kept
                if ticket == self._serving:
                    self._pass_turn()
                elif ticket is not None:
                    self._abandoned.add(ticket)
                raise

    def release(self) -> None:
        with self._turns:
            self._pass_turn()

    def _pass_turn(self) -> None:
        self._serving += 1
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._turns.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class AsyncEngine:
    """The engine is not thread-safe: every call into it holds ``lock`` (granted in turn: :class:`FairLock`);
    the loop thread steps it while it has work and sleeps on ``wake`` otherwise."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.lock = FairLock()
        self.wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = False
        self._aborts: queue_module.SimpleQueue[str] = queue_module.SimpleQueue()
        self._cancelled: set[str] = set()  # aborted before (or while) being added
        self._added: set[str] = set()  # added to the engine, their callers still reading (under _added_lock)
        self._added_lock = threading.Lock()  # a few set operations: never held across anything slow
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.closed: ShuttingDown | None = None  # set once in-flight work was cancelled by a shutdown
        self.dead: BaseException | None = None  # what stopped the engine thread (or its ranks), if not a shutdown

    def start(self) -> None:
        """Starts the engine thread. Refused while another app's thread steps the same engine: the two would step it
        at once under two locks (a request committed twice), and each would drop the other's outputs."""
        if self._thread is None:
            if self.engine.served:
                raise RuntimeError("this LLM is already being served by another app (its engine thread steps the "
                                   "engine, which is not thread-safe): serve one app per LLM, or stop the other "
                                   "first")
            self.engine.served = True  # LLM.generate refuses to step it beside the loop
            self._thread = threading.Thread(target=self._loop, name="acache-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self.wake.set()
        if self._thread is not None:  # one refused at its start leaves the other app's engine served
            self._thread.join(timeout=10)
            if not self._thread.is_alive():  # a thread still stepping keeps the engine its own
                self.engine.served = False

    @property
    def started(self) -> bool:
        """This engine's thread was started (false for one whose start was refused)."""
        return self._thread is not None

    @property
    def stopped(self) -> bool:
        """No engine thread is running (it never started, or it has exited)."""
        return self._thread is None or not self._thread.is_alive()

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # the loop itself failed (outside a step): no caller may wait for it
            self.error = self.dead = exc
            log.exception("the engine thread stopped; every request in flight fails, and every later one")
            for request_id in list(self._queues):
                self._deliver(request_id, exc)

    def _serve(self) -> None:
        while not self._stop:
            with self.lock:
                self._process_aborts()
                busy = self.engine.has_unfinished()
                outputs: list[tuple[str, EngineOutput | BaseException]] = []
                if busy:
                    try:
                        outputs = [(out.request_id, out) for out in self.engine.step()]
                    except BaseException as exc:  # keep serving: fail the requests in flight, not the server
                        self.error = exc
                        if isinstance(exc, RankFault):  # but the ranks no longer agree: nothing more is served
                            self.dead = exc
                        # those the step finished before the fault first: they are no longer in the engine
                        outputs = [(out.request_id, out) for out in self.engine.take_undelivered()]
                        outputs += self._fail_all(exc)
                        # and any other request added (one a fault dropped from the engine without an output): a
                        # caller that got its final output already stops reading before this error. A request whose
                        # add still waits for the lock was not in this step: it is added and served after it
                        told = {request_id for request_id, _ in outputs}
                        with self._added_lock:
                            added = list(self._added)
                        outputs += [(request_id, exc) for request_id in added if request_id not in told]
            for request_id, item in outputs:
                self._deliver(request_id, item)
            if not busy:
                self.wake.wait(timeout=0.5)
                self.wake.clear()

    def _process_aborts(self) -> None:
        """Aborts what callers gave up on (under the lock); an id not in the engine yet stays cancelled, so
        that its add, still waiting for the lock, is dropped."""
        while not self._aborts.empty():
            request_id = self._aborts.get()
            if self.engine.abort(request_id):
                self._cancelled.discard(request_id)
            with self._added_lock:  # an add that ran after its caller left added the id once the caller had gone
                self._added.discard(request_id)

    def cancel_all(self, exc: ShuttingDown) -> None:
        """Aborts every request in flight and tells each of ``exc``; a request added later is refused with it."""
        self.closed = exc
        with self.lock:
            failed = self._fail_all(exc)
        for request_id, item in failed:
            self._deliver(request_id, item)
        self.wake.set()

    def _fail_all(self, exc: BaseException) -> list[tuple[str, BaseException]]:
        """Aborts every request in the engine; each of them is then told of ``exc``."""
        failed = []
        for request_id in self.engine.request_ids():
            self.engine.abort(request_id)
            failed.append((request_id, exc))
        return failed

    def _deliver(self, request_id: str, item: EngineOutput | BaseException) -> None:
        target = self._queues.get(request_id)
        if target is not None:
            loop, queue = target
            with contextlib.suppress(RuntimeError):  # that caller's event loop is closed: nobody waits there
                loop.call_soon_threadsafe(queue.put_nowait, item)

    def _add(self, prompt: AffixPrompt, params: SamplingParams, request_id: str, stream: bool,
             generator: torch.Generator | None) -> None:
        with self.lock:
            if request_id in self._cancelled:  # its caller went away while this waited for the lock
                self._cancelled.discard(request_id)
                return
            if self.closed is not None:
                raise self.closed
            if self.dead is not None:
                what = "serves no more requests" if isinstance(self.dead, RankFault) else "thread has stopped"
                raise EngineFailed(f"the engine {what}: {type(self.dead).__name__}: {self.dead}")
            try:
                self.engine.add_request(prompt, params, request_id, generator, stream)
            except RankFault as exc:  # the ranks no longer agree: nothing more is served from them
                self.error = self.dead = exc
                raise EngineFailed(f"the engine failed: {exc}") from None
            with self._added_lock:
                self._added.add(request_id)
        self.wake.set()

    async def generate(self, prompt: AffixPrompt, params: SamplingParams, stream: bool = False,
                       generator: torch.Generator | None = None) -> AsyncIterator[EngineOutput]:
        """Adds a request and yields its outputs (partial ones with ``stream``) until it finishes. A caller
        that stops iterating (a client that disconnected) aborts the request and frees its pages."""
        request_id = f"srv-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        added: bool | None = None  # True once added, False once refused; None while the add may yet run
        try:
            try:
                await asyncio.to_thread(self._add, prompt, params, request_id, stream, generator)
            except asyncio.CancelledError:
                raise
            except BaseException:
                added = False
                raise
            added = True
            while True:
                item = await queue.get()
                if isinstance(item, ShuttingDown):
                    finished = True
                    raise item
                if isinstance(item, BaseException):
                    finished = True
                    raise EngineFailed(f"the engine failed while serving this request: {item}") from item
                finished = item.finished
                if item.status is Status.FAILED:
                    raise RequestFailed(f"the request failed: {item.error}")
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            with self._added_lock:
                self._added.discard(request_id)
            if not finished and added is not False:  # no await here: a cancelled task may not get to run another
                self.request_abort(request_id, added=bool(added))

    def request_abort(self, request_id: str, added: bool = False) -> None:
        """Asks the loop thread to abort a request (and free its pages) before its next step. Unless ``added``
        (its add has run), its add may still be waiting for the lock: it is remembered so that the add drops it (an
        add that had in fact just run leaves the id there, a few bytes)."""
        if not added:
            self._cancelled.add(request_id)
        self._aborts.put(request_id)
        self.wake.set()
