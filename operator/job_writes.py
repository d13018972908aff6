"""The controller's writes for a GRPOLoraJob's pass (run by the operator): the kept children it ensures (token
Secret, Services, NetworkPolicy, PodDisruptionBudget, Kueue Workload, with the Workload's priority), the workloads it
creates and deletes as the decision says (fencing lost pods, releasing what they hold), a child whose name is taken
(relabelled when it is the job's own), and the record of the pass: the status written once, then the Kueue Workload,
then the events. grpolora.operator.job_pass reads and decides; this module carries the decision out."""

from __future__ import annotations

import asyncio
import base64
import copy
import logging
import secrets
from collections.abc import Mapping
from typing import Any, Final

from grpolora.api import constants as c
from grpolora.api.plan import JobPlan, child_names
from grpolora.api.pool import environment_token, token_fingerprint
from grpolora.operator import builders, kube, names
from grpolora.operator import observe as obs
from grpolora.operator import pool_reconcile as pr
from grpolora.operator import reconcile as rec
from grpolora.operator.job_status import status_patch
from grpolora.operator.job_view import JobView
from grpolora.operator.job_workloads import children
from grpolora.operator.scheduler import Gone, Tracked
from grpolora.operator.watch_cache import CHILDREN_SELECTOR, UNSEEN, WATCHED

logger = logging.getLogger(__name__)

TOKEN_BYTES: Final = 32


class ChildRefused(Exception):
    """The API server refused to create one of the job's children."""

    def __init__(self, error: kube.ApiError, obj: Mapping[str, Any]):
        super().__init__(str(error))
        self.error = error
        self.refusal = rec.Refusal(obj["kind"], obj["metadata"]["name"], error.status, error.message or error.reason)


