"""Starting a cluster: a local Ray instance (or an existing one, ``ray_address``), the affix directory, N
engine replicas behind the chosen router, and the frontend on Serve's HTTP proxy."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from acache.cluster.affinity import Balance
from acache.cluster.directory import AffixDirectory
from acache.cluster.frontend import FrontendSettings, build_frontend
from acache.cluster.replica import EngineReplica, ReplicaSettings
from acache.cluster.router import SpanAwareRouter

log = logging.getLogger("acache.cluster")
NAMESPACE = "acache"
ROUTERS = ("span", "default")
#: the route the front door answers under: the OpenAI paths from the root, as the single server answers them
ROUTE_PREFIX = "/"
#: what a stopping replica has beyond --shutdown-grace for its reuse checks (CHECKS_GRACE_S), the engine thread's
#: stop and the affix save. Serve's bound covers requests and save together (it waits for the requests, then saves),
#: so a request that runs past the grace takes from the save's time; Serve kills a replica past the bound
SAVE_ALLOWANCE_S = 20.0
#: how long past the replicas' own bound a stop waits for Serve's controller to see them gone
STOP_MARGIN_S = 15.0


class ClusterStartError(RuntimeError):
    """Ray Serve could not start the application: the message is the cause, a replica's own error where Serve
    reported one (a checkpoint that does not load), not Serve's "failed to update the deployments"."""


@dataclass(frozen=True)
class ClusterSettings:
    """``router``: 'span' (ours) or 'default' (Serve's power of two choices, which knows no affixes).
    ``cpus_per_replica``: CPUs Ray reserves for each replica (0 lets replicas share a small machine).
    ``shutdown_grace``: the single server's ``--shutdown-grace``. A stopping replica has it plus
    :data:`SAVE_ALLOWANCE_S` for its requests in flight and its save together (Serve's graceful shutdown waits for
    the requests, then saves): Serve kills a replica past that."""

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
    shutdown_grace: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {self.replicas!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        Balance(self.balance_absolute, self.balance_relative)  # refused here, not inside the router
        if not isinstance(self.app_name, str) or not self.app_name.strip():
            raise ValueError(f"app_name must be a non-empty string, got {self.app_name!r}")
        for name in ("shutdown_grace", "cpus_per_replica", "gpus_per_replica"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or value < 0):
                what = "number of seconds" if name == "shutdown_grace" else "number"
                raise ValueError(f"{name} must be a non-negative {what}, got {value!r}")
        if self.gpus_per_replica > 1 and self.gpus_per_replica != int(self.gpus_per_replica):
            raise ValueError(f"gpus_per_replica above 1 must be a whole number (Ray shares a GPU, not several), "
                             f"got {self.gpus_per_replica!r}")

    @property
    def directory(self) -> str:
        return f"acache-affix-directory-{self.app_name}"

    @property
    def replica_stop_s(self) -> float:
        """The longest a replica takes to stop before Serve kills it: the requests' grace, then the save."""
        return self.shutdown_grace + SAVE_ALLOWANCE_S

    @property
    def stop_bound_s(self) -> float:
        """The longest :func:`stop` waits for the application to be gone."""
        return self.replica_stop_s + STOP_MARGIN_S


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
    if not ray.is_initialized():  # "local": never a cluster found by itself (RAY_ADDRESS is the caller's to pass)
        ray.init(address=cluster.ray_address or "local", namespace=NAMESPACE, include_dashboard=False,
                 log_to_driver=bool(os.environ.get("ACACHE_RAY_LOGS")))


def prepare(cluster: ClusterSettings) -> None:
    """Joins or starts Ray and Serve, refusing what a Serve already running there would silently change: its HTTP
    proxy keeps the address it started with (new options are ignored), and an application of the same name would
    be replaced in place. Deploys nothing, so a refusal leaves what runs as it was."""
    from ray.serve.context import _get_global_client  # the running proxy's options: no public API reads them

    connect(cluster)
    try:
        serve.start(http_options={"host": cluster.host, "port": cluster.port})
    except ray.exceptions.RayError as exc:  # e.g. its HTTP proxy failed Serve's readiness checks on a loaded machine
        raise ClusterStartError(f"Ray Serve's HTTP proxy did not start: {str(exc).splitlines()[0]} (Ray's logs say "
                                "why; ACACHE_RAY_LOGS=1 prints them here)") from None
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


def check_resources(cluster: ClusterSettings) -> None:
    """Refuses replicas that ask for more GPUs or CPUs than the Ray cluster has: Serve would wait for them for ever,
    saying so only in its own log. Only logged on a cluster joined by address, whose autoscaler may add nodes."""
    have = ray.cluster_resources()
    gpus, each = int(have.get("GPU", 0)), cluster.gpus_per_replica
    # a share of a GPU must fit on one GPU: three replicas of 0.6 do not fit on two
    placeable = math.inf if each == 0 else gpus * math.floor(1 / each + 1e-9) if each < 1 else gpus // int(each)
    short = [f"{cluster.replicas} replicas need {each * cluster.replicas:g} GPUs ({each:g} each), and the Ray "
             f"cluster's {gpus} place {placeable}"] if cluster.replicas > placeable else []
    if cluster.cpus_per_replica * cluster.replicas > have.get("CPU", 0):
        short.append(f"{cluster.replicas} replicas need {cluster.cpus_per_replica * cluster.replicas:g} CPUs "
                     f"({cluster.cpus_per_replica:g} each) and the Ray cluster has {have.get('CPU', 0):g}")
    if not short:
        return
    message = "; ".join(short) + " (--gpus-per-replica, --cpus-per-replica and --replicas set what they ask for)"
    if cluster.ray_address is None:
        raise ClusterStartError(message)
    log.warning("%s: Serve waits until the cluster has them", message)


def deploy(cluster: ClusterSettings, replica: ReplicaSettings, frontend: FrontendSettings) -> None:
    """:func:`start` after :func:`prepare`: a caller that must tell a refusal from a failed deployment (which it
    then stops) calls the two apart."""
    check_resources(cluster)
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
                              graceful_shutdown_timeout_s=cluster.replica_stop_s,
                              ray_actor_options={"num_cpus": cluster.cpus_per_replica,
                                                 "num_gpus": cluster.gpus_per_replica},
                              request_router_config=router)
    front = serve.deployment(Frontend, name="Frontend", num_replicas=1, max_ongoing_requests=4096,
                             graceful_shutdown_timeout_s=cluster.replica_stop_s, ray_actor_options={"num_cpus": 0})
    try:
        serve.run(front.bind(frontend, engine.bind(replica)), name=cluster.app_name, route_prefix=ROUTE_PREFIX)
    except RuntimeError as exc:  # Serve's DEPLOY_FAILED: the cause is in a deployment's status, not in the exception
        raise ClusterStartError(_failed_deployment(cluster.app_name) or str(exc)) from None


