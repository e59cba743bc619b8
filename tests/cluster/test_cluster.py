"""A local Ray cluster of two engine replicas (the shipped model, CPU): answers equal the single server's,
the span-aware router keeps each document on one replica (hit rate) where Serve's default router does not,
a dead replica's requests are retried or fail clearly, and a replica starts warm from a shared directory."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import ray
from fastapi.testclient import TestClient

from acache import LLM
from acache.cluster.directory import AffixDirectory
from acache.cluster.frontend import FrontendSettings
from acache.cluster.launch import (
    NAMESPACE,
    SAVE_ALLOWANCE_S,
    ClusterSettings,
    ClusterStartError,
    check_resources,
    prepare,
    start,
    stop,
)
from acache.cluster.replica import ReplicaSettings
from acache.paths import default_model
from acache.server.app import create_app
from acache_lab.bench.cluster import call, documents_workload, run
from tests.server.helpers import free_port, wait_until

CAP = 144  # nine 16-token pages: three of the workload's 38-token documents per replica, of six


@pytest.fixture(scope="module")
def local_ray():
    """A Ray instance for the module; Serve's HTTP proxy keeps the first port it is given, so every cluster
    of the module is served there."""
    ray.init(num_cpus=4, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    yield free_port()
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def workload():
    return documents_workload(documents=6, questions=20, seed=0)


@pytest.fixture(scope="module")
def single_answers(workload):
    """The single-process server's answers to the same requests."""
    llm = LLM(default_model(), kv_cache_memory=1 << 24)
    with TestClient(create_app(llm, "tiny")) as client:
        ids = [client.post("/v1/affixes", json={"text": t}).json()["id"] for t in workload.documents]
        outs = [client.post("/v1/completions", json={**body, "affix": ids[d]}).json()
                for d, body in workload.requests]
    return [o["choices"][0]["token_ids"] for o in outs]


def cluster(port: int, router: str, app_name: str, shutdown_grace: float = 30.0, **llm) -> tuple[ClusterSettings, str]:
    settings = ClusterSettings(replicas=2, router=router, port=port, app_name=app_name, shutdown_grace=shutdown_grace)
    model = str(default_model())
    replica = ReplicaSettings(model, "tiny", settings.directory, NAMESPACE, threads=1,
                              llm={"kv_cache_memory": 1 << 24, "max_affix_tokens": CAP, **llm.pop("llm", {})},
                              **llm)
    start(settings, replica, FrontendSettings(model, settings.directory, NAMESPACE, replicas=2, app_name=app_name))
    return settings, f"http://127.0.0.1:{settings.port}"


def test_span_aware_routing_keeps_documents_on_one_replica(local_ray, workload, single_answers):
    rates = {}
    for router, grace in (("span", 30.0), ("default", 3.5)):
        settings, url = cluster(local_ray, router, f"test-{router}", shutdown_grace=grace)
        try:
            result = run(url, workload, concurrency=4)
            stats = call(url, "/cluster/stats")[1]
            # a stopping replica's bound, and the front door's, follow --shutdown-grace
            assert shutdown_bounds(settings.app_name) == {"EngineReplica": grace + SAVE_ALLOWANCE_S,
                                                          "Frontend": grace + SAVE_ALLOWANCE_S}
        finally:
            assert stop(settings)
        assert result.statuses == [200] * len(workload.requests), result.errors
        assert result.answers == single_answers, router
        assert stats["affix_queries"] == len(workload.requests)
        assert len(stats["replicas"]) == 2
        rates[router] = stats["affix_hit_rate"]
    assert rates["span"] >= 0.9, rates
    assert rates["default"] <= 0.75 and rates["span"] - rates["default"] >= 0.2, rates


def shutdown_bounds(app_name: str) -> dict[str, float]:
    from ray.serve.context import _get_global_client  # no public API reads a deployment's config

    deployments = _get_global_client().get_serve_details()["applications"][app_name]["deployments"]
    return {name: d["deployment_config"]["graceful_shutdown_timeout_s"] for name, d in deployments.items()}


def replica_actors(app_name: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app_name}#EngineReplica")]


def test_a_dead_replica_loses_no_request_and_gets_no_more(local_ray, workload, single_answers):
    settings, url = cluster(local_ray, "span", "test-kill")
    try:
        result = {}
        load = threading.Thread(target=lambda: result.update(r=run(url, workload, concurrency=4)))
        load.start()
        time.sleep(1.0)
        victim = replica_actors("test-kill")[0]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        load.join(timeout=300)
        r = result["r"]
        # a request on the dead replica is retried on the other; one that still fails says why
        for status, answer, want in zip(r.statuses, r.answers, single_answers, strict=True):
            assert (status, answer) == (200, want) or status == 503, status
        assert all("replica serving this request died" in e for e in r.errors), r.errors
        assert r.statuses.count(200) >= len(r.statuses) - 2
        # Serve replaces the dead replica; /health is ready again once both run. Serve's count of running
        # replicas can still move while the dead one is listed, so the answer judged is the one waited for.
        ready = (200, {"status": "ok", "replicas_ready": 2, "replicas": 2})
        seen = []
        assert wait_until(lambda: seen.append(call(url, "/health")) or seen[-1] == ready, 120), seen[-1:]
        after = run(url, documents_workload(documents=2, questions=6, seed=1), concurrency=2)
        assert after.statuses == [200] * 12, after.errors
        dead_id = victim.rsplit("#", 1)[-1]
        deadline = time.time() + 30
        while dead_id in call(url, "/cluster/stats")[1]["replicas"] and time.time() < deadline:
            time.sleep(0.5)
        assert dead_id not in call(url, "/cluster/stats")[1]["replicas"]
    finally:
        stop(settings)


