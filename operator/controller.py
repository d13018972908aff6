"""Carries out reconcile passes: read the job's children and trainer rank 0, let the pure `decide` choose, then
delete/create children, write the status once, and post events only after that write succeeded.

Two kinds of pass share one function and one per-job lock:
- the Kopf handlers (create/resume/update) run a *full* pass;
- a per-job monitor task runs a pass every `interval` seconds (sooner when a decision asks) to follow the
  workloads and the trainer's /status, restart a failed trainer, and delete the job after its TTL.
Every pass makes sure the Secret, Services and NetworkPolicy exist (drift repair: one deleted by hand comes back;
create-if-absent, so the token is never regenerated) and reads each child's controlling owner: a child of the same
name that still belongs to a deleted job of the same name (garbage collection takes a moment) is never taken for
this job's; the pass waits for it to go. A child the API server refuses to create fails the job with the API's
message (grpolora.operator.reconcile.decide_refused) instead of leaving Kopf to retry it silently.

The monitors are plain asyncio tasks rather than Kopf daemons or timers: those make Kopf put a finalizer on every
job, so `kubectl delete` would hang whenever the operator is down or uninstalled, while nothing outside the
cluster needs cleaning up (children go by ownerReferences).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import random
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from grpolora.api import constants as c
from grpolora.api.plan import child_names, plan
from grpolora.api.status import JobStatus
from grpolora.operator import kube, names
from grpolora.operator import observe as obs
from grpolora.operator import reconcile as rec
from grpolora.operator.metrics import Metrics
from grpolora.operator.peering import Gate, Standalone
from grpolora.operator.trainer_client import TrainerStatusClient, TrainerUnavailable, status_url

logger = logging.getLogger(__name__)
TOKEN_BYTES: Final = 32


@dataclass(frozen=True)
class ControllerConfig:
    interval: float = 10.0
    """Seconds between monitor passes of one job (trainer /status polls and workload checks)."""
    jitter: float = 0.1
    """Fraction of the interval added at random, so that many jobs do not poll in lockstep."""
    max_backoff: float = 60.0
    """Longest wait after failed passes (doubling from the interval)."""


class JobGone(Exception):
    """The GRPOLoraJob no longer exists (deleted, or removed after its TTL)."""


class ChildRefused(Exception):
    """The API server refused to create one of the job's children."""

    def __init__(self, error: kube.ApiError, obj: Mapping[str, Any]):
        super().__init__(str(error))
        self.error = error
        self.refusal = rec.Refusal(obj["kind"], obj["metadata"]["name"], error.status, error.message or error.reason)