class JobWrites:
    """The Controller's part that carries out a job pass's decision. Its state is set in Controller.__init__."""

    async def _withdraw_workloads(self, job: Tracked, view: JobView) -> None:
        """A job that failed to start keeps no workload: the trainer Job and StatefulSets are created side by side, so
        the refusal of one leaves the others running (GPUs held for a Failed job). Deleted in the foreground."""
        workloads = child_names(view.name)
        for kind, name in (
            (kube.JOB, workloads[c.ROLE_TRAINER]),
            (kube.STATEFULSET, workloads[c.ROLE_INFERENCE]),
            (kube.STATEFULSET, workloads[c.ROLE_ENVIRONMENT]),
        ):
            self.cache.pop((kind.kind, view.namespace, name), None)  # just created: read from the API
            found = await self._workload(kind, view.namespace, name)
            if found is None or obs.controller_uid(found) != view.uid or obs.deleting(found):
                continue
            self.cache.pop((kind.kind, view.namespace, name), None)
            await self.client.delete(kind, view.namespace, name, propagation="Foreground")
            logger.info("%s/%s: deleted %s %s (the job failed to start)", job.namespace, job.name, kind.kind, name)

    async def _create(self, job: Tracked, obj: Mapping[str, Any]) -> bool:
        """Create if absent (False on 409); an API refusal becomes ChildRefused."""
        try:
            new = await self.client.create(obj)
        except kube.ApiError as exc:
            raise ChildRefused(exc, obj) from exc
        if new:
            logger.info("%s/%s: created %s %s", job.namespace, job.name, obj["kind"], obj["metadata"]["name"])
        return new

    async def _ensure_kept_children(self, job: Tracked, view: JobView, job_plan: JobPlan) -> list[rec.ChildRef]:
        """Make sure the Secret, Services and NetworkPolicy exist; return those that belong to an older job."""
        assert view.job is not None
        if view.record_applied is not None:
            # Recorded before anything is created, so a restarted operator always knows what the children run.
            annotations = {names.APPLIED_SPEC_ANNOTATION: view.record_applied}
            if view.record_runtime is not None:  # in the same write: a started job always knows both
                annotations[names.RUNTIME_ANNOTATION] = view.record_runtime
            patched = await self.client.patch(
                kube.GRPOLORAJOB, job.namespace, job.name, {"metadata": {"annotations": annotations}}
            )
            if patched is None:
                raise Gone(f"{job.namespace}/{job.name}")
            job.body.setdefault("metadata", {}).setdefault("annotations", {}).update(annotations)
        # A fresh token each time, used only if the Secret does not exist yet (create-if-absent). One made again for
        # a running job (its Secret was deleted) re-keys the job as a whole (reconcile.decide, status.tokenDigest).
        fresh = secrets.token_urlsafe(TOKEN_BYTES)
        priority = None
        queue_key = (kube.KUEUE_WORKLOAD.kind, job.namespace, job.name)
        if job_plan.job.queue_name is not None and not self.cache.get(queue_key):
            priority = await self._priority(job_plan)  # its Workload may be about to be created
        kept, _ = children(
            job_plan,
            uid=view.uid,
            token=fresh,
            operator_namespace=self.config.operator_namespace,
            priority=priority,
        )

        new_job = view.record_applied is not None
        owner_check: asyncio.Future[bool] | None = None

        async def owner_deleting() -> bool:
            """Read once per pass, and only when a child is missing (see _owner_deleting)."""
            nonlocal owner_check
            if owner_check is None:
                owner_check = asyncio.ensure_future(self._owner_deleting(job))
            return await owner_check

        async def ensure(obj: dict[str, Any]) -> rec.ChildRef | None:
            kind, name = kube.kind_of(obj), obj["metadata"]["name"]
            # A new job's children are normally absent: create first, and read only on a conflict. Later passes
            # read first (drift repair without a failed create per child and pass).
            existing = None if new_job else await self._kept(kind, job.namespace, name)
            if existing is None:
                if not new_job and await owner_deleting():
                    return None
                try:
                    if await self._create(job, obj):
                        if self.cache.get((kind.kind, job.namespace, name), UNSEEN) is None:
                            del self.cache[(kind.kind, job.namespace, name)]  # read from the API until the watch says
                        if obj["kind"] == "Secret":
                            job.token = token_fingerprint(fresh)
                        return None
                except ChildRefused as refused:
                    if kind != kube.KUEUE_WORKLOAD or refused.error.status != 404:
                        raise
                    # Kueue is not installed (yet): the job waits for it (rec.decide says so) instead of failing.
                    job.queue_api_missing = True
                    return None
                existing = await self._taken(job, obj)  # there already: whose is it?
            if existing is not None and obs.controller_uid(existing) != view.uid:
                return rec.ChildRef(kind.kind, name)
            if existing is not None and obj["kind"] == "Secret":
                token = pr.token_of(existing)
                job.token = token_fingerprint(token) if token else None
                if token and job_plan.environment is not None:
                    await self._environment_key(job, existing, token)
            if existing is not None and obj["kind"] == "NetworkPolicy":
                await self._policy_as_built(job, existing, obj)
            return None

        job.queue_api_missing = False
        found = await asyncio.gather(*(ensure(obj) for obj in kept))
        return [ref for ref in found if ref is not None]

    async def _environment_key(self, job: Tracked, secret: Mapping[str, Any], token: str) -> None:
        """The token Secret's environment key (the only one the environment server's pods mount), written from the
        token the Secret holds where it is missing or is not that token's: a Secret made by a release before it
        existed (an operator upgraded over a running job), or one whose token was changed in place (which re-keys
        the job; its new pods need the new token's key). The Secret is otherwise never rewritten."""
        want = environment_token(token)
        if pr.token_of(secret, c.ENVIRONMENT_TOKEN_SECRET_KEY) == want:
            return
        patch = {"data": {c.ENVIRONMENT_TOKEN_SECRET_KEY: base64.b64encode(want.encode()).decode()}}
        name = secret["metadata"]["name"]
        if await self.client.patch(kube.SECRET, job.namespace, name, patch):
            logger.info("%s/%s: wrote the environment server's token into Secret %s", job.namespace, job.name, name)

    async def _policy_as_built(self, job: Tracked, existing: Mapping[str, Any], built: Mapping[str, Any]) -> None:
        """A NetworkPolicy of the job's (its own, its environment server's) brought to what the spec it runs with
        builds: the other kept children are made once, but a spec may change as a whole until the job has started
        (a create refused first), and these are the fence of the job's pods and of a sandbox that runs model-written
        code (its egress closed by the new spec, its pods left out of the job's). Past that, it puts back a
        hand-edited one. Written only where it differs (policy_rewrite)."""
        patch = policy_rewrite(existing, built)
        if patch is None:
            return
        name = built["metadata"]["name"]
        written = await self.client.patch(kube.NETWORK_POLICY, job.namespace, name, patch)
        if written is not None:
            self._remember((kube.NETWORK_POLICY.kind, job.namespace, name), dict(written), written)
            logger.warning("%s/%s: NetworkPolicy %s rewritten as its spec builds it", job.namespace, job.name, name)

    async def _priority(self, job_plan: JobPlan) -> tuple[str, int] | None:
        """(PriorityClass, value) for the job's Kueue Workload, as Kueue's integrations find it
        (pkg/util/priority GetPriorityFromPriorityClass): the class the pods name, else the cluster's globalDefault
        one; None: neither (Kueue ranks the Workload at 0). Listed, not watched: read only when a Workload is made,
        and a cluster has few PriorityClasses. A class the pods name that does not exist is the Priority admission
        plugin's to refuse, naming it, when the pods are created."""
        name = builders.pods_priority_class(job_plan)
        classes = await self.client.list(kube.PRIORITY_CLASS, None, {})  # type: ignore[arg-type]
        for found in classes:
            meta, value = found.get("metadata") or {}, found.get("value")
            if isinstance(value, int) and (meta.get("name") == name if name else found.get("globalDefault") is True):
                return str(meta.get("name")), value
        if name:
            logger.warning("%s: PriorityClass %s does not exist; its Workload gets no priority", job_plan.name, name)
        return None

    async def _change_workloads(self, job: Tracked, decision: rec.Decision) -> bool:
        """Fence lost pods, delete, then create (never the same name in one pass); False if a create found the name
        taken (409)."""
        # What we change, the watch reports later: read it from the API until then.
        for kind, name in [(r.kind, r.name) for r in (*decision.delete, *decision.release)] + [
            (obj["kind"], obj["metadata"]["name"]) for obj in decision.create
        ]:
            self.cache.pop((kind, job.namespace, name), None)
        # Lost pods out of the job's Services (job_course._leaving_trainer) before their Job is released.
        unlabel = {"metadata": {"labels": {builders.JOB_UID_LABEL: None}}}
        await asyncio.gather(*(self.client.patch(kube.POD, job.namespace, pod, unlabel) for pod in decision.fence))
        for pod in decision.fence:
            logger.warning("%s/%s: pod %s taken as lost, out of the job's Services", job.namespace, job.name, pod)
        # In the foreground: a workload stays (with a deletionTimestamp) until its pods are gone, so a decision that
        # sees it absent knows its pods are gone too (a restart, a resume or a re-admission never overlaps them).
        await asyncio.gather(
            *(
                self.client.delete(kube.KINDS[r.kind], job.namespace, r.name, propagation="Foreground")
                for r in decision.delete
            )
        )
        for ref in decision.delete:
            logger.info("%s/%s: deleted %s %s", job.namespace, job.name, ref.kind, ref.name)
        # Again, in the Background: the API server drops the foregroundDeletion finalizer that lost pods would hold.
        await asyncio.gather(
            *(
                self.client.delete(kube.KINDS[r.kind], job.namespace, r.name, propagation="Background")
                for r in decision.release
            )
        )
        for ref in decision.release:
            logger.warning(
                "%s/%s: released %s %s (deleted in the background)", job.namespace, job.name, ref.kind, ref.name
            )
        created = await asyncio.gather(*(self._create(job, obj) for obj in decision.create))
        # A name taken: by this job's own workload that the watch no longer shows?
        taken = [obj for obj, new in zip(decision.create, created, strict=True) if not new]
        await asyncio.gather(*(self._taken(job, obj) for obj in taken))
        return all(created)

    async def _taken(self, job: Tracked, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """The child whose name `obj`'s create found taken (409), read from the API. One of this job's (the
        controller owner `obj` names) that lost the operator's label gets it back: the watches list by that label
        (CHILDREN_SELECTOR), so without it the child left them as deleted, its changes never reach a pass, and each
        pass found its name taken. Someone removed it (`kubectl label ... key-`, a policy engine's mutation); the
        child is the job's all the same, as its owner says."""
        kind, name = kube.kind_of(obj), obj["metadata"]["name"]
        existing = await self._kept(kind, job.namespace, name, fresh=True)
        owner = obs.controller_uid(obj)
        if existing is None or kind not in WATCHED or owner is None or obs.controller_uid(existing) != owner:
            return existing
        labels = (existing.get("metadata") or {}).get("labels") or {}
        missing = {key: value for key, value in CHILDREN_SELECTOR.items() if labels.get(key) != value}
        if not missing:
            return existing
        await self.client.patch(kind, job.namespace, name, {"metadata": {"labels": missing}})
        logger.warning(
            "%s/%s: %s %s had lost the label %s; put back (the operator follows its children by it)",
            job.namespace, job.name, kind.kind, name, ", ".join(missing),
        )  # fmt: skip
        return existing

    async def _write_queue_workload(self, job: Tracked, decision: rec.Decision) -> bool:
        """Carry out what the decision writes on the job's Kueue Workload (grpolora.operator.kueue). A status patch
        holds the resourceVersion it was decided from: if Kueue wrote meanwhile (409), the cached Workload is dropped
        so that the next pass reads it from the API and decides again; False then (the pass comes again soon)."""
        write = decision.queue_workload_write
        if write is None:
            return True
        key = (kube.KUEUE_WORKLOAD.kind, job.namespace, job.name)
        if write.spec is not None:
            written = await self.client.patch(kube.KUEUE_WORKLOAD, job.namespace, job.name, write.spec)
            if written is not None:
                self._remember(key, dict(written), written)
                logger.info("%s/%s: patched the Kueue Workload: %s", job.namespace, job.name, write.spec.get("spec"))
            if write.status is not None:
                return False  # the status patch was decided from the older version: decide again
        if write.status is None:
            return True
        try:
            written = await self.client.patch(
                kube.KUEUE_WORKLOAD, job.namespace, job.name, write.status, subresource="status"
            )
        except kube.ApiError as exc:
            if exc.status != 409:
                raise
            logger.info("%s/%s: the Kueue Workload changed meanwhile; deciding again", job.namespace, job.name)
            self.cache.pop(key, None)
            return False
        if written is not None:
            self._remember(key, dict(written), written)
            if write.released:
                logger.info("%s/%s: gave the Kueue Workload's quota back after its eviction", job.namespace, job.name)
        return True

    async def _record(self, job: Tracked, decision: rec.Decision) -> bool:
        """Write the status, then the Kueue Workload, then post the events (only after the status write succeeded);
        delete the job after its TTL. False when the Workload's write met a newer Workload (decide again soon)."""
        patch = status_patch(job.status, decision.status)
        if patch is not None:
            written = await self.client.patch(
                kube.GRPOLORAJOB, job.namespace, job.name, {"status": patch}, subresource="status"
            )
            if written is None:
                raise Gone(f"{job.namespace}/{job.name}")
            job.status = dict(written.get("status") or decision.status.to_wire())
        self.metrics.set_job(job.namespace, job.name, decision.status)
        queue_written = await self._write_queue_workload(job, decision)
        involved = {"namespace": job.namespace, "name": job.name, "uid": job.uid}
        for event in decision.events:
            try:
                await self.client.post_event(involved, event.type, event.reason, event.message, now=self.clock())
            except kube.ApiError as exc:
                logger.warning("%s/%s: could not post event %s: %s", job.namespace, job.name, event.reason, exc)
        if decision.delete_job:
            await self.client.delete(kube.GRPOLORAJOB, job.namespace, job.name)
            logger.info("%s/%s: deleted after ttlSecondsAfterFinished", job.namespace, job.name)
            raise Gone(f"{job.namespace}/{job.name}")
        return queue_written


def policy_rewrite(current: Mapping[str, Any], built: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that makes a stored NetworkPolicy's spec the built one (None: it is already): lists are
    replaced whole by a merge patch, and a key the built spec lacks is removed. Compared as the API server returns
    it, so that nothing is written again at every pass: a port's protocol TCP when unset (pkg/apis/networking/v1/
    defaults.go SetDefaults_NetworkPolicyPort), an empty list or object left out (the fields' omitempty: `egress:
    []`, the sandbox's default, reads back as no egress key; k8s.io/api/networking/v1 types.go)."""
    stored, wanted = dict(current.get("spec") or {}), copy.deepcopy(dict(built["spec"]))
    for direction in ("ingress", "egress"):
        for rule in wanted.get(direction) or []:
            for port in rule.get("ports") or []:
                port.setdefault("protocol", "TCP")
    if _as_read(stored) == _as_read(wanted):
        return None
    return {"spec": {key: wanted.get(key) for key in (*wanted, *(k for k in stored if k not in wanted))}}


def _as_read(value: Any) -> Any:
    """`value` without the empty lists and objects (and nulls) in its objects, which the API server omits."""
    if isinstance(value, Mapping):
        return {key: _as_read(item) for key, item in value.items() if item not in (None, [], {})}
    if isinstance(value, list):
        return [_as_read(item) for item in value]
    return value