#: the line a Python traceback ends on, naming the exception: where a replica's own error starts
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt): ")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DEPLOYMENTS = {"EngineReplica": "an engine replica", "Frontend": "the front door"}


def _failed_deployment(app_name: str) -> str | None:
    """The first failed deployment of ``app_name`` and its replica's exception (the end of the traceback Serve
    keeps in the deployment's status), or None when Serve names none."""
    app = serve.status().applications.get(app_name)
    for name, deployment in (app.deployments.items() if app else ()):
        if deployment.status != "DEPLOY_FAILED" or not deployment.message:
            continue
        who = _DEPLOYMENTS.get(name, name)
        lines = _ANSI.sub("", deployment.message).splitlines()
        starts = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line)]
        if not starts:
            return f"{who} could not start: {lines[0]}"
        kind, text = "\n".join(lines[starts[-1]:]).split(": ", 1)
        return f"{who} could not start: {kind.rsplit('.', 1)[-1]}: {text}"  # CheckpointError, not its module path
    return None


def stop(cluster: ClusterSettings, within: float | None = None) -> bool:
    """Removes the application and its directory (the Ray instance stays), waiting at most ``within`` seconds
    (default: :attr:`ClusterSettings.stop_bound_s`) for the application to be gone. False when it was not: the
    deletion goes on in Serve, and the caller decides whether to stop Ray under it."""
    within = cluster.stop_bound_s if within is None else within
    deadline = time.monotonic() + within
    try:
        serve.delete(cluster.app_name, _blocking=False)  # Serve's own wait is a fixed 60 s: this one is the caller's
        while cluster.app_name in serve.status().applications:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.25)
        return True
    finally:  # detached: left, it would outlive the command on a joined cluster
        with contextlib.suppress(ValueError):  # already gone
            ray.kill(ray.get_actor(cluster.directory, namespace=NAMESPACE))
