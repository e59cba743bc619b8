"""The cluster's front door without Ray running: /health is ready only once every replica runs; the spans it
sends the router are those the replica will reuse; /cluster/stats does not wait on the directory for ever."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

pytest.importorskip("ray")

from acache.cluster.frontend import FrontendSettings, build_frontend  # noqa: E402
from acache.paths import default_model  # noqa: E402


def front(running, replicas: int = 3, engine=None) -> TestClient:
    settings = FrontendSettings(str(default_model()), "dir", "ns", replicas=replicas)
    return TestClient(build_frontend(settings, engine=engine, directory=None, ready=running))


@pytest.mark.parametrize("running, status, state", [(0, 503, "starting"), (2, 503, "starting"), (3, 200, "ok"),
                                                    (4, 200, "ok")])
def test_health_waits_for_every_replica(running, status, state):
    resp = front(lambda: running).get("/health")
    assert resp.status_code == status
    assert resp.json() == {"status": state, "replicas_ready": running, "replicas": 3}


def test_health_is_not_ready_when_serve_cannot_be_asked():
    def broken() -> int:
        raise ConnectionError("no Serve controller")

    resp = front(broken).get("/health")
    assert resp.status_code == 503 and resp.json() == {"status": "unknown",
                                                       "error": "ConnectionError: no Serve controller"}


def test_a_request_without_the_key_is_refused_at_the_front_door():
    settings = FrontendSettings(str(default_model()), "dir", "ns", api_key="secret")
    client = TestClient(build_frontend(settings, engine=None, directory=None, ready=lambda: 1))
    for method, path in (("POST", "/v1/completions"), ("POST", "/tokenize"), ("GET", "/cluster/stats")):
        resp = client.request(method, path, json={"prompt": "x"} if method == "POST" else None)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", (path, resp.text)
    assert client.get("/health").status_code == 200  # a load balancer's probe needs no key


def test_cluster_stats_answers_503_when_the_directory_does_not_answer(monkeypatch):
    monkeypatch.setattr("acache.cluster.frontend.STATS_WAIT_S", 0.2)

    async def never():
        await asyncio.sleep(3600)

    directory = type("D", (), {"snapshot": type("S", (), {"remote": staticmethod(never)})()})()
    settings = FrontendSettings(str(default_model()), "dir", "ns")
    resp = TestClient(build_frontend(settings, engine=None, directory=directory, ready=lambda: 1)).get("/cluster/stats")
    assert resp.status_code == 503 and "did not answer in 0.2 s" in resp.json()["error"]["message"]


def test_the_spans_sent_to_the_router_are_those_the_replica_reuses():
    """A request the replica computes without reuse (affix_reuse or selector off) holds no span: pinning it to a
    holder would count spans it never stores."""
    from acache.cluster.frontend import SpanExtractor

    extractor = SpanExtractor(FrontendSettings(str(default_model()), "dir", "ns", min_document_tokens=4))
    messages = [{"role": "system", "content": "Mary moved to the kitchen. John went to the garden."},
                {"role": "user", "content": "Where is Mary?"}]
    reused, _ = extractor.spans("/v1/chat/completions", {"messages": messages})
    assert reused and all(n > 0 for _, n in reused)
    for off in ({"affix_reuse": "off"}, {"selector": "off"}):
        assert extractor.spans("/v1/chat/completions", {"messages": messages, **off}) == ((), None)
    affix = extractor.registry.register(extractor.inputs.encode_text("Sandra went to the office."), None, None)
    assert extractor.spans("/v1/completions", {"prompt": "x", "affix": affix})[0]
    for off in ({"affix_reuse": "off"}, {"selector": "off"}):
        assert extractor.spans("/v1/completions", {"prompt": "x", "affix": affix, **off})[0] == ()


class Engine:
    """A handle whose every call counts, and raises ``fail`` (Serve's answer while the application goes away)."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.calls, self.fail = 0, fail

    def options(self, **_):
        return self

    @property
    def handle(self):
        return self

    def remote(self, forwarded):
        self.calls += 1
        raise self.fail


def test_a_request_with_no_replica_running_is_answered_503_at_once():
    """Serve holds a request until a replica runs, for ever if replacements keep failing: with none running the front
    door says so (asking Serve again at each request, so that the first replica to run serves at once)."""
    asked = []
    engine = Engine(RuntimeError("Serve would hold this request until a replica runs"))
    client = front(lambda: asked.append(1) or 0, engine=engine)
    for _ in range(3):
        resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert resp.status_code == 503 and "no engine replica is running" in resp.json()["error"]["message"]
    assert engine.calls == 0 and len(asked) == 3


def test_the_front_doors_own_failures_are_openai_errors():
    """A method it does not route (405) and Serve's refusal while the application is deleted were plain text or
    FastAPI's {"detail"} shape."""
    from fastapi.responses import PlainTextResponse
    from ray.serve.exceptions import DeploymentUnavailableError

    settings = FrontendSettings(str(default_model()), "dir", "ns")
    engine = Engine(DeploymentUnavailableError("acache#EngineReplica is being deleted"))
    app = build_frontend(settings, engine=engine, directory=None, ready=lambda: 1)
    # as Serve does once the front door runs under it: its own plain-text handler for its own refusals
    app.add_exception_handler(DeploymentUnavailableError, lambda request, exc: PlainTextResponse(str(exc), 503))
    client = TestClient(app, raise_server_exceptions=False)
    resp = client.patch("/v1/completions", json={})
    assert resp.status_code == 405 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 503 and engine.calls == 1
    assert resp.json()["error"]["message"].startswith("the engine replicas cannot be reached "
                                                      "(DeploymentUnavailableError)")



def test_a_cluster_that_has_just_started_serves_once_health_says_so():
    """A count of none running was kept for a second: a client that saw /health answer 200 got 503s."""
    from ray.serve.exceptions import DeploymentUnavailableError

    running = [0]
    engine = Engine(DeploymentUnavailableError("reached the replicas"))
    client = front(lambda: running[0], replicas=2, engine=engine)
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 503 and engine.calls == 0
    running[0] = 2
    assert client.get("/health").status_code == 200
    resp = client.post("/v1/completions", json={"prompt": "x"})
    assert engine.calls == 1 and "cannot be reached" in resp.json()["error"]["message"]


def test_requests_waiting_on_the_count_share_one_question_to_serve():
    """Each request arriving while the count was stale asked Serve on a thread of its own (50 at once: 50 calls)."""
    import threading

    from acache.cluster.frontend import RunningCount

    asked, gate = [], threading.Event()

    def ready() -> int:
        asked.append(1)
        gate.wait(5)
        return 2

    count = RunningCount(ready)

    async def many():
        waiting = [asyncio.ensure_future(count.get()) for _ in range(50)]
        await asyncio.sleep(0.1)
        gate.set()
        return await asyncio.gather(*waiting)

    assert asyncio.run(many()) == [2] * 50 and len(asked) == 1
