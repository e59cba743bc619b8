"""The engine lock is granted in turn: the engine thread, which asks for it again as soon as it releases it after
a step, cannot keep it from a request's add, a cancellation or a scoring forward waiting beside it."""

from __future__ import annotations

import threading

import pytest

from acache.server.async_engine import FairLock
from tests.server.helpers import wait_until


def waiting(lock: FairLock, tickets: int) -> bool:
    """Whether ``tickets`` tickets have been given out (their threads are waiting or hold the lock)."""
    return lock._next >= tickets


def test_the_lock_goes_to_its_askers_in_the_order_they_asked():
    lock, order = FairLock(), []

    def take(name: int) -> None:
        with lock:
            order.append(name)

    lock.acquire()
    threads = []
    for name in range(6):
        threads.append(threading.Thread(target=take, args=(name,)))
        threads[-1].start()
        assert wait_until(lambda n=name + 2: waiting(lock, n), 10, poll=0.005)  # each waits before the next asks
    lock.release()
    for t in threads:
        t.join(timeout=10)
    assert order == list(range(6))


def test_a_holder_that_asks_again_at_once_waits_for_the_one_already_waiting():
    """The engine thread's pattern: release after a step, ask again at once. A plain lock went back to it nearly
    every time; here the waiter goes first."""
    lock, order = FairLock(), []

    def other() -> None:
        with lock:
            order.append("other")

    lock.acquire()
    t = threading.Thread(target=other)
    t.start()
    assert wait_until(lambda: waiting(lock, 2), 10, poll=0.005)
    lock.release()
    with lock:
        order.append("engine")
    t.join(timeout=10)
    assert order == ["other", "engine"]


def test_a_waiter_that_gives_up_with_an_exception_passes_its_turn_on():
    lock, order = FairLock(), []
    real_wait = lock._turns.wait
    quitter = threading.Event()

    def wait(timeout: float | None = None) -> bool:
        if threading.current_thread().name == "quitter":
            raise KeyboardInterrupt
        return real_wait(timeout)

    lock._turns.wait = wait

    def quit_waiting() -> None:
        with pytest.raises(KeyboardInterrupt):
            lock.acquire()
        quitter.set()

    def take() -> None:
        with lock:
            order.append("after")

    lock.acquire()
    gives_up = threading.Thread(target=quit_waiting, name="quitter")
    gives_up.start()
    assert quitter.wait(10)
    after = threading.Thread(target=take)
    after.start()
    assert wait_until(lambda: waiting(lock, 3), 10, poll=0.005)
    lock.release()
    after.join(timeout=10)
    assert order == ["after"] and not after.is_alive()
    with lock:  # and the lock is free again
        pass
