"""Tensor-parallel ranks with a fault of their own: the entry points tests/models/test_tensor_parallel.py spawns
in place of :func:`acache.llm._tp_worker`, each failing one engine call on its rank alone, after the forward the
ranks run together (a fault inside a forward's collective holds the others until the group's timeout)."""

from __future__ import annotations

from acache import llm as llm_module
from acache.engine.llm_engine import LLMEngine
from acache.engine.scheduler import Scheduler


def failing_at(owner: type, name: str, call: int) -> None:
    """Makes ``owner.name`` raise at its ``call``-th call (1-based) in this process."""
    original, calls = getattr(owner, name), []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise MemoryError(f"injected fault in {name} on this rank alone")
        return original(self, *args, **kwargs)

    setattr(owner, name, failing)


def faulty_worker(where: str, rank: int, *args) -> None:
    """A rank whose second step fails after its forward (``where`` 'step'), or whose second add fails ('add')."""
    if where == "step":
        failing_at(Scheduler, "update_from_output", 2)
    else:
        failing_at(LLMEngine, "add_request", 2)
    llm_module._tp_worker(rank, *args)
