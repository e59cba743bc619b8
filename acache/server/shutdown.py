"""Bounded shutdown: in-flight work gets a grace period, then is cancelled with a clean error.

A server asked to stop (SIGTERM) stops accepting connections and lets the requests it holds finish; a long
one (an ``echo`` + ``logprobs`` request with 1024 Monte Carlo draws takes minutes) must not hold the process
up for ever. :meth:`Drain.begin` starts the grace period; when it ends every request still decoding is
aborted and every scoring job stopped between two batches, and each gets :class:`ShuttingDown` (a 503).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ShuttingDown(RuntimeError):
    """The server shut down while this request was in flight: 503, and the client may retry elsewhere."""


class Drain:
    """``on_expire(exc)`` cancels the engine's requests; scoring jobs register their cancel events here."""

    def __init__(self, on_expire: Callable[[ShuttingDown], None]) -> None:
        self.on_expire = on_expire
        self.started = False
        self.expired: ShuttingDown | None = None
        self._cancels: set[threading.Event] = set()
        # reentrant: uvicorn calls begin() from a Python signal handler, which runs on the main thread between two
        # bytecodes, possibly while that thread is inside track() or remaining() holding this lock
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None
        self._deadline: float | None = None  # time.monotonic() when the grace period ends

    def begin(self, grace_s: float) -> None:
        """Starts the grace period (once; a second signal does not extend it)."""
        if grace_s < 0:
            raise ValueError(f"the shutdown grace period must be >= 0 seconds, got {grace_s}")
        with self._lock:
            if self.started:
                return
            self.started = True
            self._deadline = time.monotonic() + grace_s
            self._timer = threading.Timer(grace_s, self.expire, args=(
                f"the server shut down: this request was still running {grace_s:g} s after the shutdown began "
                "(--shutdown-grace)",))
            self._timer.daemon = True
            self._timer.start()

    def remaining(self) -> float:
        """Seconds of the grace period left: 0 before it starts (a shutdown no signal began waits for nothing)
        and once it has ended."""
        with self._lock:
            if self._deadline is None or self.expired is not None:
                return 0.0
            return max(0.0, self._deadline - time.monotonic())

    def expire(self, message: str = "the server shut down while this request was in flight") -> None:
        """Cancels everything still in flight, now (also at the end of the app's lifespan)."""
        with self._lock:
            if self.expired is not None:
                return
            self.expired = ShuttingDown(message)
            cancels = list(self._cancels)
            if self._timer is not None:
                self._timer.cancel()
        for cancel in cancels:
            cancel.set()
        self.on_expire(self.expired)

    def track(self, cancel: threading.Event) -> None:
        """A scoring job's cancel event: set when the grace period ends (at once if it has ended)."""
        with self._lock:
            self._cancels.add(cancel)
            expired = self.expired is not None
        if expired:
            cancel.set()

    def untrack(self, cancel: threading.Event) -> None:
        with self._lock:
            self._cancels.discard(cancel)
