"""The Kopf handlers: thin, typed, each hands over to the Controller and maps its outcome to Kopf's errors.

Registered on a registry built here (not Kopf's global one), so tests and the benchmark can run operators with
their own login and settings in one process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from grpolora.api import constants as c
from grpolora.operator import conditions as cond
from grpolora.operator import kube, names
from grpolora.operator.controller import Controller
from grpolora.operator.scheduler import Gone
from grpolora.operator.watch_cache import WATCHED

# A transient API failure (unreachable, throttled, 5xx) is retried this soon; Kopf's default backoff is 60 s.
API_RETRY_SECONDS = 5.0


def _controller(memo: kopf.Memo) -> Controller:
    controller: Controller = memo["controller"]
    return controller


async def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """One login for Kopf and for our API client (grpolora.operator.kube), from the same credentials."""
    info = memo["login"]()
    if info is None:
        raise kopf.LoginError("no Kubernetes credentials: neither a service account nor a kubeconfig was found")
    _controller(memo).client.use(info)
    return info


async def reconcile(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """create / resume / spec update: a full reconcile pass (see grpolora.operator.controller)."""
    try:
        decision = await _controller(memo).reconcile(_plain(body))
    except kube.ApiError as exc:
        if exc.transient:
            raise kopf.TemporaryError(f"Kubernetes API unavailable: {exc}", delay=API_RETRY_SECONDS) from exc
        raise  # e.g. 403 from missing RBAC: Kopf logs it and retries with its backoff
    except Gone:
        return
    invalid = cond.find(decision.status.conditions, names.INVALID_SPEC)
    if invalid is not None and invalid.status == "True":
        # Already reported in status and an Event; retrying cannot help until the spec changes.
        raise kopf.PermanentError(f"invalid spec: {invalid.message}")


async def reconcile_pool(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """RolloutPool create / resume / spec update: a pass of the pool (its admission, children and status)."""
    try:
        await _controller(memo).reconcile_pool(_plain(body))
    except kube.ApiError as exc:
        if exc.transient:
            raise kopf.TemporaryError(f"Kubernetes API unavailable: {exc}", delay=API_RETRY_SECONDS) from exc
        raise
    except Gone:
        return


async def pool_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Every watch event of a RolloutPool: its jobs read it from this cache (see Controller.pool_event)."""
    _controller(memo).pool_event(event.get("type"), _plain(body))


def _on_a_pool(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("inference") or {}).get("poolRef"))


async def job_on_pool_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A watch event of a job on a RolloutPool: may wake the pool's pass (see Controller.job_event)."""
    _controller(memo).job_event(event.get("type"), _plain(body))


def _is_deletion(event: kopf.RawEvent, **_: Any) -> bool:
    """Deleted, or being deleted (a deletionTimestamp: the garbage collector is removing its children)."""
    deleting = ((event.get("object") or {}).get("metadata") or {}).get("deletionTimestamp")
    return event["type"] == "DELETED" or bool(deleting)


async def deletion(event: kopf.RawEvent, body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """A job being deleted gets no new children; a deleted one's monitor stops (no finalizer: we learn of both from
    the watch stream)."""
    if event["type"] == "DELETED":
        _controller(memo).forget(namespace, name)
    else:
        _controller(memo).deleting(_plain(body))


async def workload_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A watch event of one of the jobs' watched children (see Controller.workload_event)."""
    _controller(memo).workload_event(str(body.get("kind", "")), event.get("type"), _plain(body))


async def monitored_jobs(memo: kopf.Memo, **_: Any) -> int:
    """Reported at the liveness endpoint (/healthz) next to Kopf's own checks."""
    return len(_controller(memo).jobs)


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await _controller(memo).stop()


def build_registry() -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(cleanup)
    kopf.on.probe(registry=registry, id="monitoredJobs")(monitored_jobs)
    resource = (c.GROUP, c.VERSION, c.PLURAL)
    # One id for all three: a create seen at start-up is handled once, not once as create and once as resume.
    kopf.on.create(*resource, registry=registry, id="reconcile")(reconcile)
    kopf.on.resume(*resource, registry=registry, id="reconcile")(reconcile)
    # Only spec changes matter (our own annotation and status writes must not trigger a pass).
    kopf.on.update(*resource, registry=registry, id="reconcile", field="spec")(reconcile)
    # And the Kueue queue label, which moves a job that waits to another queue (or out of Kueue) and is held while
    # Kueue admits it (job_view.with_queue_in_effect).
    queue_label = ("metadata", "labels", c.KUEUE_QUEUE_LABEL)
    kopf.on.update(*resource, registry=registry, id="queue-label", field=queue_label)(reconcile)
    # Filtered before invocation, so the other events (every status write) cost nothing and log nothing.
    kopf.on.event(*resource, registry=registry, id="deletion", when=_is_deletion)(deletion)
    # RolloutPools: the same pass machinery. Jobs on a pool wake their pool's pass when they come, finish or go (the
    # pass itself lists the jobs from the API); the pools' own events feed the cache their jobs read.
    kopf.on.event(*resource, registry=registry, id="wake-pool", when=_on_a_pool)(job_on_pool_event)
    pools = (c.GROUP, c.VERSION, c.POOL_PLURAL)
    kopf.on.create(*pools, registry=registry, id="reconcile")(reconcile_pool)
    kopf.on.resume(*pools, registry=registry, id="reconcile")(reconcile_pool)
    kopf.on.update(*pools, registry=registry, id="reconcile", field="spec")(reconcile_pool)
    kopf.on.event(*pools, registry=registry, id="watch-pools")(pool_event)
    # The jobs' children by watch (one per kind and namespace, shared by all jobs), not by a GET per job and pass.
    # The API server filters them by the operator's label (main.build_settings); `labels=` keeps the jobs' own.
    ours = {c.LABEL_MANAGED_BY: c.OPERATOR_NAME, c.LABEL_JOB: kopf.PRESENT}
    for kind in WATCHED:
        kopf.on.event(kind.group, kind.version, kind.plural, labels=ours, registry=registry, id=f"watch-{kind.plural}")(
            workload_event
        )
    return registry


def _plain(value: Any) -> Any:
    """Kopf's body views -> plain dicts and lists (the controller keeps and edits its own copy)."""
    if isinstance(value, Mapping):
        return {key: _plain(value[key]) for key in value}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value
