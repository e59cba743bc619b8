"""The tensor-parallel control protocol (acache.engine.parallel): after every call the ranks agree on how it
ended, so that a fault on one rank alone stops the serving instead of leaving the ranks' engines apart. The
processes and their collectives are exercised by tests/models/test_tensor_parallel.py (a fault injected into one
rank's process included); here the channel is a stand-in that records what each side says."""

from __future__ import annotations

import pytest

from acache.engine import parallel
from acache.engine.parallel import STEP_FAILED, STEP_OK, MirroredEngine, RankFault, serve_rank


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


class Params:
    """Greedy sampling: no generator to draw."""

    def generator(self, device):
        return None


@pytest.fixture(autouse=True)
def a_rank(monkeypatch):
    monkeypatch.setattr(parallel.dist, "get_rank", lambda: 1)


def test_rank_0_stops_serving_once_another_rank_says_otherwise():
    """After the disagreement nothing more reaches the others but the stop: a step's forward would meet them at
    collectives of another batch."""
    channel = Channel(others=[[STEP_OK], [STEP_FAILED]])
    mirrored = MirroredEngine(Engine(), channel)
    assert mirrored.step() == []
    with pytest.raises(RankFault, match="the tensor-parallel ranks ended an engine call differently"):
        mirrored.step()
    for call in (mirrored.step, lambda: mirrored.add_request([1], Params())):
        with pytest.raises(RankFault):
            call()
    assert mirrored.abort("r") is True  # rank 0's own request is freed
    assert channel.said == [STEP_OK] * 2 and channel.sent == [("step",)] * 2


def test_an_add_that_failed_on_another_rank_stops_serving_at_once():
    """Rank 0 holds a request the others do not: its next step's forward would not match theirs."""
    channel = Channel(others=[[STEP_FAILED]])
    engine = Engine()
    mirrored = MirroredEngine(engine, channel)
    with pytest.raises(RankFault):
        mirrored.add_request([1], Params())
    assert engine.calls == 2  # added, then aborted: its caller never learnt its id
    with pytest.raises(RankFault):
        mirrored.step()
    assert channel.said == [STEP_OK] and [c[0] for c in channel.sent] == ["add"]


def test_rank_0_that_fails_a_step_still_takes_part_in_the_agreement():
    """Else the other ranks wait at it for ever, and rank 0's next broadcast meets them there."""
    channel = Channel(others=[[STEP_FAILED]])
    with pytest.raises(RuntimeError, match="fault at call 0"):
        MirroredEngine(Engine(fail={0}), channel).step()
    assert channel.said == [STEP_FAILED]


def test_a_step_rank_0_alone_failed_is_a_rank_fault():
    """The others ran it: the caller must hear that the ranks no longer agree (the server then stops serving), not
    only rank 0's own fault, which it would serve past."""
    channel = Channel(others=[[STEP_OK]])
    mirrored = MirroredEngine(Engine(fail={0}), channel)
    with pytest.raises(RankFault) as raised:
        mirrored.step()
    assert "fault at call 0" in str(raised.value.__cause__) and mirrored.fault is raised.value


def test_every_call_this_rank_replays_is_agreed_on():
    # calls: a step rank 0 also failed (the ranks agree and go on), an add that failed here alone, then the stop
    script = [("step",), ("add", [1], None, "r", None, False), ("abort", "r"), ("stop",)]
    channel = Channel(script, others=[[STEP_FAILED], [STEP_OK], [STEP_OK]])
    serve_rank(Engine(fail={0, 1}), channel)
    assert channel.said == [STEP_FAILED, STEP_FAILED, STEP_OK]


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
