"""The cluster's front door without Ray running: /health is ready only once every replica runs."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

pytest.importorskip("ray")

from acache.cluster.frontend import FrontendSettings, build_frontend  # noqa: E402
from acache.paths import default_model  # noqa: E402


def front(running, replicas: int = 3) -> TestClient:
    settings = FrontendSettings(str(default_model()), "dir", "ns", replicas=replicas)
    return TestClient(build_frontend(settings, engine=None, directory=None, ready=running))


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