def test_a_replica_starts_warm_from_a_shared_affix_directory(local_ray, workload, single_answers, tmp_path):
    llm = LLM(default_model(), kv_cache_memory=1 << 24)
    asked = []
    with TestClient(create_app(llm, "tiny", affix_cache_dir=tmp_path)) as client:
        for text in workload.documents[:2]:
            affix = client.post("/v1/affixes", json={"text": text}).json()["id"]
            body = {"prompt": "question : where is mary ? answer :", "affix": affix, "max_tokens": 2}
            out = client.post("/v1/completions", json=body)
            assert out.status_code == 200
            asked.append((body, out.json()["choices"][0]["token_ids"]))
        assert client.post("/v1/affixes/save").json()["saved"] == 2
    # an earlier run of the same application left its directory behind (its driver died without stopping it): the
    # replica it names is gone, and must not be counted, nor routed to, by the new run
    stale = ray.remote(AffixDirectory).options(name=ClusterSettings(app_name="test-warm").directory,
                                               namespace=NAMESPACE, lifetime="detached", num_cpus=0).remote()
    ray.get(stale.report.remote("ghost", [("stored", "k", 38)], {"hits": 5, "queries": 9}, True))
    settings, url = cluster(local_ray, "span", "test-warm", affix_cache_dir=str(tmp_path),
                            llm={"max_affix_tokens": None})
    try:
        held = call(url, "/cluster/stats")[1]
        assert [row["affixes"] for row in held["replicas"].values()] == [2, 2] and "ghost" not in held["replicas"]
        for body, want in asked:  # ids registered before the restart, unknown to this front door: the replicas' own
            status, out = call(url, "/v1/completions", body)
            assert status == 200 and out["choices"][0]["token_ids"] == want, out
        picked = [i for i, (d, _) in enumerate(workload.requests) if d < 2][:6]
        sub = type(workload)(workload.documents[:2], [workload.requests[i] for i in picked], [0.0] * len(picked))
        result = run(url, sub, concurrency=2)
        assert result.answers == [single_answers[i] for i in picked]
        stats = call(url, "/cluster/stats")[1]
        assert stats["affix_hits"] == stats["affix_queries"] == len(picked) + len(asked)
    finally:
        stop(settings)


def test_a_stopping_replica_saves_the_affix_its_running_check_computes(local_ray, tmp_path):
    """A chat's system prompt seen twice starts a check whose request with reuse computes the shared affix, possibly
    after the answer: the affix directory hears of it when the check ends, and Ray Serve's graceful shutdown, which
    awaits the coroutine the replica's destructor returns, saves it to the shared directory. (Whether the check may
    still run when the replica stops is left to chance here; tests/server/test_shutdown.py makes it run late.)"""
    settings, url = cluster(local_ray, "span", "test-stop-save", affix_cache_dir=str(tmp_path))
    chat = {"messages": [{"role": "system", "content": "mary moved to the kitchen . john went to the garden ."},
                         {"role": "user", "content": "where is john?"}], "max_tokens": 2}
    try:
        for _ in range(2):  # the span router sends both to one replica
            status, out = call(url, "/v1/chat/completions", chat)
            assert status == 200, out
        assert out["usage"]["affix_reuse"]["decision"] == "checking"
        # the directory hears of the affix the check stored without another request to that replica
        assert wait_until(lambda: sum(row["affixes"] for row in call(url, "/cluster/stats")[1]["replicas"].values())
                          == 1, 30)
    finally:
        stop(settings)
    manifest = tmp_path / "manifest.json"
    assert wait_until(manifest.is_file, 60)
    assert len(json.loads(manifest.read_text())["entries"]) == 1


def test_a_running_serve_is_neither_moved_nor_replaced(local_ray):
    """Serve keeps its proxy's first address and ignores new options, and a deployment of a running application's
    name replaces it: both are refused before anything is deployed, naming what runs."""
    from ray import serve

    prepare(ClusterSettings(port=local_ray))  # Serve runs, its proxy on the module's port
    with pytest.raises(ValueError, match=f"HTTP proxy on 127.0.0.1:{local_ray}.*--port {local_ray}"):
        prepare(ClusterSettings(port=local_ray + 1))

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Other:
        def __call__(self, request) -> str:
            return "other"

    serve.run(Other.bind(), name="someone-else", route_prefix="/")
    try:
        with pytest.raises(ValueError, match="named 'someone-else' already runs"):
            prepare(ClusterSettings(port=local_ray, app_name="someone-else"))
        with pytest.raises(ValueError, match="route, which this application takes, is application 'someone-else'"):
            prepare(ClusterSettings(port=local_ray, app_name="acache-second"))
        assert "someone-else" in serve.status().applications  # a refusal stops nothing
    finally:
        serve.delete("someone-else")


