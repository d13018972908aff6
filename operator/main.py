"""Assemble and run the operator: Kopf settings, the controller, the metrics endpoint (`grpolora operator`)."""

from __future__ import annotations

import logging
import os
import random
import re
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from grpolora.api import constants as c
from grpolora.api.plan import WorkerDefaults, set_worker_defaults
from grpolora.operator import names
from grpolora.operator.controller import Controller
from grpolora.operator.handlers import build_registry
from grpolora.operator.kube import KUEUE_WORKLOAD, ApiError, KubeClient, Login, RateLimiter, format_selector
from grpolora.operator.metrics import Metrics
from grpolora.operator.peering import PeeringGate, Standalone, ensure_peering_objects
from grpolora.operator.scheduler import ControllerConfig
from grpolora.operator.trainer_client import TrainerStatusClient
from grpolora.operator.watch_cache import CHILDREN_SELECTOR, WATCHED

logger = logging.getLogger(__name__)


# An image reference with a tag or a digest (the repository part is left to the registry to judge).
IMAGE_REFERENCE = re.compile(r"[^\s@]+(:[\w][\w.-]{0,127}|@sha256:[a-f0-9]{64})")
SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


@dataclass(frozen=True)
class OperatorOptions:
    namespaces: tuple[str, ...] = ()
    """Serve these namespaces (exact names); empty with all_namespaces."""
    all_namespaces: bool = False
    metrics_port: int = 9090
    """Prometheus /metrics; 0 disables it."""
    health_port: int = 8081
    """Kopf's liveness endpoint /healthz; 0 disables it."""
    peering: str | None = c.OPERATOR_NAME
    """Kopf peering object name (leader election between replicas); None runs standalone."""
    priority: int | None = None
    """Peering priority; random by default, so that replicas never tie (Kopf pauses all replicas on a tie)."""
    status_interval: float = 10.0
    """Seconds between a job's monitor passes (trainer /status polls)."""
    api_qps: float = 100.0
    """Requests per second the operator's own client may send to the API server (after a burst of api_burst)."""
    api_burst: int = 200
    resync_interval: float = 600.0
    """Seconds between a job's full passes, which read its children from the API (drift repair of the Secret,
    Services, NetworkPolicy and PodDisruptionBudget; the workloads otherwise come from the operator's watch)."""
    worker_image_gpu: str | None = None
    """The image of every role with GPUs whose spec names none (cluster-wide); None: the project's."""
    worker_image_cpu: str | None = None
    """Likewise for roles without GPUs."""
    worker_image_pull_secrets: tuple[str, ...] = ()
    """Secrets every worker pod pulls its images with (in each job's namespace)."""
    bind: str = "0.0.0.0"
    operator_namespace: str = field(
        default_factory=lambda: os.environ.get("POD_NAMESPACE") or c.DEFAULT_OPERATOR_NAMESPACE
    )
    """The operator's own namespace (the chart sets POD_NAMESPACE from the pod): job NetworkPolicies admit its
    /status polls from there only."""

    def __post_init__(self) -> None:
        if self.all_namespaces == bool(self.namespaces):
            raise ValueError("serve either all namespaces or a list of namespaces")
        for port, flag in ((self.metrics_port, "--metrics-port"), (self.health_port, "--health-port")):
            if not 0 <= port <= 65535:
                raise ValueError(f"{flag}: {port} is not a port number")
        if self.status_interval <= 0:
            raise ValueError(f"--status-interval must be positive, got {self.status_interval}")
        if self.api_qps <= 0 or self.api_burst < 1:
            raise ValueError(
                f"--api-qps must be positive and --api-burst at least 1, got {self.api_qps}, {self.api_burst}"
            )
        if self.resync_interval <= 0:
            raise ValueError(f"--resync-interval must be positive, got {self.resync_interval}")
        for image, flag in (
            (self.worker_image_gpu, "--worker-image-gpu"),
            (self.worker_image_cpu, "--worker-image-cpu"),
        ):
            # Pinned, so that a job started today and its replacement pod next week run the same image.
            if image is not None and not IMAGE_REFERENCE.fullmatch(image):
                raise ValueError(
                    f"{flag}: {image!r} is not an image with a tag or a digest (name:tag, name@sha256:...)"
                )
        for name in self.worker_image_pull_secrets:
            if not SECRET_NAME.fullmatch(name):
                raise ValueError(f"--worker-image-pull-secret: {name!r} is not a Secret name")

    def worker_defaults(self) -> WorkerDefaults:
        """What roles whose spec says nothing get (grpolora.api.plan.WorkerDefaults)."""
        default = WorkerDefaults()
        return WorkerDefaults(
            image_gpu=self.worker_image_gpu or default.image_gpu,
            image_cpu=self.worker_image_cpu or default.image_cpu,
            image_pull_secrets=tuple(self.worker_image_pull_secrets),
        )


