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


def start(cluster: ClusterSettings, replica: ReplicaSettings, frontend: FrontendSettings) -> None:
    """Deploys the application and returns once every replica is ready (Serve keeps running after)."""
    connect(cluster)
    serve.start(http_options={"host": cluster.host, "port": cluster.port})
    # restarted if it dies (empty: the replicas then report in full, as the directory asks them to)
    directory = ray.remote(AffixDirectory).options(name=cluster.directory, namespace=NAMESPACE,
                                                   lifetime="detached", get_if_exists=True, num_cpus=0,
                                                   max_restarts=-1, max_task_retries=-1).remote()
    ray.get(directory.snapshot.remote())
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
    serve.run(front.bind(frontend, engine.bind(replica)), name=cluster.app_name, route_prefix="/")


def stop(cluster: ClusterSettings) -> None:
    """Removes the application and its directory (the Ray instance stays)."""
    serve.delete(cluster.app_name)
    with contextlib.suppress(ValueError):  # already gone
        ray.kill(ray.get_actor(cluster.directory, namespace=NAMESPACE))
