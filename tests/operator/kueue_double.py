"""Kueue, played for the operator tests: what Kueue itself does to a Workload, and nothing a job integration does.

A job integration (Kueue's own jobframework for its built-in kinds; the operator for GRPOLoraJobs) owns part of the
Workload's life: it stops the job on eviction and then gives the quota back, writes PodsReady, deactivates the
Workload of a suspended job, marks it Finished. The double must leave all of that to the operator, or the tests
would pass for an operator that does none of it (as they once did: the test re-admitted an evicted Workload itself).

Each rule below names where Kueue does the same (kubernetes-sigs/kueue, main of 2026-08; read, nothing copied):
- admission (the scheduler): `status.admission`, QuotaReserved True and Admitted True; Evicted and Preempted, if
  True, reset to False (pkg/workload/workload.go SetQuotaReservation, pkg/workload/admissionchecks.go
  SyncAdmittedCondition). Only an admissible Workload is admitted (workload.go IsAdmissible: active, not Finished,
  no quota reserved; pkg/cache/queue/cluster_queue.go backoffWaitingTimeExpired: Requeued not False and
  requeueState.requeueAt passed). With `capacity`, the double admits by itself while fewer than `capacity` Workloads
  hold quota (a ClusterQueue whose quota fits that many jobs; a Finished Workload holds none), in BestEffortFIFO
  order: higher `spec.priority` first, then older (workload.go Ordering.GetQueueOrderTimestamp: a preempted
  Workload keeps its creation time).
- eviction (preemption in pkg/scheduler/preemption, pkg/workload/evict/evict.go Evict): Evicted True with the
  reason, and for a preemption Preempted True; `status.admission`, QuotaReserved and Admitted are kept. Releasing
  them is the integration's part (pkg/controller/jobframework/reconciler.go, "handle eviction").
- waitForPodsReady (`pods_ready_timeout`; pkg/controller/core/workload_controller.go reconcileNotReadyTimeout,
  admittedNotReadyWorkload): an admitted, active, not yet evicted Workload whose PodsReady is not True (absent, or
  False WaitForStart) `pods_ready_timeout` seconds after its admission is evicted with reason PodsReadyTimeout,
  message "Exceeded the PodsReady timeout <ns>/<name>", its requeueState.count + 1 and requeueAt after the backoff
  (UpdateRequeueState; `backoff` seconds here). Once the integration has released it (Requeued False,
  PodsReadyTimeout) and requeueAt has passed, Requeued turns True with reason BackoffFinished (the Workload
  controller's reconcile of an active Workload). The integration writes PodsReady; the double never does. With
  `requeuing_limit` (waitForPodsReady.requeuingStrategy.backoffLimitCount), a timeout beyond it deactivates the
  Workload instead (triggerDeactivation: DeactivationTarget True, RequeuingLimitExceeded; then spec.active false,
  and the eviction says DeactivatedDueToRequeuingLimitExceeded).
- waitForPodsReady.recoveryTimeout (`recovery_timeout`): a Workload that was ready and whose PodsReady turned False
  (WaitForRecovery) is evicted the same way once it has stayed so that long. Unset, it is `timeout`: Kueue's
  "Setup All-or-nothing with ready Pods" (site/content/en/docs/tasks/manage/setup_wait_for_pods_ready.md: "If not
  specified, it defaults to the value of `timeout`. Setting `recoveryTimeout: 0s` disables recovery timeout
  checking"; the default since Kueue 0.16). So by default a job whose PodsReady says False for a lost pod is evicted
  after the same timeout as one that never started.
- deactivation (workload_controller.go Reconcile, the branch of an inactive Workload): a Workload with `spec.active:
  false` that is not evicted yet is evicted with reason Deactivated, "The workload is deactivated" (with a quota
  reservation or not), and its requeueState is cleared; reactivated, one whose Requeued is False with reason
  Deactivated (the integration's release) gets Requeued True, Reactivated. An inactive Workload is never admitted.
- the batch/v1 Job webhook (`manage_jobs_without_queue_name`, `external_frameworks`; pkg/controller/jobs/job/
  job_webhook.go Default -> jobframework/defaults.go ApplyDefaultForSuspend -> WorkloadShouldBeSuspended): a Job
  is created suspended unless a Kueue-managed ancestor owns it (FindAncestorJobManagedByKueue: the controller
  owner's kind is a built-in integration or listed in `integrations.externalFrameworks` as Kind.version.group, its
  uid matches, and it has the queue-name label or manageJobsWithoutQueueName is on); otherwise when it has the
  queue-name label itself, or manageJobsWithoutQueueName is on. Kueue would then queue the suspended Job a second
  time with a Workload of its own.
- the Job reconciler for such a child (jobframework/reconciler.go shouldSuspendChildJob): a running child Job
  whose managed ancestor has no unfinished Workload, or one not admitted, is suspended.
- Kueue's rights: the ancestor is read through Kueue's own client (FindAncestorJobManagedByKueue calls
  client.Get on the owner), as Kueue's service account, whose RBAC the emulator enforces
  (Cluster.service_account): Kueue's ClusterRole (config/components/rbac/role.yaml, kueue-manager-role) names only
  Kueue's built-in integrations, so a registered external kind is readable only with the rules its operator grants
  (Kueue's "Supporting external frameworks" guide: add RBAC for the CRD; here grpolora.operator.rbac.KUEUE_READS,
  what the chart binds to Kueue's account). A refused read fails the Job webhook, which controller-runtime turns
  into the API status (admission.Defaulter: an APIStatus error becomes the response), and with Kueue's
  failurePolicy Fail the API server refuses the Job.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import time
from collections.abc import Mapping
from typing import Any

from grpolora.operator import rbac
from grpolora.operator.rbac import Rule
from grpolora.testing import kube_apiserver
from grpolora.testing.kube_emulator import NAMESPACE, RESOURCES, Cluster

WORKLOADS = "kueue.x-k8s.io/v1beta1/workloads"
KUEUE_ACCOUNT = ("kueue-system", "kueue-controller-manager")
"""Kueue's service account in its default install (namespace, name): the chart's kueue.readJobs defaults."""
KUEUE_MANAGER_RULES = (
    Rule(("batch",), ("jobs",), ("get", "list", "watch", "update", "patch"), ""),
    Rule(("batch",), ("jobs/status",), ("get", "update", "patch"), ""),
    Rule(("apps",), ("statefulsets",), ("get", "list", "watch", "update", "patch"), ""),
    Rule(("",), ("pods",), ("get", "list", "watch", "update", "patch", "delete"), ""),
    Rule(("kueue.x-k8s.io",), ("workloads",), ("get", "list", "watch", "create", "update", "patch", "delete"), ""),
    Rule(("kueue.x-k8s.io",), ("workloads/status",), ("get", "update", "patch"), ""),
    Rule(("kueue.x-k8s.io",), ("resourceflavors", "clusterqueues", "localqueues"), ("get", "list", "watch"), ""),
)
"""Kueue's own ClusterRole, the part of it about the kinds the double touches (config/components/rbac/role.yaml):
nothing of grpolora.dev."""
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
REGISTERED = ("GRPOLoraJob.v1alpha1.grpolora.dev",)
"""What docs/operator.md tells platform teams to list in Kueue's integrations.externalFrameworks."""
API = "/apis/kueue.x-k8s.io/v1beta1"


