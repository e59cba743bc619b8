"""``acache serve --replicas 2`` from the command line: the same endpoints, streaming included, answered
as the single server answers them; SIGTERM takes the cluster down."""

from __future__ import annotations

import http.client
import json
import signal
import urllib.request

import pytest
from fastapi.testclient import TestClient

from acache import LLM
from acache.cli import main
from acache.paths import default_model
from acache.server.app import create_app
from tests.server.helpers import start_server, stop_server, wait_until

SYSTEM = "story : mary moved to the kitchen . john went to the garden . sandra went to the office ."
QUESTIONS = ["where is mary ?", "where is john ?", "where is sandra ?"]


def chat(question: str, stream: bool, max_tokens: int) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "stream": stream}


def streamed_text(port: int, body: dict) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text = ""
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    return text


def cluster_stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/cluster/stats", timeout=30) as resp:
        return json.loads(resp.read())


def test_serve_with_replicas_streams_the_single_servers_answers():
    llm = LLM(default_model(), kv_cache_memory=1 << 24)
    with TestClient(create_app(llm, "tiny")) as client:
        want = [client.post("/v1/chat/completions", json=chat(q, False, 2 + 2 * (i % 2))).json()
                ["choices"][0]["message"]["content"] for i, q in enumerate(QUESTIONS * 2)]
    proc, port = start_server(["--replicas", "2", "--kv-cache-memory", "16MiB", "--shutdown-grace", "1"])
    failure = None
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        health = json.loads(conn.getresponse().read())
        assert health == {"status": "ok", "replicas_ready": 2, "replicas": 2}  # start_server waited for a 200
        got = [streamed_text(port, chat(q, True, 2 + 2 * (i % 2))) for i, q in enumerate(QUESTIONS * 2)]
        assert got == want
        # a replica Ray replaced (its memory monitor may kill one on a loaded machine) reports on its start
        assert wait_until(lambda: len(cluster_stats(port)["replicas"]) == 2, 90, poll=1.0), cluster_stats(port)
        stats = cluster_stats(port)
        # the system prompt is an affix from its second sighting: the router sent its sightings to one replica
        assert sum(row["affixes"] for row in stats["replicas"].values()) == 1
    except AssertionError as exc:
        failure = exc
    finally:
        # bounded: a replica has 1 + 20 s to stop, Serve 15 s more to see it gone; then Ray's own processes stop
        code, log = stop_server(proc, seconds=120)
    assert failure is None, f"{failure}\n--- the server's output ---\n{log[-4000:]}"
    assert code == 0, log[-4000:]
    assert "stopping the cluster (at most 36 s" in log and "the cluster stopped in" in log, log[-4000:]


@pytest.fixture
def no_ray(monkeypatch):
    """``acache serve --replicas`` with Ray Serve's start, deployment and stop replaced: what each outcome prints
    and returns, in this process. Yields the calls made."""
    from acache.cluster import launch

    calls = []
    handler = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(launch, "prepare", lambda cluster: calls.append("prepare"))
    monkeypatch.setattr(launch, "deploy", lambda *a: calls.append("deploy"))
    monkeypatch.setattr(launch, "stop", lambda cluster: calls.append("stop") or True)
    yield calls
    assert signal.getsignal(signal.SIGTERM) == handler  # the command's handler does not outlive it


def test_a_serve_that_cannot_start_says_why_and_starts_nothing(no_ray, monkeypatch, capsys):
    from acache.cluster import launch

    def proxy_died(cluster):
        raise launch.ClusterStartError("Ray Serve's HTTP proxy did not start: The actor died unexpectedly")

    monkeypatch.setattr(launch, "prepare", proxy_died)
    assert main(["serve", "--replicas", "2"]) == 1
    assert "acache serve: error: Ray Serve's HTTP proxy did not start: The actor died" in capsys.readouterr().err
    assert no_ray == []


def test_a_replica_that_cannot_start_stops_the_cluster_and_says_why(no_ray, monkeypatch, capsys):
    from acache.cluster import launch

    def replica_failed(*_):
        no_ray.append("deploy")
        raise launch.ClusterStartError("an engine replica could not start: CheckpointError: bad weights")

    monkeypatch.setattr(launch, "deploy", replica_failed)
    assert main(["serve", "--replicas", "2"]) == 1
    out = capsys.readouterr()
    assert no_ray == ["prepare", "deploy", "stop"]
    assert "the cluster stopped in" in out.out
    assert "acache serve: error: an engine replica could not start: CheckpointError: bad weights" in out.err


def test_a_cluster_that_outlives_its_bound_says_so_and_exits_1(no_ray, monkeypatch, capsys):
    from acache.cluster import launch

    def signalled(*_):  # SIGTERM while serving: its handler raises KeyboardInterrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "deploy", signalled)
    monkeypatch.setattr(launch, "stop", lambda cluster: False)
    assert main(["serve", "--replicas", "2", "--shutdown-grace", "4"]) == 1
    out = capsys.readouterr().out
    assert "stopping the cluster (at most 39 s: each replica has 24 s for its requests in flight and its save)" in out
    assert "the cluster did not stop within" in out and "its Ray processes are stopped under it" in out
