"""Starting a cluster: a local Ray instance (or an existing one, ``ray_address``), the affix directory, N
engine replicas behind the chosen router, and the frontend on Serve's HTTP proxy."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from acache.cluster.affinity import Balance
from acache.cluster.directory import AffixDirectory
from acache.cluster.frontend import FrontendSettings, build_frontend
from acache.cluster.replica import EngineReplica, ReplicaSettings
from acache.cluster.router import SpanAwareRouter

NAMESPACE = "acache"
ROUTERS = ("span", "default")
#: the route the front door answers under: the OpenAI paths from the root, as the single server answers them
ROUTE_PREFIX = "/"


@dataclass(frozen=True)
class ClusterSettings:
    """``router``: 'span' (ours) or 'default' (Serve's power of two choices, which knows no affixes).
    ``cpus_per_replica``: CPUs Ray reserves for each replica (0 lets replicas share a small machine)."""

    replicas: int = 2
    router: str = "span"
    ray_address: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    app_name: str = "acache"
    balance_absolute: int = 64
    balance_relative: float = 1.5
    cpus_per_replica: float = 0.0
    gpus_per_replica: float = 0.0
    max_ongoing_requests: int = 256
    health_check_period_s: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {self.replicas!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        Balance(self.balance_absolute, self.balance_relative)  # refused here, not inside the router
        if not isinstance(self.app_name, str) or not self.app_name.strip():
            raise ValueError(f"app_name must be a non-empty string, got {self.app_name!r}")

    @property
    def directory(self) -> str:
        return f"acache-affix-directory-{self.app_name}"


@serve.ingress()
class Frontend:
    def __init__(self, settings: FrontendSettings, engine) -> None:
        self.settings = settings
        self.engine = engine

    def __serve_build_asgi_app__(self):
        directory = ray.get_actor(self.settings.directory, namespace=self.settings.namespace)
        return build_frontend(self.settings, self.engine, directory)


def connect(cluster: ClusterSettings) -> None:
    """Starts a local Ray instance, or joins ``ray_address``'s (a no-op when Ray is up in this process)."""
    if not ray.is_initialized():
        ray.init(address=cluster.ray_address, namespace=NAMESPACE, include_dashboard=False,
                 log_to_driver=bool(os.environ.get("ACACHE_RAY_LOGS")))


def prepare(cluster: ClusterSettings) -> None:
    """Joins or starts Ray and Serve, refusing what a Serve already running there would silently change: its HTTP
    proxy keeps the address it started with (new options are ignored), and an application of the same name would
    be replaced in place. Deploys nothing, so a refusal leaves what runs as it was."""
    from ray.serve.context import _get_global_client  # the running proxy's options: no public API reads them

    connect(cluster)
    serve.start(http_options={"host": cluster.host, "port": cluster.port})
    client = _get_global_client()
    config = client.http_config
    if (config.host, config.port) != (cluster.host, cluster.port):
        raise ValueError(f"Ray Serve already runs on this Ray cluster with its HTTP proxy on {config.host}:"
                         f"{config.port}, and a running proxy cannot move to {cluster.host}:{cluster.port}: pass "
                         f"--host {config.host} --port {config.port}, or stop that Serve first (serve shutdown)")
    apps = client.get_serve_details().get("applications", {})
    if cluster.app_name in apps:
        raise ValueError(f"an application named {cluster.app_name!r} already runs on this Ray Serve: stop it "
                         "first, or name this one otherwise (--app-name)")
    taken = [name for name, app in apps.items() if app.get("route_prefix") == ROUTE_PREFIX]
    if taken:
        raise ValueError(f"Ray Serve's {ROUTE_PREFIX!r} route, which this application takes, is application "
                         f"{taken[0]!r}'s: stop that one first")


def start(cluster: ClusterSettings, replica: ReplicaSettings, frontend: FrontendSettings) -> None:
    """Deploys the application and returns once every replica is ready (Serve keeps running after); refuses
    first as :func:`prepare` does."""
    prepare(cluster)
    deploy(cluster, replica, frontend)


def deploy(cluster: ClusterSettings, replica: ReplicaSettings, frontend: FrontendSettings) -> None:
    """:func:`start` after :func:`prepare`: a caller that must tell a refusal from a failed deployment (which it
    then stops) calls the two apart."""
    # restarted if it dies (empty: the replicas then report in full, as the directory asks them to)
    directory = ray.remote(AffixDirectory).options(name=cluster.directory, namespace=NAMESPACE,
                                                   lifetime="detached", get_if_exists=True, num_cpus=0,
                                                   max_restarts=-1, max_task_retries=-1).remote()
    # one left by an earlier run of this application that was not stopped names replicas that are gone
    ray.get(directory.reset.remote())
    if cluster.router == "span":
        router = RequestRouterConfig(request_router_class=SpanAwareRouter, request_router_kwargs={
            "directory": cluster.directory, "namespace": NAMESPACE, "balance_absolute": cluster.balance_absolute,
            "balance_relative": cluster.balance_relative})
    else:
        router = RequestRouterConfig()
    engine = serve.deployment(EngineReplica, name="EngineReplica", num_replicas=cluster.replicas,
                              max_ongoing_requests=cluster.max_ongoing_requests,
                              health_check_period_s=cluster.health_check_period_s,
                              ray_actor_options={"num_cpus": cluster.cpus_per_replica,
                                                 "num_gpus": cluster.gpus_per_replica},
                              request_router_config=router)
    front = serve.deployment(Frontend, name="Frontend", num_replicas=1, max_ongoing_requests=4096,
                             ray_actor_options={"num_cpus": 0})
    serve.run(front.bind(frontend, engine.bind(replica)), name=cluster.app_name, route_prefix=ROUTE_PREFIX)


def stop(cluster: ClusterSettings) -> None:
    """Removes the application and its directory (the Ray instance stays)."""
    serve.delete(cluster.app_name)
    with contextlib.suppress(ValueError):  # already gone
        ray.kill(ray.get_actor(cluster.directory, namespace=NAMESPACE))
