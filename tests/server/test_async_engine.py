"""The engine lock is granted in turn: the engine thread, which asks for it again as soon as it releases it after
a step, cannot keep it from a request's add, a cancellation or a scoring forward waiting beside it."""

from __future__ import annotations

import threading
import time

import pytest

from acache.server.async_engine import FairLock
from tests.server.helpers import wait_until


def waiting(lock: FairLock, tickets: int) -> bool:
    """Whether ``tickets`` tickets have been given out (their threads are waiting or hold the lock)."""
    return lock.issued >= tickets


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


def test_a_request_finished_by_a_step_that_then_faults_still_gets_its_answer(llada_dir, monkeypatch):
    """A fault of the machine fails every request the engine still holds; one the same step had finished just
    before is no longer there, and still gets its output instead of waiting for ever."""
    import asyncio

    from acache import LLM, SamplingParams
    from acache.engine import Status
    from acache.engine.scheduler import Scheduler
    from acache.server.async_engine import AsyncEngine, EngineFailed

    llm = LLM(llada_dir, kv_cache_memory=1 << 22)
    real = Scheduler._commit

    def commit(self, req, sample, probe=False):
        if req.params.gen_length == 16 and any(r.params.gen_length == 2 and r.status is Status.FINISHED
                                               for r in done):
            raise MemoryError("out of memory")
        out = real(self, req, sample, probe)
        done.append(req)
        return out

    done: list = []
    monkeypatch.setattr(Scheduler, "_commit", commit)
    engine = AsyncEngine(llm.engine)
    prompt = llm.encode_prompt([5, 6, 7])

    async def final(params: SamplingParams):
        return [o async for o in engine.generate(prompt, params)][-1]

    async def both():
        return await asyncio.wait_for(asyncio.gather(
            final(SamplingParams(gen_length=2, block_length=2)), final(SamplingParams(gen_length=16, block_length=2)),
            return_exceptions=True), 30)

    engine.start()
    try:
        short, long = asyncio.run(both())
    finally:
        engine.shutdown()
    assert short.status is Status.FINISHED and short.finished
    assert isinstance(long, EngineFailed) and "out of memory" in str(long)


def test_abandoned_and_refused_requests_leave_nothing_behind(llada_dir):
    """A request refused at its add, one whose caller stops reading early and one read to its end: once the
    engine is idle no id is kept (an id aborted after its add ran was kept for good before)."""
    import asyncio

    from acache import LLM, SamplingParams
    from acache.server.async_engine import AsyncEngine

    llm = LLM(llada_dir, kv_cache_memory=1 << 22)
    engine = AsyncEngine(llm.engine)
    prompt = llm.encode_prompt([5, 6, 7])

    async def run() -> None:
        with pytest.raises(ValueError, match="gen_length"):  # refused by the engine's own check at its add
            [o async for o in engine.generate(prompt, SamplingParams(gen_length=10 ** 6))]
        async for out in engine.generate(prompt, SamplingParams(gen_length=16, block_length=4), stream=True):
            assert not out.finished
            break  # the caller leaves after the first block
        async for out in engine.generate(prompt, SamplingParams(gen_length=4, block_length=4)):
            assert out.finished
        for _ in range(100):
            if not llm.engine.has_unfinished() and engine._aborts.empty():
                break
            await asyncio.sleep(0.05)

    engine.start()
    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert engine._cancelled == set() and not llm.engine.has_unfinished()


def test_a_loop_that_fails_outside_a_step_tells_every_caller_and_refuses_new_ones(llada_dir, monkeypatch):
    """The engine thread failing outside a step (an abort that raises, say) used to end it silently: the callers
    waited for ever. Now each gets the error, and a later request is refused at once."""
    import asyncio

    from acache import LLM, SamplingParams
    from acache.server.async_engine import AsyncEngine, EngineFailed

    llm = LLM(llada_dir, kv_cache_memory=1 << 22)
    engine = AsyncEngine(llm.engine)
    prompt = llm.encode_prompt([5, 6, 7])

    def broken_aborts() -> None:
        if llm.engine.has_unfinished():
            raise RuntimeError("released more often than acquired")

    monkeypatch.setattr(engine, "_process_aborts", broken_aborts)

    async def ask():
        return [o async for o in engine.generate(prompt, SamplingParams(gen_length=16, block_length=4))]

    async def run():
        first = await asyncio.wait_for(asyncio.gather(ask(), return_exceptions=True), 30)
        return first[0], await asyncio.wait_for(asyncio.gather(ask(), return_exceptions=True), 30)

    engine.start()
    try:
        (first, (later,)) = asyncio.run(run())
    finally:
        engine.shutdown()
    assert isinstance(first, EngineFailed) and "released more often" in str(first)
    assert isinstance(later, EngineFailed) and "the engine thread has stopped" in str(later)
    assert engine.stopped and engine.error is engine.dead


