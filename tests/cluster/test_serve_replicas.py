"""``acache serve --replicas 2`` from the command line: the same endpoints, streaming included, answered
as the single server answers them; SIGTERM takes the cluster down."""

from __future__ import annotations

import http.client
import json
import signal
import urllib.request

from fastapi.testclient import TestClient

from acache import LLM
from acache.paths import default_model
from acache.server.app import create_app
from tests.server.helpers import start_server, wait_until

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
    proc, port = start_server(["--replicas", "2", "--kv-cache-memory", "16MiB"])
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
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        log = proc.stdout.read().decode(errors="replace")
    assert failure is None, f"{failure}\n--- the server's output ---\n{log[-4000:]}"
    assert code == 0, log[-4000:]
