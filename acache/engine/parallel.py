"""One engine over tensor-parallel ranks. Every rank holds the same engine over its slice of the model (see
:mod:`acache.models.tensor_parallel`): the scheduler is deterministic, so ranks fed the same calls make the
same decisions and meet at the same collectives. Rank 0 is the engine a caller sees
(:class:`MirroredEngine`); each call that changes engine state is broadcast first on a gloo control group,
and the other ranks replay it (:func:`serve_rank`) until told to stop. After every call the ranks agree that
each ended it as rank 0 did: a fault on one rank alone (its memory, its device) would otherwise leave its engine
apart from rank 0's, and the next collective hanging or mixing other requests' tensors. Once they disagree, rank 0
sends no further call but ``stop``: a step's forward would meet the others at collectives of another batch."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from acache.models.tensor_parallel import TensorParallel

log = logging.getLogger("acache.parallel")
TIMEOUT = datetime.timedelta(minutes=10)  # a rank that stops answering fails the group instead of hanging it
#: the control channel waits between calls for as long as the server idles: a worker reading it must never time out
#: (a rank that dies closes its connection, which ends the wait at once)
CONTROL_TIMEOUT = datetime.timedelta(days=365)
#: the key a spawned rank sets in the group's store (suffixed with its rank) as it begins to join
_JOINING = "acache/joining/"
_POLL_S = 0.1  # how often rank 0 looks at the store and its ranks while they start


class Channel:
    """Rank 0's calls, broadcast to every rank as picklable tuples."""

    def __init__(self, group) -> None:
        self.group = group

    def send(self, call: tuple) -> None:
        dist.broadcast_object_list([call], src=0, group=self.group)

    def receive(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def agree_same(self, value: int) -> bool:
        """Whether every rank passed the same ``value`` (one all-reduce of it and its negation)."""
        t = torch.tensor([value, -value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t[0]) == -int(t[1])

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (a KV budget measured per device, say)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


STEP_OK, STEP_FAILED = 0, 1  # what each rank says of a call at the agreement after it


class RankFault(RuntimeError):
    """The ranks ended an engine call differently (one failed what the others ran): their engines no longer agree."""


class MirroredEngine:
    """Rank 0's view of the engine: ``add_request``, ``step`` and ``abort`` reach every rank; everything else
    (checks, queries, metrics) is read from rank 0's own engine. Once the ranks have ended a call differently,
    ``add_request`` and ``step`` raise :class:`RankFault` at once, sending nothing, and ``abort`` frees rank 0's
    request alone."""

    def __init__(self, engine, channel: Channel) -> None:
        self.engine = engine
        self.channel = channel
        self.fault: RankFault | None = None

    def add_request(self, prompt, params, request_id: str | None = None, generator: torch.Generator | None = None,
                    stream: bool = False) -> str:
        self._served()
        if generator is None:  # drawn here, once: a rank drawing its own unseeded noise would decode other tokens
            generator = params.generator(self.engine.model.device)
        state = generator.get_state() if generator is not None else None
        request_id = self.engine.add_request(prompt, params, request_id, generator, stream)
        self.channel.send(("add", prompt, params, request_id, state, stream))
        try:
            self._agree(STEP_OK)
        except RankFault:  # its caller never learns its id: it is freed here
            self.engine.abort(request_id)
            raise
        return request_id

    def step(self):
        """Every rank's step; raises :class:`RankFault` (at every later call too) once the ranks have ended a call
        differently, rather than serving from engines that no longer agree."""
        self._served()
        self.channel.send(("step",))
        try:
            outputs = self.engine.step()
        except Exception as exc:  # not a Ctrl-C: the others may wait inside a collective, and are terminated instead
            with contextlib.suppress(Exception):  # the others wait to agree; a rank gone cannot, and that is known
                self._agree(STEP_FAILED)
            if self.fault is not None:  # rank 0 alone failed it: the ranks no longer agree, which its caller must hear
                raise self.fault from exc
            raise
        self._agree(STEP_OK)
        return outputs

    def abort(self, request_id: str) -> bool:
        found = self.engine.abort(request_id)
        if found and self.fault is None:
            self.channel.send(("abort", request_id))
            self._agree(STEP_OK)
        return found

    def _served(self) -> None:
        if self.fault is not None:
            raise self.fault

    def _agree(self, outcome: int) -> None:
        if not self.channel.agree_same(outcome):
            self.fault = RankFault("the tensor-parallel ranks ended an engine call differently (one failed what the "
                                   "others ran; the ranks' logs say which and why): they no longer hold the same "
                                   "engine, so no call is served from them; restart the server")
            raise self.fault

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def serve_rank(engine, channel: Channel) -> None:
    """A rank other than 0: replays rank 0's engine calls until it sends ``stop``. A call that raises here
    raised on rank 0 too where it is the engine's (the same deterministic engine: rank 0 fails its requests and
    sends the aborts, and the ranks go on together), or here alone where it is this rank's. After each call the
    ranks compare how it ended; once they differ, rank 0 sends nothing but ``stop``."""
    while True:
        call = channel.receive()
        if call[0] == "stop":
            return
        outcome = STEP_OK
        try:
            _replay(engine, call)
        except Exception as exc:
            outcome = STEP_FAILED
            log.error("rank %d: engine call %r raised %s: %s", dist.get_rank(), call[0], type(exc).__name__, exc)
        if not channel.agree_same(outcome):
            log.error("rank %d: engine call %r ended otherwise on another rank; waiting for the stop",
                      dist.get_rank(), call[0])


def _replay(engine, call: tuple) -> None:
    if call[0] == "add":
        _, prompt, params, request_id, state, stream = call
        generator = None
        if state is not None:
            generator = torch.Generator(engine.model.device)
            generator.set_state(state)
        engine.add_request(prompt, params, request_id, generator, stream)
    elif call[0] == "step":
        engine.step()
    elif call[0] == "abort":
        engine.abort(call[1])
    else:
        raise RuntimeError(f"unknown engine call {call[0]!r} from rank 0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world_size: int, init_method: str, backend: str) -> tuple[TensorParallel, Channel]:
    """Joins the group (``backend`` for the model's collectives, gloo for the control channel). A rank past 0
    first says it has come (:func:`start` watches for it)."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    host, port = _address(init_method)
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=TIMEOUT)
    store.set(f"{_JOINING}{rank}", "1")
    return _joined(store, rank, world_size, backend)


def _joined(store, rank: int, world_size: int, backend: str) -> tuple[TensorParallel, Channel]:
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(rank, world_size), Channel(control)


def _address(init_method: str) -> tuple[str, int]:
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def leave() -> None:
    """Leaves the group, so that this process can build another tensor-parallel LLM later."""
    if dist.is_initialized():
        dist.destroy_process_group()


def start(world_size: int, device: torch.device, worker: Callable, worker_args: tuple
          ) -> tuple[TensorParallel, Channel, list]:
    """Spawns ranks 1..world_size-1 running ``worker(rank, world_size, init_method, backend, *worker_args)``
    and joins the group as rank 0, once every rank has come. A rank that ends before it comes (a script that
    builds an LLM outside ``if __name__ == "__main__":`` is one: the spawned rank imports it and fails) is an
    error at once, not a wait of :data:`TIMEOUT` for a rank that will never join."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    port = _free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank on this machine
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world_size):
        p = ctx.Process(target=worker, args=(rank, world_size, init_method, backend, *worker_args), daemon=True,
                        name=f"acache-tp-{rank}")
        p.start()
        procs.append(p)
    try:
        _wait_for_ranks(store, procs)
        tp, channel = _joined(store, 0, world_size, backend)
    except BaseException:
        for p in procs:
            p.terminate()
            p.join(timeout=30)
        raise
    return tp, channel, procs


def _wait_for_ranks(store, procs: list) -> None:
    """Returns once every spawned rank has said it is joining; raises at once for one that ended first, and after
    :data:`TIMEOUT` for one that neither came nor ended."""
    keys = [f"{_JOINING}{rank}" for rank in range(1, len(procs) + 1)]
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while not store.check(keys):
        for rank, p in enumerate(procs, start=1):
            if p.exitcode is not None and not store.check([f"{_JOINING}{rank}"]):
                raise RuntimeError(
                    f"tensor-parallel rank {rank} ended (exit code {p.exitcode}) before it joined the group; its "
                    "error is printed above (a script that builds an LLM with tensor_parallel_size > 1 outside "
                    '`if __name__ == "__main__":` ends so: each rank is a process that imports the script)')
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not join the group in {TIMEOUT}")
        time.sleep(_POLL_S)
