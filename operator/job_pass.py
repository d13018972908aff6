"""The controller's pass of a GRPOLoraJob (run by the operator): read its children (cache or API) and trainer rank 0,
and let the pure reconcile.decide choose; grpolora.operator.job_writes changes its children, writes its status once,
then posts its events."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from grpolora.api import constants as c
from grpolora.api.plan import JobPlan, child_names, plan
from grpolora.api.status import JobStatus
from grpolora.operator import attempts, job_failure, kube, pools, readiness
from grpolora.operator import observe as obs
from grpolora.operator import reconcile as rec
from grpolora.operator.job_status import failed_at_this_generation, is_finished, stored_status
from grpolora.operator.job_view import JobView, job_view, runtime_to_read, with_queue_in_effect
from grpolora.operator.job_writes import ChildRefused
from grpolora.operator.scheduler import Tracked, is_deleting
from grpolora.operator.trainer_client import TrainerUnavailable, status_url

logger = logging.getLogger(__name__)


class JobPass:
    """One reconcile pass of a job: the Controller's part that reads, decides and writes for a GRPOLoraJob.
    Its state is set in Controller.__init__."""

    async def _pass(self, job: Tracked, *, full: bool) -> rec.Decision:
        """One reconcile pass (full: children read from the API; see grpolora.operator.controller)."""
        # The status as last written by us (job.status) is newer than the one in the last watch event (job.body).
        body = {**job.body, "status": job.status}
        view = job_view(body, await self._runtime(body))
        old = stored_status(job.status)
        view = await self._queue_in_effect(view, old)
        # Nothing to read: a job being deleted gets nothing, one waiting for its runtime has nothing yet, and one that
        # failed to start at this generation gets nothing until its spec changes (only its Workload is looked at).
        held = failed_at_this_generation(old, view.generation)
        if view.deleting and view.job is not None:
            decision = rec.decide_deleting(view, old, await self._leaving_workloads(view), self.clock())
            await self._change_workloads(job, decision)
            await self._record(job, decision)
            return decision
        if view.deleting or view.runtime_wait is not None or held:
            queue_workload = None
            if held and not view.deleting and view.job is not None and view.job.queue_name is not None:
                queue_workload = await self._workload(kube.KUEUE_WORKLOAD, view.namespace, view.name)
            decision = rec.decide(view, old, rec.Observed(queue_workload=queue_workload), self.clock())
            await self._record(job, decision)
            return decision
        # Children never created (e.g. the job waited for its pool): create them now, not at the next resync.
        full = full or view.record_applied is not None
        if full:
            job.next_full = asyncio.get_running_loop().time() + self.config.resync_interval
            await self._relisted(job.namespace)
        pool: pools.PoolView | None = None
        if view.job is not None and view.job.spec.inference.pool_ref is not None:
            pool = await self._pool_view(view, full=full)
        # A job on a pool is planned with it; one whose pool is missing or does not fit gets no children.
        job_plan = None
        if view.job is not None and (pool is None or pool.usable_by(view.job)):
            job_plan = plan(view.job, pool=pool.pool if pool else None)
        try:
            blocked: list[rec.ChildRef] = []
            if full and job_plan is not None and not is_finished(old):
                blocked += await self._ensure_kept_children(job, view, job_plan)
            if (
                view.record_applied is not None
                and not blocked
                and job_plan is not None
                and not job_plan.job.spec.suspend
            ):
                # First pass of a new job whose kept children were all just created: its workloads cannot exist
                # yet (were they there after all, creating them answers 409 and the next pass reads their owner).
                assert view.job is not None
                queued = view.job.queue_name is not None and not job.queue_api_missing
                claims, queue_workload = await asyncio.gather(
                    self._claims(job, view),
                    # Just ensured: an ending before the job ever starts finishes it too (job_queue.finish_workload),
                    # or Kueue would admit a failed job's Workload and hold its quota.
                    self._workload(kube.KUEUE_WORKLOAD, view.namespace, view.name) if queued else _none(),
                )
                observed = rec.Observed(
                    claims=claims,
                    pool=pool,
                    queue_workload=queue_workload,
                    queue_api_missing=job.queue_api_missing,
                    token=job.token,
                )
            else:
                observed = await self._observe(job, view, old, blocked, full=full, job_plan=job_plan, pool=pool)
            if job.queue_api_missing and observed.queue_workload is None:
                job.next_full = 0.0  # its Workload could not be created (no Kueue yet): the next pass retries
            if is_deleting(job.body):  # found out while ensuring the kept children
                view = dataclasses.replace(view, deleting=True)
            decision = rec.decide(view, old, observed, self.clock())
            if decision.needs:
                # Workloads about to be created: read what that needs, all at once, and decide a second, last time.
                observed = await self._read_needs(job, view, observed, decision.needs)
                decision = rec.decide(view, old, observed, self.clock())
                if decision.needs:  # (not expected: every need was read) create nothing unchecked, look again soon
                    decision = dataclasses.replace(
                        decision, create=(), requeue_after=rec.REPLACE_RECHECK_SECONDS, idle=False
                    )
            # Before a restart (or the end) deletes the failed trainer's pods: keep its log tail (status, event).
            decision = await attempts.kept_in(decision, old, observed, view.namespace, self.client)
            if not await self._change_workloads(job, decision):
                # Taken meanwhile (e.g. by an older job of this name): look again soon, owner and all.
                decision = dataclasses.replace(decision, requeue_after=rec.REPLACE_RECHECK_SECONDS, idle=False)
        except ChildRefused as refused:
            queue_workload = None
            if view.job is not None and view.job.queue_name is not None and not refused.refusal.transient:
                # The job ends: its Workload is marked Finished (job_queue.finish_workload): its quota goes back.
                queue_workload = await self._workload(kube.KUEUE_WORKLOAD, view.namespace, view.name)
            decision = rec.decide_refused(view, old, refused.refusal, self.clock(), queue_workload=queue_workload)
            logger.warning("%s/%s: %s", job.namespace, job.name, decision.status.message)
            if decision.status.phase == "Failed":
                await self._withdraw_workloads(job, view)
            await self._record(job, decision)
            if refused.refusal.transient:
                raise refused.error from None
            return decision
        if not await self._record(job, decision):
            decision = dataclasses.replace(decision, requeue_after=rec.REPLACE_RECHECK_SECONDS, idle=False)
        return decision

    async def _leaving_workloads(self, view: JobView) -> rec.Observed:
        """For a job being deleted: its own workloads, and its pods (as they are now) while one of them is leaving."""
        workloads = child_names(view.name)
        assert view.job is not None
        served = view.job.spec.environment_server is not None
        found = await asyncio.gather(
            self._workload(kube.JOB, view.namespace, workloads[c.ROLE_TRAINER]),
            self._workload(kube.STATEFULSET, view.namespace, workloads[c.ROLE_INFERENCE]),
            # (Not read for a job without a server: its spec is the applied one, which cannot have changed.)
            self._workload(kube.STATEFULSET, view.namespace, workloads[c.ROLE_ENVIRONMENT]) if served else _none(),
        )
        ours = [w if w is not None and obs.controller_uid(w) == view.uid else None for w in found]
        pods: list[dict[str, Any]] = []
        if any(w is not None and obs.deleting(w) for w in ours):
            pods = await self._pods_of_job(view, fresh=True)
        return rec.Observed(ours[0], ours[1], tuple(pods), environment=ours[2])

    async def _pods_of_job(self, view: JobView, *, fresh: bool) -> list[dict[str, Any]]:
        """The job's pods, from the listing of the operator's pods in its namespace (shared by its jobs)."""
        listed = await self._listing(kube.POD, view.namespace, {c.LABEL_MANAGED_BY: c.OPERATOR_NAME}, fresh=fresh)
        return [p for p in listed if ((p.get("metadata") or {}).get("labels") or {}).get(c.LABEL_JOB) == view.name]

    async def _observe(
        self,
        job: Tracked,
        view: JobView,
        old: JobStatus,
        blocked: list[rec.ChildRef],
        *,
        full: bool,
        job_plan: JobPlan | None,
        pool: pools.PoolView | None,
    ) -> rec.Observed:
        if view.job is None:
            return rec.Observed()
        workloads = child_names(view.name)
        on_pool = view.job.spec.inference.pool_ref is not None
        server = view.job.spec.environment_server
        trainer_job, inference, environment = await asyncio.gather(
            self._workload(kube.JOB, view.namespace, workloads["trainer"]),
            # A job on a pool has no StatefulSet of its own.
            _none() if on_pool else self._workload(kube.STATEFULSET, view.namespace, workloads["inference"]),
            # (One left by a spec.environment.server since removed is no concern: the spec is locked while running.)
            _none()
            if server is None
            else self._workload(kube.STATEFULSET, view.namespace, workloads[c.ROLE_ENVIRONMENT]),
        )
        # A workload of a deleted job of the same name is not this job's: its state (e.g. Complete) says nothing.
        if trainer_job is not None and obs.controller_uid(trainer_job) != view.uid:
            blocked.append(rec.ChildRef("Job", workloads["trainer"]))
            trainer_job = None
        if inference is not None and obs.controller_uid(inference) != view.uid:
            blocked.append(rec.ChildRef("StatefulSet", workloads["inference"]))
            inference = None
        if environment is not None and obs.controller_uid(environment) != view.uid:
            blocked.append(rec.ChildRef("StatefulSet", workloads[c.ROLE_ENVIRONMENT]))
            environment = None
        spec = view.job.spec
        pods: list[dict[str, Any]] = []
        warnings: tuple[obs.NotReady, ...] = ()
        not_ready = (
            readiness.trainer_ranks_up(trainer_job) < spec.trainer.replicas
            or (not on_pool and obs.statefulset_ready(inference) < spec.inference.replicas)
            or (server is not None and obs.statefulset_ready(environment) < server.replicas)
        )
        running = not spec.suspend and not is_finished(old)
        # A workload being deleted: which of its pods are still active says when the quota can go back
        # (job_queue._nothing_active), as they are now (a listing taken before they ran would show none).
        present = [w for w in (trainer_job, inference, environment) if w is not None]
        leaving = any(obs.deleting(w) for w in present)
        if (running and present and not_ready) or leaving:
            # The trainer Job failed: its pods say why (a termination message written as it failed, likely after the
            # shared listing was taken), and the job's failure is final, so they are listed as they are now.
            failed = job_failure.job_failed(trainer_job) or leaving
            pods, events = await asyncio.gather(
                self._pods_of_job(view, fresh=failed),
                self._listing(kube.EVENT, view.namespace, {}, fields={"type": "Warning"}),
            )
            desired = {workloads["trainer"]: spec.trainer.replicas, workloads["inference"]: spec.inference.replicas}
            if server is not None:
                desired[workloads[c.ROLE_ENVIRONMENT]] = server.replicas
            warnings = obs.pod_warnings(events, present, pods, desired)
        claims = (await self._claims(job, view) if full else job.claims) if running else {}
        queue_workload = None
        if view.job.queue_name is not None:
            # Read once per pass: a full pass's _ensure_kept_children read it into the cache just before.
            queue_workload = await self._workload(kube.KUEUE_WORKLOAD, view.namespace, view.name)
        report, error = None, None
        if job_plan is not None and rec.should_poll_trainer(view, old, trainer_job):
            try:
                report = await self.trainer.fetch(status_url(job_plan))
            except TrainerUnavailable as exc:
                error = str(exc)
        return rec.Observed(
            trainer_job,
            inference,
            tuple(pods),
            report,
            error,
            blocked=tuple(blocked),
            warnings=warnings,
            claims=claims,
            queue_workload=queue_workload,
            queue_api_missing=job.queue_api_missing,
            pool=pool,
            token=job.token,
            environment=environment,
        )

    async def _pool_view(self, view: JobView, *, full: bool) -> pools.PoolView:
        """The job's RolloutPool: from the pools' watch (a cache, like the workloads'), or from the API on full passes
        and when the watch has not shown it."""
        assert view.job is not None and view.job.spec.inference.pool_ref is not None
        name = view.job.spec.inference.pool_ref.name
        key = (c.POOL_KIND, view.namespace, name)
        if full or key not in self.cache:
            found = await self.client.get(kube.ROLLOUTPOOL, view.namespace, name)
            self._pool_seen(view.namespace, name, None if found is None else dict(found), found or {}, read=True)
        body = self.cache.get(key)
        return pools.pool_view(name, body)

    async def _queue_in_effect(self, view: JobView, old: JobStatus) -> JobView:
        """The view with the Kueue queue the job runs under (job_view.with_queue_in_effect), from its Workload: read
        (from the watch's cache, or the API) when the job names a queue, else only as the watch last showed it (a job
        without a queue, and without a Workload, costs no read)."""
        if view.job is None or view.deleting:
            return view
        key = (kube.KUEUE_WORKLOAD.kind, view.namespace, view.name)
        if view.job.queue_name is not None or self.cache.get(key) is not None:
            workload = await self._workload(kube.KUEUE_WORKLOAD, view.namespace, view.name)
        else:
            workload = None
        return with_queue_in_effect(view, old, workload)

    async def _runtime(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """The runtime a job names, read from the API while the job has not started (its passes then use the one it
        recorded, and read none): one read a pass of a waiting job, at the monitor's interval."""
        ref = runtime_to_read(body)
        if ref is None:
            return None
        kind = kube.CLUSTER_GRPOLORA_RUNTIME if ref.kind == c.CLUSTER_RUNTIME_KIND else kube.GRPOLORA_RUNTIME
        namespace = (body.get("metadata") or {}).get("namespace", "default")
        return await self.client.get(kind, namespace if kind.namespaced else None, ref.name)

    async def _read_needs(self, job: Tracked, view: JobView, observed: rec.Observed, needs: rec.Needs) -> rec.Observed:
        """The observation with what the decision needs (rec.Needs), read concurrently."""
        owner, flavors, pods, managed = await asyncio.gather(
            # (A new job's first pass runs on the body its create handler was given: fresh enough, never asked.)
            self._owner_deleting(job) if needs.owner else _none(),
            self._flavors(needs.flavors) if needs.flavors else _none(),
            self._trainer_pods_left(view) if needs.trainer_pods else _none(),
            self._managed_secret(view) if needs.secrets else _none(),
        )
        if needs.trainer_pods and observed.trainer_job is None:
            unlabelled = await self._trainer_job_of(job, view, pods)
            if unlabelled is not None:  # ours after all: relabelled, and its pods are its own, not left over
                uid = (unlabelled.get("metadata") or {}).get("uid")
                pods = tuple(pod for pod in pods if obs.controller_uid(pod) != uid)
                observed = dataclasses.replace(observed, trainer_job=unlabelled)
        return dataclasses.replace(
            observed,
            owner_deleting=owner if needs.owner else observed.owner_deleting,
            flavors={**(observed.flavors or {}), **flavors} if flavors is not None else observed.flavors,
            trainer_pods_left=pods if needs.trainer_pods else observed.trainer_pods_left,
            managed_secret=managed if needs.secrets else observed.managed_secret,
            secrets_checked=observed.secrets_checked or needs.secrets,
        )

    async def _trainer_pods_left(self, view: JobView) -> tuple[dict[str, Any], ...]:
        """Trainer pods of this job's name that are still there (Terminating, most likely) while no trainer Job is.
        Listed by their labels when a trainer Job is about to be created (rare: a job's start, a restart, a resume),
        not from the shared listing, whose snapshot may be up to an interval old (and would then be stale for the
        failure messages that later passes read from it)."""
        labels = {c.LABEL_MANAGED_BY: c.OPERATOR_NAME, c.LABEL_JOB: view.name, c.LABEL_ROLE: c.ROLE_TRAINER}
        return tuple(await self.client.list(kube.POD, view.namespace, labels))

    async def _trainer_job_of(
        self, job: Tracked, view: JobView, pods: tuple[dict[str, Any], ...]
    ) -> dict[str, Any] | None:
        """The trainer Job that the trainer pods left of the job's name belong to, when it is this job's and not
        leaving, read from the API and relabelled: one that lost the operator's label (`kubectl label`, a policy
        engine) leaves the watches as DELETED while its pods run on, and was then waited on as "a previous trainer
        Job" (its pods keep their labels). Its controller owner says whose it is (owner checked, as _taken does)."""
        name = child_names(view.name)["trainer"]
        controllers = {
            ref.get("uid")
            for pod in pods
            for ref in (pod.get("metadata") or {}).get("ownerReferences") or []
            if ref.get("controller") and ref.get("kind") == "Job" and ref.get("name") == name
        }
        if not controllers:
            return None
        wanted = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "namespace": view.namespace, "ownerReferences": [
                {"controller": True, "uid": view.uid}
            ]},
        }  # fmt: skip
        found = await self._taken(job, wanted)
        if found is None or obs.controller_uid(found) != view.uid or obs.deleting(found):
            return None
        if (found.get("metadata") or {}).get("uid") not in controllers:
            return None
        return found

    async def _managed_secret(self, view: JobView) -> tuple[str, str] | None:
        """(field path, name) of the first Secret the job names that carries the operator's managed-by label; read
        only when its pods are about to be created (a missing Secret is the kubelet's to report)."""
        assert view.job is not None
        named = view.job.spec.secret_references()
        found = await asyncio.gather(*(self.client.get(kube.SECRET, view.namespace, name) for _, name in named))
        for (path, name), secret in zip(named, found, strict=True):
            labels = ((secret or {}).get("metadata") or {}).get("labels") or {}
            if labels.get(c.LABEL_MANAGED_BY) == c.OPERATOR_NAME:
                return path, name
        return None

    async def _flavors(self, names_: tuple[str, ...]) -> dict[str, dict[str, Any] | None]:
        """Kueue ResourceFlavors by name (cluster-scoped; None: not found or not readable, e.g. without the chart's
        kueue.resourceFlavors grant). Read only when workloads are about to be created, so no watch is kept (Kueue's
        own integrations read them at the same moment). A transient API failure fails the pass (retried)."""

        async def read(name: str) -> dict[str, Any] | None:
            try:
                return await self.client.get(kube.KUEUE_RESOURCE_FLAVOR, None, name)
            except kube.ApiError as exc:
                if exc.transient:
                    raise
                logger.warning("cannot read Kueue ResourceFlavor %s: %s", name, exc)
                return None

        found = await asyncio.gather(*(read(name) for name in names_))
        return dict(zip(names_, found, strict=True))

    async def _claims(self, job: Tracked, view: JobView) -> dict[str, tuple[str, ...] | None]:
        """Access modes of the claims the job's pods share (None: no such claim); kept for the light passes."""
        assert view.job is not None
        uses = rec.volume_uses(view.job.spec)
        found = await asyncio.gather(*(self.client.get(kube.PVC, view.namespace, use.claim) for use in uses))
        job.claims = {
            use.claim: tuple((claim.get("spec") or {}).get("accessModes") or ()) if claim else None
            for use, claim in zip(uses, found, strict=True)
        }
        return job.claims


async def _none() -> None:
    return None