async def _kueue_served(client: KubeClient) -> bool:
    """Whether Kueue's Workloads are served as the operator starts, when Kopf discovers what it can watch (once:
    scanning is off). Kueue installed later is followed without a watch (grpolora.operator.controller)."""
    try:
        served = await client.served(KUEUE_WORKLOAD)
    except ApiError as exc:
        logger.warning("cannot tell whether Kueue is installed (%s); assuming it is", exc)
        return True
    if not served:
        logger.warning(
            "Kueue's Workload API is not served (Kueue is not installed): jobs with the %s label wait for it, and "
            "once it is installed their Workloads are read on every pass instead of watched; restart the operator "
            "after installing Kueue to watch them",
            c.KUEUE_QUEUE_LABEL,
        )
    return served


def build_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # Namespaces are named exactly and the CRD is installed before the operator, so Kopf need not list namespaces
    # or watch CRDs: two cluster-wide permissions fewer (see grpolora.operator.rbac).
    settings.scanning.disabled = True
    # The controller posts its own Events for the key transitions; Kopf's per-handler events would repeat them.
    settings.posting.enabled = False
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.progress_storage = kopf.SmartProgressStorage(prefix=names.KOPF_PREFIX)
    # The jobs' children are listed and watched with the operator's label as the API server's labelSelector (Kopf
    # sends it on both: kopf/_cogs/clients/fetching.py and watching.py), not filtered by the handlers' `labels=`
    # after the server has streamed, and this process decoded, every tenant's Jobs, Services... of the namespaces
    # served. The same selector as the namespaces' re-lists (watch_cache.CHILDREN_SELECTOR).
    for kind in WATCHED:
        settings.watching.label_selectors[kind.group, kind.version, kind.plural] = format_selector(CHILDREN_SELECTOR)
    # Reconnect watches now and then: a silently dropped connection would otherwise stall the operator.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    return settings


def default_login(settings: kopf.OperatorSettings) -> Login:
    """In a pod: the service account; elsewhere: the kubeconfig ($KUBECONFIG or ~/.kube/config)."""

    def login() -> kopf.ConnectionInfo | None:
        return kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)

    return login


def own_identity() -> str:
    """This replica's name among peers: the pod name where the chart sets POD_ID, else host and a random tag."""
    return os.environ.get("POD_ID") or f"{socket.gethostname()}/{secrets.token_hex(3)}"


def peering_priority(configured: int | None) -> int:
    """This replica's peering priority: the configured one, else drawn at random from 2**31 - 1 values. Kopf runs
    the live peer of the highest priority and pauses the others (every one of them on a tie), so replicas of one pod
    template, which cannot be given distinct flags, draw their own: two tie with a chance of 1 in 2**31, and then
    both pause and log a warning until one of them is restarted and draws again."""
    return configured if configured is not None else random.randint(1, 2**31 - 1)


async def start_metrics_server(metrics: Metrics, host: str, port: int) -> web.AppRunner:
    async def serve_metrics(_: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", serve_metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def serve(
    options: OperatorOptions,
    *,
    login: Login | None = None,
    stop_flag: Any = None,
    ready_flag: Any = None,
    on_controller: Callable[[Controller], None] | None = None,
) -> None:
    """Run until stopped (SIGINT/SIGTERM, or `stop_flag` when run inside another program such as the tests)."""
    set_worker_defaults(options.worker_defaults())
    settings = build_settings()
    login = login or default_login(settings)
    identity = own_identity()
    priority = peering_priority(options.priority)
    client = KubeClient(login, instance=identity, rate_limit=RateLimiter(options.api_qps, options.api_burst))
    gate = (
        Standalone()
        if options.peering is None
        else PeeringGate(
            client, name=options.peering, identity=identity, priority=priority, clusterwide=options.all_namespaces
        )
    )
    metrics = Metrics()
    controller = Controller(
        client,
        TrainerStatusClient(metrics=metrics),
        metrics,
        ControllerConfig(
            interval=options.status_interval,
            resync_interval=options.resync_interval,
            operator_namespace=options.operator_namespace,
        ),
        gate=gate,
    )
    if on_controller is not None:
        on_controller(controller)
    runner = await start_metrics_server(metrics, options.bind, options.metrics_port) if options.metrics_port else None
    try:
        controller.queue_watched = await _kueue_served(client)
        if options.peering is not None:
            await ensure_peering_objects(
                client, name=options.peering, clusterwide=options.all_namespaces, namespaces=options.namespaces
            )
        await kopf.operator(
            registry=build_registry(),
            settings=settings,
            standalone=options.peering is None,
            peering_name=options.peering,
            priority=priority,
            identity=identity,  # type: ignore[arg-type]  # kopf.Identity is a NewType of str, a str at run time
            clusterwide=options.all_namespaces,
            namespaces=list(options.namespaces),
            liveness_endpoint=f"http://{options.bind}:{options.health_port}/healthz" if options.health_port else None,
            memo=kopf.Memo(controller=controller, login=login),
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        await controller.stop()  # also when Kopf failed before its cleanup handlers ran
        if runner is not None:
            await runner.cleanup()