def _stamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def find(workload: Mapping[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return find_in(((workload or {}).get("status") or {}).get("conditions") or [], type_)


def find_in(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((condition for condition in conditions if condition.get("type") == type_), None)


def is_true(workload: Mapping[str, Any] | None, type_: str) -> bool:
    found = find(workload, type_)
    return found is not None and found.get("status") == "True"


def set_condition(conditions: list[dict[str, Any]], type_: str, status: str, reason: str, message: str) -> None:
    """apimeta.SetStatusCondition: the transition time moves only when the status changes."""
    for condition in conditions:
        if condition["type"] == type_:
            if condition["status"] != status:
                condition["lastTransitionTime"] = _stamp()
            condition.update(status=status, reason=reason, message=message)
            return
    conditions.append(
        {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": _stamp()}
    )


class FakeKueue:
    """Kueue's scheduler and Workload controller over the emulator's API (as the test's client: the RBAC check
    counts only the operator's calls)."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        capacity: int | None = None,
        cluster_queue: str = "cq",
        pods_ready_timeout: float | None = None,
        recovery_timeout: float | None = None,
        backoff: float = 0.2,
        requeuing_limit: int | None = None,
        manage_jobs_without_queue_name: bool = False,
        external_frameworks: tuple[str, ...] = (),
        job_webhook: bool = False,
        kueue_rbac: tuple[Rule, ...] = rbac.KUEUE_READS,
    ):
        self.cluster, self.capacity, self.cluster_queue = cluster, capacity, cluster_queue
        self.pods_ready_timeout, self.backoff, self.requeuing_limit = pods_ready_timeout, backoff, requeuing_limit
        self.recovery_timeout = recovery_timeout
        """None: not configured, so Kueue's default, `pods_ready_timeout`; 0 disables it."""
        self._recovering_since: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self.admissions: list[str] = []
        """Names of the Workloads the double admitted, in order (one entry per admission)."""
        self._admitted_at: dict[str, float] = {}
        self._requeue_at: dict[str, float] = {}
        self.timed_out: list[str] = []
        """Workloads evicted for the PodsReady timeout, in order."""
        self.ready_in_time: list[str] = []
        """Workloads whose PodsReady timeout passed while they were ready (each admission at most once)."""
        self.manage_jobs_without_queue_name = manage_jobs_without_queue_name
        self.external_frameworks = external_frameworks
        self.job_webhook = job_webhook or manage_jobs_without_queue_name or bool(external_frameworks)
        self.suspended_jobs: list[str] = []
        """batch/v1 Jobs the webhook created suspended or the Job reconciler suspended, in order."""
        self.webhook_refusals: list[str] = []
        """Why the Job webhook refused a create (its read of the owner refused), in order."""
        rules = (*KUEUE_MANAGER_RULES, *kueue_rbac)
        self.kueue_client = cluster.service_account(
            *KUEUE_ACCOUNT, lambda verb, group, resource: any(r.allows(verb, group, resource) for r in rules)
        )
        """Headers of Kueue's own client: its ClusterRole plus what is bound to its account (`kueue_rbac`)."""

    async def __aenter__(self) -> FakeKueue:
        if self.job_webhook:
            self.cluster.emulator.webhooks.append(self._default_job)
        self._task = asyncio.create_task(self._run(), name="fake kueue")
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        if self.job_webhook:
            self.cluster.emulator.webhooks.remove(self._default_job)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    # ---- reading -------------------------------------------------------------------------------------------

    def workload(self, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        return self.cluster.get(WORKLOADS, name, namespace)

    def workloads(self, namespace: str = NAMESPACE) -> dict[str, dict[str, Any]]:
        return self.cluster.objects(WORKLOADS, namespace)

    @staticmethod
    def holds_quota(workload: Mapping[str, Any]) -> bool:
        """QuotaReserved True and not Finished (Kueue's cache counts a Workload's usage until it finishes)."""
        return is_true(workload, "QuotaReserved") and not is_true(workload, "Finished")

    @staticmethod
    def why_not_admissible(workload: Mapping[str, Any]) -> str | None:
        """None when Kueue would queue the Workload for admission, else why not."""
        if (workload.get("spec") or {}).get("active") is False:
            return "spec.active is false"
        if is_true(workload, "Finished"):
            return "Finished"
        if is_true(workload, "QuotaReserved"):
            return "it still holds its quota reservation (QuotaReserved True)"
        requeued = find(workload, "Requeued")
        if requeued is not None and requeued["status"] == "False":
            return f"Requeued is False ({requeued['reason']})"
        return None

    def _backoff_over(self, name: str) -> bool:
        return time.monotonic() >= self._requeue_at.get(name, 0.0)

    # ---- writing -------------------------------------------------------------------------------------------

    async def _write_status(self, name: str, change: Any, namespace: str = NAMESPACE) -> dict[str, Any]:
        """Read, change, write with the read resourceVersion as precondition; again on a conflict (Kueue patches
        with server-side apply per field owner, so a concurrent write of the operator's is never lost)."""
        while True:
            current = self.workload(name, namespace)
            assert current is not None, f"no Workload {namespace}/{name}"
            status = copy.deepcopy(current.get("status") or {})
            status.setdefault("conditions", [])
            change(status)
            path = f"{API}/namespaces/{namespace}/workloads/{name}/status"
            body = {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]}, "status": status}
            if "admission" in current.get("status", {}) and "admission" not in status:
                body["status"]["admission"] = None
            async with self.cluster.session.patch(self.cluster.url + path, json=body) as response:
                if response.status == 409:
                    continue
                payload = await response.json(content_type=None)
                assert response.status < 300, f"PATCH {path}: {response.status} {payload}"
                return payload

    async def admit(
        self, name: str, flavors: Mapping[str, Mapping[str, str]] | None = None, namespace: str = NAMESPACE
    ) -> None:
        """The scheduler admits the Workload: each pod set's resources from these ResourceFlavors (pod set ->
        resource -> flavor; none by default). Fails the test if Kueue would not admit it now."""
        workload = self.workload(name, namespace)
        assert workload is not None, f"no Workload {namespace}/{name}"
        why = self.why_not_admissible(workload)
        assert why is None, f"Kueue would not admit Workload {name}: {why}"
        assignments = [
            {"name": p["name"], "count": p["count"], "flavors": dict((flavors or {}).get(p["name"], {}))}
            for p in workload["spec"]["podSets"]
        ]

        def change(status: dict[str, Any]) -> None:
            status["admission"] = {"clusterQueue": self.cluster_queue, "podSetAssignments": assignments}
            conditions = status["conditions"]
            message = f"Quota reserved in ClusterQueue {self.cluster_queue}"
            set_condition(conditions, "QuotaReserved", "True", "QuotaReserved", message)
            for type_ in ("Evicted", "Preempted"):
                before = find_in(conditions, type_)
                if before is not None and before["status"] == "True":
                    set_condition(conditions, type_, "False", "QuotaReserved", f"Previously: {before['reason']}")
            set_condition(conditions, "Admitted", "True", "Admitted", "The workload is admitted")

        await self._write_status(name, change, namespace)
        self.admissions.append(name)
        self._admitted_at[name] = time.monotonic()
        self._recovering_since.pop(name, None)

    async def evict(self, name: str, reason: str = "Preempted", message: str = "", namespace: str = NAMESPACE) -> None:
        """Evicted True (and Preempted True for a preemption); the admission and QuotaReserved stay."""
        message = message or f"Preempted to accommodate a workload in ClusterQueue {self.cluster_queue}"

        def change(status: dict[str, Any]) -> None:
            set_condition(status["conditions"], "Evicted", "True", reason, message)
            if reason == "Preempted":
                set_condition(status["conditions"], "Preempted", "True", "InClusterQueue", message)

        await self._write_status(name, change, namespace)

    async def preempt(self, victim: str, *, by: str, namespace: str = NAMESPACE) -> None:
        """Kueue's preemption within the ClusterQueue: `by` (of a higher priority) needs the victim's quota."""
        workloads = self.workloads(namespace)
        priority = {name: int((w.get("spec") or {}).get("priority") or 0) for name, w in workloads.items()}
        assert priority[by] > priority[victim], "Kueue preempts within a ClusterQueue only for a higher priority"
        uid = workloads[by]["metadata"]["uid"]
        message = f"Preempted to accommodate a workload (UID: {uid}) due to prioritization in the ClusterQueue"
        await self.evict(victim, "Preempted", message, namespace)

    async def add_workload(self, name: str, *, priority: int, namespace: str = NAMESPACE) -> None:
        """A Workload of another integration's job (e.g. a batch Job's, which Kueue's Job integration creates)."""
        template = {"spec": {"containers": [{"name": "main", "image": "busybox"}], "restartPolicy": "Never"}}
        doc = {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "Workload",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "queueName": "gpu-queue",
                "priority": priority,
                "podSets": [{"name": "main", "count": 1, "template": template}],
            },
        }
        await self.cluster._call("POST", f"{API}/namespaces/{namespace}/workloads", doc)

    async def finish(self, name: str, namespace: str = NAMESPACE) -> None:
        """What that other integration does when its job ends: Finished, which returns the quota."""

        def change(status: dict[str, Any]) -> None:
            set_condition(status["conditions"], "Finished", "True", "Succeeded", "Job finished successfully")

        await self._write_status(name, change, namespace)

    # ---- the controllers' loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            await self.tick()

    async def tick(self) -> None:
        """One round of Kueue's controllers over every Workload of the namespace."""
        for name, workload in self.workloads().items():
            await self._workload_controller(name, workload)
        if self.job_webhook:
            for name, job in self.cluster.objects("batch/v1/jobs").items():
                await self._reconcile_child_job(name, job)
        if self.capacity is None:
            return
        workloads = self.workloads()
        holding = sum(1 for w in workloads.values() if self.holds_quota(w))
        pending = sorted(
            (
                w
                for w in workloads.values()
                if self.why_not_admissible(w) is None and self._backoff_over(w["metadata"]["name"])
            ),
            key=lambda w: (
                -int((w.get("spec") or {}).get("priority") or 0),
                w["metadata"]["creationTimestamp"],
                w["metadata"]["uid"],
            ),
        )
        for workload in pending[: max(self.capacity - holding, 0)]:
            await self.admit(workload["metadata"]["name"])

    async def _workload_controller(self, name: str, workload: dict[str, Any]) -> None:
        requeued = find(workload, "Requeued")
        active = (workload.get("spec") or {}).get("active") is not False
        if is_true(workload, "Finished"):
            return
        target = find(workload, "DeactivationTarget")
        if active and target is not None and target["status"] == "True":
            path = f"{API}/namespaces/{NAMESPACE}/workloads/{name}"
            await self.cluster._call("PATCH", path, {"spec": {"active": False}})
            return
        if not active and not is_true(workload, "Evicted"):
            cause = target["reason"] if target is not None else ""
            reason = f"DeactivatedDueTo{cause}" if cause else "Deactivated"
            message = "The workload is deactivated" + (f" due to {target['message']}" if target else "")

            def deactivate(status: dict[str, Any]) -> None:
                set_condition(status["conditions"], "Evicted", "True", reason, message)
                status["conditions"] = [c for c in status["conditions"] if c["type"] != "DeactivationTarget"]
                status.pop("requeueState", None)

            await self._write_status(name, deactivate)
            return
        if active and requeued is not None and (requeued["status"], requeued["reason"]) == ("False", "Deactivated"):

            def reactivate(status: dict[str, Any]) -> None:
                set_condition(status["conditions"], "Requeued", "True", "Reactivated", "The workload was reactivated")

            await self._write_status(name, reactivate)
            return
        if (
            active
            and requeued is not None
            and requeued["status"] == "False"
            and requeued["reason"] in ("PodsReadyTimeout", "AdmissionCheck")
            and self._backoff_over(name)
        ):

            def finish_backoff(status: dict[str, Any]) -> None:
                set_condition(
                    status["conditions"], "Requeued", "True", "BackoffFinished", "The workload backoff was finished"
                )
                (status.get("requeueState") or {}).pop("requeueAt", None)

            await self._write_status(name, finish_backoff)
            return
        if self.pods_ready_timeout is None or not active or is_true(workload, "Evicted"):
            return
        if not is_true(workload, "Admitted") or name not in self._admitted_at:
            return
        ready = find(workload, "PodsReady")
        if ready is not None and (ready["status"], ready["reason"]) == ("False", "WaitForRecovery"):
            # Ready once, then not: the recovery timeout runs from when it turned so (seen by this loop).
            since = self._recovering_since.setdefault(name, time.monotonic())
            recovery = self.pods_ready_timeout if self.recovery_timeout is None else self.recovery_timeout
            if not recovery or time.monotonic() - since < recovery:
                return
        else:
            self._recovering_since.pop(name, None)
            if time.monotonic() - self._admitted_at[name] < self.pods_ready_timeout:
                return
            if is_true(workload, "PodsReady"):
                if name not in self.ready_in_time:
                    self.ready_in_time.append(name)
                return
        count = int(((workload.get("status") or {}).get("requeueState") or {}).get("count") or 0) + 1
        if self.requeuing_limit is not None and count > self.requeuing_limit:

            def target(status: dict[str, Any]) -> None:
                message = "exceeding the maximum number of re-queuing retries"
                set_condition(status["conditions"], "DeactivationTarget", "True", "RequeuingLimitExceeded", message)

            await self._write_status(name, target)
            self.timed_out.append(name)
            return
        self._requeue_at[name] = time.monotonic() + self.backoff
        stamp = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=self.backoff)).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )

        def time_out(status: dict[str, Any]) -> None:
            message = f"Exceeded the PodsReady timeout {NAMESPACE}/{name}"
            set_condition(status["conditions"], "Evicted", "True", "PodsReadyTimeout", message)
            status["requeueState"] = {"count": count, "requeueAt": stamp}

        await self._write_status(name, time_out)
        self.timed_out.append(name)

    # ---- the batch/v1 Job integration's webhook and reconciler -------------------------------------------------

    async def _managed_ancestor(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """FindAncestorJobManagedByKueue, one level up (a GRPOLoraJob has no owner of its own), reading the owner
        with Kueue's client; raises kube_apiserver.Refused with the API's answer when that read is refused."""
        meta = obj.get("metadata") or {}
        owner = next((ref for ref in meta.get("ownerReferences") or [] if ref.get("controller")), None)
        if owner is None:
            return None
        group, _, version = str(owner.get("apiVersion", "")).rpartition("/")
        if f"{owner.get('kind')}.{version}.{group}" not in self.external_frameworks:
            return None  # not a known owner: Kueue stops walking up
        resource = next((r for r, info in RESOURCES.items() if info.kind == owner.get("kind")), None)
        if resource is None:
            return None
        group_version, plural = resource.rsplit("/", 1)
        path = f"/apis/{group_version}/namespaces/{meta.get('namespace', NAMESPACE)}/{plural}/{owner['name']}"
        async with self.cluster.session.get(self.cluster.url + path, headers=self.kueue_client) as response:
            payload = await response.json(content_type=None)
            if response.status == 404:
                return None
            if response.status >= 300:
                raise kube_apiserver.Refused(
                    status=response.status,
                    reason=payload.get("reason", ""),
                    message=payload.get("message", ""),
                    details={},
                )
        parent = payload
        if parent["metadata"].get("uid") != owner.get("uid"):
            return None
        labelled = QUEUE_LABEL in ((parent.get("metadata") or {}).get("labels") or {})
        return parent if self.manage_jobs_without_queue_name or labelled else None

    async def _default_job(self, request: Any, obj: dict[str, Any]) -> None:
        if (request.resource.group, request.resource.plural) != ("batch", "jobs"):
            return
        try:
            ancestor = await self._managed_ancestor(obj)
        except kube_apiserver.Refused as refused:
            self.webhook_refusals.append(refused.message)
            raise kube_apiserver.Refused(
                status=refused.status,
                reason=refused.reason,
                message=f'admission webhook "mjob.kb.io" denied the request: {refused.message}',
                details={},
            ) from None
        if ancestor is not None:
            return
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if labels.get(QUEUE_LABEL) or self.manage_jobs_without_queue_name:
            obj.setdefault("spec", {})["suspend"] = True
            self.suspended_jobs.append(obj["metadata"]["name"])

    async def _reconcile_child_job(self, name: str, job: dict[str, Any]) -> None:
        try:
            ancestor = await self._managed_ancestor(job)
        except kube_apiserver.Refused:
            return  # the reconciler's error: retried with backoff, nothing changes meanwhile
        spec, status = job.get("spec") or {}, job.get("status") or {}
        finished = any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
                       for c in status.get("conditions") or [])  # fmt: skip
        if ancestor is None or spec.get("suspend") or finished:
            return
        uid = ancestor["metadata"]["uid"]
        owned = [
            w
            for w in self.workloads(job["metadata"].get("namespace", NAMESPACE)).values()
            if any(ref.get("uid") == uid for ref in w["metadata"].get("ownerReferences") or [])
            and not is_true(w, "Finished")
        ]
        if owned and is_true(owned[-1], "Admitted"):
            return
        path = f"/apis/batch/v1/namespaces/{job['metadata'].get('namespace', NAMESPACE)}/jobs/{name}"
        await self.cluster._call("PATCH", path, {"spec": {"suspend": True}})
        self.suspended_jobs.append(name)