@pytest.mark.parametrize("name", ["", "  ", None, 3])
def test_an_application_name_is_a_non_empty_string(name):
    with pytest.raises(ValueError, match="app_name must be a non-empty string"):
        ClusterSettings(app_name=name)


def test_a_stop_waits_no_longer_than_its_bound(local_ray):
    """A replica that takes longer to stop than the caller's bound (here its destructor sleeps): ``stop`` returns
    False at the bound, the deletion going on in Serve, and True once the application is gone."""
    from ray import serve

    @serve.deployment(num_replicas=1, graceful_shutdown_timeout_s=60, ray_actor_options={"num_cpus": 0})
    class Slow:
        def __call__(self, request) -> str:
            return "slow"

        def __del__(self) -> None:
            time.sleep(20)

    settings = ClusterSettings(port=local_ray, app_name="test-slow-stop")
    serve.run(Slow.bind(), name=settings.app_name, route_prefix="/")
    started = time.monotonic()
    try:
        assert not stop(settings, within=2.0)
        assert 2.0 <= time.monotonic() - started < 10.0
        assert settings.app_name in serve.status().applications
    finally:
        assert stop(settings, within=120.0)
    assert settings.app_name not in serve.status().applications


@pytest.mark.parametrize("grace", [-1, float("nan"), float("inf"), "5", True, None])
def test_the_shutdown_grace_is_a_non_negative_number_of_seconds(grace):
    with pytest.raises(ValueError, match="shutdown_grace must be a non-negative number of seconds"):
        ClusterSettings(shutdown_grace=grace)


@pytest.mark.parametrize("name", ["cpus_per_replica", "gpus_per_replica"])
@pytest.mark.parametrize("value", [-0.5, float("inf"), "1", True])
def test_a_replicas_resources_are_non_negative_numbers(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a non-negative number, got"):
        ClusterSettings(**{name: value})


def test_replicas_asking_for_more_than_the_cluster_has_are_refused_before_deploying(local_ray):
    """Serve waited for ever, silently, for a GPU this Ray instance does not have (two replicas on a one-GPU machine
    did). A cluster joined by address may grow (an autoscaler): there it is only logged."""
    from ray import serve

    short = ClusterSettings(replicas=2, port=local_ray, app_name="test-no-gpu", gpus_per_replica=0.5)
    model = str(default_model())
    with pytest.raises(ClusterStartError, match=r"2 replicas need 1 GPUs \(0.5 each\), and the Ray cluster's 0 "
                                                r"place 0"):
        start(short, ReplicaSettings(model, "tiny", short.directory, NAMESPACE),
              FrontendSettings(model, short.directory, NAMESPACE, app_name=short.app_name))
    assert short.app_name not in serve.status().applications
    with pytest.raises(ClusterStartError, match="need 1000 CPUs"):
        check_resources(ClusterSettings(replicas=2, cpus_per_replica=500))


@pytest.mark.parametrize(("gpus", "each", "replicas", "fits"), [(2, 0.6, 3, False), (2, 0.6, 2, True),
                                                                  (2, 0.5, 4, True), (4, 2, 2, True), (3, 2, 2, False),
                                                                  (0, 0, 5, True)])
def test_a_share_of_a_gpu_must_fit_on_one_gpu(monkeypatch, gpus, each, replicas, fits):
    """Three replicas of 0.6 GPU on two GPUs passed a check of totals (1.8 <= 2), and the third waited for ever."""
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": float(gpus), "CPU": 2.0})
    settings = ClusterSettings(replicas=replicas, gpus_per_replica=each)
    if fits:
        check_resources(settings)
    else:
        with pytest.raises(ClusterStartError, match=f"{replicas} replicas need"):
            check_resources(settings)


def test_more_than_one_gpu_a_replica_is_a_whole_number():
    with pytest.raises(ValueError, match="gpus_per_replica above 1 must be a whole number"):
        ClusterSettings(gpus_per_replica=1.5)


def test_a_replica_that_cannot_start_is_named_with_its_own_error(local_ray, tmp_path):
    """Serve reports a replica whose constructor raised as "failed to update the deployments": the start names the
    replica's own error instead (here a truncated checkpoint), as the single server does."""
    broken = tmp_path / "broken"
    shutil.copytree(default_model(), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    settings = ClusterSettings(replicas=1, port=local_ray, app_name="test-broken")
    replica = ReplicaSettings(str(broken), "broken", settings.directory, NAMESPACE, threads=1)
    try:
        with pytest.raises(ClusterStartError, match=f"an engine replica could not start: CheckpointError: "
                                                    f"{weights} is not a readable safetensors file"):
            start(settings, replica, FrontendSettings(str(broken), settings.directory, NAMESPACE, replicas=1,
                                                      app_name=settings.app_name))
    finally:
        assert stop(settings)
