"""The tensor-parallel control protocol (acache.engine.parallel): after every step the ranks agree on how it
ended, so that a fault on one rank alone stops the serving instead of leaving the ranks' engines apart. The
processes and their collectives are exercised by tests/models/test_tensor_parallel.py; here the channel is a
stand-in that records what each side says."""

from __future__ import annotations

import pytest

from acache.engine import parallel
from acache.engine.parallel import DIVERGED, STEP_FAILED, STEP_OK, MirroredEngine, RankFault, serve_rank


class Channel:
    """Rank 0's calls in order (``script``), and the other ranks' answers at each agreement (``others``)."""

    def __init__(self, script=(), others=()):
        self.script, self.others = list(script), list(others)
        self.sent, self.said = [], []

    def send(self, call):
        self.sent.append(call)

    def receive(self):
        return self.script.pop(0)

    def agree_same(self, value):
        self.said.append(value)
        return all(other == value for other in self.others.pop(0))


class Engine:
    """Steps that return ``[]``, or raise where ``fail`` names the call's index (0-based over every call)."""

    def __init__(self, fail=()):
        self.fail, self.calls = set(fail), 0

    def _call(self):
        self.calls += 1
        if self.calls - 1 in self.fail:
            raise RuntimeError(f"fault at call {self.calls - 1}")

    def step(self):
        self._call()
        return []

    def add_request(self, *args):
        self._call()
        return "r"

    def abort(self, request_id):
        self._call()
        return True

    model = type("M", (), {"device": "cpu"})()


@pytest.fixture(autouse=True)
def a_rank(monkeypatch):
    monkeypatch.setattr(parallel.dist, "get_rank", lambda: 1)


def test_rank_0_stops_serving_once_another_rank_says_otherwise():
    channel = Channel(others=[[STEP_OK], [STEP_FAILED], [DIVERGED]])
    mirrored = MirroredEngine(Engine(), channel)
    assert mirrored.step() == []
    with pytest.raises(RankFault, match="the tensor-parallel ranks ended an engine call differently"):
        mirrored.step()
    with pytest.raises(RankFault):
        mirrored.step()
    assert channel.said == [STEP_OK] * 3 and channel.sent == [("step",)] * 3


def test_rank_0_that_fails_a_step_still_takes_part_in_the_agreement():
    """Else the other ranks wait at it for ever, and rank 0's next broadcast meets them there."""
    channel = Channel(others=[[STEP_FAILED]])
    with pytest.raises(RuntimeError, match="fault at call 0"):
        MirroredEngine(Engine(fail={0}), channel).step()
    assert channel.said == [STEP_FAILED]


def test_a_rank_that_failed_alone_says_so_at_every_later_step():
    # calls: a step rank 0 also failed (the ranks agree and go on), an add that failed here alone, two steps
    script = [("step",), ("add", [1], None, "r", None, False), ("step",), ("step",), ("stop",)]
    channel = Channel(script, others=[[STEP_FAILED], [STEP_OK], [STEP_OK]])
    serve_rank(Engine(fail={0, 1}), channel)
    assert channel.said == [STEP_FAILED, DIVERGED, DIVERGED]


def test_a_step_that_ended_otherwise_on_rank_0_makes_this_rank_diverge():
    script = [("step",), ("step",), ("abort", "r"), ("step",), ("stop",)]
    channel = Channel(script, others=[[STEP_FAILED], [STEP_OK], [STEP_OK]])  # rank 0 failed the first, not here
    serve_rank(Engine(), channel)
    assert channel.said == [STEP_OK, DIVERGED, DIVERGED]


def test_ranks_that_fail_the_same_step_go_on_together():
    script = [("step",), ("step",), ("stop",)]
    channel = Channel(script, others=[[STEP_FAILED], [STEP_OK]])
    serve_rank(Engine(fail={0}), channel)
    assert channel.said == [STEP_FAILED, STEP_OK]


def test_a_ctrl_c_in_rank_0s_step_does_not_wait_for_the_others():
    """The others may be inside a collective rank 0 left: waiting for them to agree would hang the Ctrl-C (the
    offline generate terminates them instead)."""
    class Interrupted(Engine):
        def step(self):
            raise KeyboardInterrupt

    channel = Channel()
    with pytest.raises(KeyboardInterrupt):
        MirroredEngine(Interrupted(), channel).step()
    assert channel.said == []