def test_a_request_a_fault_drops_from_the_engine_without_an_output_is_told(llada_dir, monkeypatch):
    """A fault of the machine inside a request's finish (its pages freed, no output made): the request is no
    longer in the engine, so failing what the engine holds would miss it; its caller is told all the same."""
    import asyncio

    from acache import LLM, SamplingParams
    from acache.engine.scheduler import Scheduler
    from acache.server.async_engine import AsyncEngine, EngineFailed

    llm = LLM(llada_dir, kv_cache_memory=1 << 22)
    real = Scheduler.finish

    def finish(self, req, status=None, **kwargs):
        real(self, req, *(() if status is None else (status,)))
        raise MemoryError("out of memory while freeing")

    monkeypatch.setattr(Scheduler, "finish", finish)
    engine = AsyncEngine(llm.engine)

    async def ask():
        params = SamplingParams(gen_length=4, block_length=4)
        return [o async for o in engine.generate(llm.encode_prompt([5, 6, 7]), params)]

    async def run():
        return (await asyncio.wait_for(asyncio.gather(ask(), return_exceptions=True), 30))[0]

    engine.start()
    try:
        told = asyncio.run(run())
    finally:
        engine.shutdown()
    assert isinstance(told, EngineFailed) and "out of memory while freeing" in str(told)


def test_a_request_waiting_to_be_added_during_a_failing_step_is_served_after_it(llada_dir, monkeypatch):
    """A step that fails fails the requests it held. A request whose add waited for the lock behind that step was
    told of the fault as well, then added all the same: a spurious error, and its request decoded to the end for
    nobody. Now it is served, with the tokens it gets alone, and nothing is left running."""
    import asyncio

    from acache import LLM, SamplingParams
    from acache.engine import LLMEngine
    from acache.server.async_engine import AsyncEngine, EngineFailed

    llm = LLM(llada_dir, kv_cache_memory=1 << 22)
    real = LLMEngine.step
    entered = threading.Event()
    faults = []

    def step(self):
        if not faults:
            faults.append(1)
            entered.set()
            time.sleep(0.5)  # the second request's add arrives and waits for the lock
            raise MemoryError("out of memory (once)")
        return real(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    engine = AsyncEngine(llm.engine)
    first, second = llm.encode_prompt([5, 6, 7]), llm.encode_prompt([9, 8, 7, 6])
    params = SamplingParams(gen_length=8, block_length=4)

    async def final(prompt, wait):
        if wait:
            await asyncio.to_thread(entered.wait, 10)
        return [o async for o in engine.generate(prompt, params)][-1]

    async def both():
        return await asyncio.wait_for(asyncio.gather(final(first, False), final(second, True),
                                                     return_exceptions=True), 30)

    engine.start()
    try:
        failed, served = asyncio.run(both())
    finally:
        engine.shutdown()
    assert isinstance(failed, EngineFailed) and "out of memory" in str(failed)
    assert not isinstance(served, BaseException), served
    monkeypatch.setattr(LLMEngine, "step", real)
    alone = llm.generate(second, params, use_tqdm=False)[0]
    assert served.token_ids == alone.token_ids and not llm.engine.has_unfinished() and engine._added == set()


def test_a_second_app_on_a_served_llm_is_refused_and_leaves_the_first_serving():
    """Two apps over one LLM each ran an engine thread under its own lock: the first's, polling, stepped the second's
    requests beside it (a request committed twice failed with a shape error in CI) and dropped their outputs."""
    from fastapi.testclient import TestClient

    from acache import LLM
    from acache.paths import default_model
    from acache.server.app import create_app

    llm = LLM(default_model(), kv_cache_memory=1 << 24)
    body = {"prompt": "where is mary ?", "max_tokens": 2}
    with TestClient(create_app(llm, "tiny")) as first:
        second = TestClient(create_app(llm, "tiny"))
        with pytest.raises(RuntimeError, match="this LLM is already being served by another app"):
            second.__enter__()
        second.app.state.close()  # as the CLI closes an app: the engine is not its own to stop, save or close
        assert llm.engine.served and not first.app.state.engine.stopped
        assert first.post("/v1/completions", json=body).status_code == 200
    assert not llm.engine.served
    with TestClient(create_app(llm, "tiny")) as second:  # once the first has stopped, another may serve it
        assert second.post("/v1/completions", json=body).status_code == 200