@dataclass
class _Job:
    namespace: str
    name: str
    uid: str
    body: dict[str, Any]
    status: dict[str, Any]
    """The status as last written by us (or as read, before our first write): newer than any watch event."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    due: float = 0.0
    task: asyncio.Task[None] | None = None


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Controller:
    def __init__(
        self,
        client: kube.KubeClient,
        trainer: TrainerStatusClient,
        metrics: Metrics,
        config: ControllerConfig | None = None,
        *,
        gate: Gate | None = None,
        clock: Callable[[], datetime.datetime] = utcnow,
    ):
        self.client, self.trainer, self.metrics = client, trainer, metrics
        self.config = config or ControllerConfig()
        self.gate: Gate = gate or Standalone()
        self.clock = clock
        self.jobs: dict[tuple[str, str], _Job] = {}

    # ---- entry points ------------------------------------------------------------------------------------

    async def reconcile(self, body: Mapping[str, Any]) -> rec.Decision:
        """A full pass for a created, resumed or changed job; then make sure its monitor runs."""
        job = self._track(body)
        try:
            with self.metrics.timed("reconcile"):
                async with job.lock:
                    decision = await self._pass(job, full=True)
        except JobGone:
            self.forget(job.namespace, job.name)
            raise
        self._schedule(job, decision)
        return decision

    def forget(self, namespace: str, name: str) -> None:
        """The job was deleted: stop its monitor and drop its metrics."""
        job = self.jobs.pop((namespace, name), None)
        if job is not None and job.task is not None and job.task is not asyncio.current_task():
            job.task.cancel()
        self.metrics.forget_job(namespace, name)

    async def stop(self) -> None:
        tasks = [job.task for job in self.jobs.values() if job.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.jobs.clear()
        await self.trainer.close()
        await self.client.close()

    # ---- the pass ----------------------------------------------------------------------------------------

    async def _pass(self, job: _Job, *, full: bool) -> rec.Decision:
        """One reconcile pass (`full` for the handlers' passes; both kinds do the same work today)."""
        view = rec.job_view(job.body)
        old = rec.stored_status(job.status)
        try:
            blocked: list[rec.ChildRef] = []
            if view.job is not None and not rec.is_finished(old):
                blocked += await self._ensure_kept_children(job, view)
            observed = await self._observe(view, old, blocked)
            decision = rec.decide(view, old, observed, self.clock())
            await self._change_workloads(job, decision)
        except ChildRefused as refused:
            decision = rec.decide_refused(view, old, refused.refusal, self.clock())
            logger.warning("%s/%s: %s", job.namespace, job.name, decision.status.message)
            await self._record(job, decision)
            if refused.refusal.transient:
                raise refused.error from None
            return decision
        await self._record(job, decision)
        return decision

    async def _create(self, job: _Job, obj: Mapping[str, Any]) -> bool:
        """Create if absent (False on 409); an API refusal becomes ChildRefused."""
        try:
            new = await self.client.create(obj)
        except kube.ApiError as exc:
            raise ChildRefused(exc, obj) from exc
        if new:
            logger.info("%s/%s: created %s %s", job.namespace, job.name, obj["kind"], obj["metadata"]["name"])
        return new

    async def _ensure_kept_children(self, job: _Job, view: rec.JobView) -> list[rec.ChildRef]:
        """Make sure the Secret, Services and NetworkPolicy exist; return those that belong to an older job."""
        assert view.job is not None
        if view.record_applied is not None:
            # Recorded before anything is created, so a restarted operator always knows what the children run.
            annotations = {names.APPLIED_SPEC_ANNOTATION: view.record_applied}
            patched = await self.client.patch(
                kube.GRPOLORAJOB, job.namespace, job.name, {"metadata": {"annotations": annotations}}
            )
            if patched is None:
                raise JobGone(f"{job.namespace}/{job.name}")
            job.body.setdefault("metadata", {}).setdefault("annotations", {}).update(annotations)
        # A fresh token each time, used only if the Secret does not exist yet (create-if-absent).
        kept, _ = rec.children(plan(view.job), uid=view.uid, token=secrets.token_urlsafe(TOKEN_BYTES))

        async def ensure(obj: dict[str, Any]) -> rec.ChildRef | None:
            kind, name = kube.kind_of(obj), obj["metadata"]["name"]
            existing = await self.client.get(kind, job.namespace, name)
            if existing is None:
                if await self._create(job, obj):
                    return None
                existing = await self.client.get(kind, job.namespace, name)  # created meanwhile: by whom?
            if existing is not None and obs.controller_uid(existing) != view.uid:
                return rec.ChildRef(kind.kind, name)
            return None

        found = await asyncio.gather(*(ensure(obj) for obj in kept))
        return [ref for ref in found if ref is not None]

    async def _observe(self, view: rec.JobView, old: JobStatus, blocked: list[rec.ChildRef]) -> rec.Observed:
        if view.job is None:
            return rec.Observed()
        workloads = child_names(view.name)
        trainer_job, inference = await asyncio.gather(
            self.client.get(kube.JOB, view.namespace, workloads["trainer"]),
            self.client.get(kube.STATEFULSET, view.namespace, workloads["inference"]),
        )
        # A workload of a deleted job of the same name is not this job's: its state (e.g. Complete) says nothing.
        if trainer_job is not None and obs.controller_uid(trainer_job) != view.uid:
            blocked.append(rec.ChildRef("Job", workloads["trainer"]))
            trainer_job = None
        if inference is not None and obs.controller_uid(inference) != view.uid:
            blocked.append(rec.ChildRef("StatefulSet", workloads["inference"]))
            inference = None
        spec = view.job.spec
        pods: list[dict[str, Any]] = []
        warnings: tuple[obs.NotReady, ...] = ()
        not_ready = (
            obs.job_ready(trainer_job) < spec.trainer.replicas
            or obs.statefulset_ready(inference) < spec.inference.replicas
        )
        running = not spec.suspend and not rec.is_finished(old)
        if running and (trainer_job or inference) and not_ready:
            pods, events = await asyncio.gather(
                self.client.list(kube.POD, view.namespace, {c.LABEL_JOB: view.name}),
                self.client.list(kube.EVENT, view.namespace, {}, fields={"type": "Warning"}),
            )
            desired = {"Job": spec.trainer.replicas, "StatefulSet": spec.inference.replicas}
            present = [w for w in (trainer_job, inference) if w is not None]
            warnings = obs.pod_warnings(events, present, pods, desired)
        claims: dict[str, tuple[str, ...] | None] = {}
        if running:
            uses = rec.volume_uses(spec)
            found = await asyncio.gather(*(self.client.get(kube.PVC, view.namespace, use.claim) for use in uses))
            for use, claim in zip(uses, found, strict=True):
                claims[use.claim] = tuple((claim.get("spec") or {}).get("accessModes") or ()) if claim else None
        report, error = None, None
        if rec.should_poll_trainer(view, old, trainer_job):
            try:
                report = await self.trainer.fetch(status_url(plan(view.job)))
            except TrainerUnavailable as exc:
                error = str(exc)
        return rec.Observed(
            trainer_job, inference, tuple(pods), report, error, blocked=tuple(blocked), warnings=warnings, claims=claims
        )

    async def _change_workloads(self, job: _Job, decision: rec.Decision) -> None:
        # Deletes first: a replaced trainer Job is deleted and created under the same name.
        await asyncio.gather(*(self.client.delete(kube.KINDS[r.kind], job.namespace, r.name) for r in decision.delete))
        for ref in decision.delete:
            logger.info("%s/%s: deleted %s %s", job.namespace, job.name, ref.kind, ref.name)
        # A 409 (created meanwhile, e.g. by an older job of this name) is read, owner and all, on the next pass.
        await asyncio.gather(*(self._create(job, obj) for obj in decision.create))

    async def _record(self, job: _Job, decision: rec.Decision) -> None:
        """Write the status, then post the events (only after the write succeeded); delete the job after its TTL."""
        patch = rec.status_patch(job.status, decision.status)
        if patch is not None:
            written = await self.client.patch(
                kube.GRPOLORAJOB, job.namespace, job.name, {"status": patch}, subresource="status"
            )
            if written is None:
                raise JobGone(f"{job.namespace}/{job.name}")
            job.status = dict(written.get("status") or decision.status.to_wire())
        self.metrics.set_job(job.namespace, job.name, decision.status)
        involved = {"namespace": job.namespace, "name": job.name, "uid": job.uid}
        for event in decision.events:
            try:
                await self.client.post_event(involved, event.type, event.reason, event.message, now=self.clock())
            except kube.ApiError as exc:
                logger.warning("%s/%s: could not post event %s: %s", job.namespace, job.name, event.reason, exc)
        if decision.delete_job:
            await self.client.delete(kube.GRPOLORAJOB, job.namespace, job.name)
            logger.info("%s/%s: deleted after ttlSecondsAfterFinished", job.namespace, job.name)
            raise JobGone(f"{job.namespace}/{job.name}")

    # ---- monitors ----------------------------------------------------------------------------------------

    def _track(self, body: Mapping[str, Any]) -> _Job:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", "default"), meta.get("name", ""))
        uid = meta.get("uid", "")
        job = self.jobs.get(key)
        if job is None or job.uid != uid:  # new, or deleted and re-created under the same name
            if job is not None:
                self.forget(*key)
            job = _Job(key[0], key[1], uid, dict(body), dict(body.get("status") or {}))
            self.jobs[key] = job
        else:
            known = (job.body.get("metadata") or {}).get("annotations") or {}
            job.body = dict(body)
            applied = known.get(names.APPLIED_SPEC_ANNOTATION)
            annotations = job.body.setdefault("metadata", {}).setdefault("annotations", {})
            if applied is not None and names.APPLIED_SPEC_ANNOTATION not in annotations:
                annotations[names.APPLIED_SPEC_ANNOTATION] = applied  # the event predates our own write
        return job

    def _schedule(self, job: _Job, decision: rec.Decision) -> None:
        if decision.idle:
            return
        loop = asyncio.get_running_loop()
        job.due = loop.time() + self._delay(decision)
        if job.task is None or job.task.done():
            job.task = asyncio.create_task(self._monitor(job), name=f"grpolora monitor {job.namespace}/{job.name}")
        else:
            job.wake.set()

    def _delay(self, decision: rec.Decision) -> float:
        if decision.requeue_after is not None:
            return decision.requeue_after
        return self.config.interval * (1 + random.uniform(0, self.config.jitter))

    async def _monitor(self, job: _Job) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            job.wake.clear()
            wait = job.due - loop.time()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(job.wake.wait(), timeout=wait)
                continue  # re-read `due`: a handler pass may have moved it
            try:
                if not await self.gate.active(job.namespace):
                    job.due = loop.time() + self.config.interval
                    continue
                with self.metrics.timed("monitor"):
                    async with job.lock:
                        decision = await self._pass(job, full=False)
            except JobGone:
                self.forget(job.namespace, job.name)
                return
            except Exception as exc:
                failures += 1
                backoff = min(self.config.interval * 2**failures, self.config.max_backoff)
                logger.warning(
                    "%s/%s: monitor pass failed (%s); retrying in %.0fs", job.namespace, job.name, exc, backoff
                )
                job.due = loop.time() + backoff
                continue
            failures = 0
            if decision.idle:
                return
            job.due = loop.time() + self._delay(decision)
