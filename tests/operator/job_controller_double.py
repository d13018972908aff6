"""The batch/v1 Job controller, played for the operator tests: the status it writes on a Job from the Job's pods, in the
order a Kubernetes >= 1.31 controller writes it. The pods themselves are the test's (Cluster.run_pod_of plays the
controller's create and the scheduler's bind; the test plays the kubelet and the taint manager on them).

Each rule names where the Job controller does the same (kubernetes/kubernetes pkg/controller/job/job_controller.go,
release-1.31 through release-1.34, syncJob; read, nothing copied):
- The pods of a Job are those it controls (getPodsForJob: the controller ownerReference's uid).
- `active` counts the pods that are neither terminal nor being deleted (controller.FilterActivePods); `ready` those
  of them with the Ready condition True (countReadyPods); `terminating` those being deleted that are not terminal
  (controller.CountTerminatingPods; written when JobPodReplacementPolicy is on, beta and on by default since 1.29).
  A pod deleted on a lost node therefore leaves `active` at once and stays in `terminating` for as long as it stays.
- `succeeded`/`failed` count terminal pods once (the finalizer-tracked uncountedTerminatedPods; here a set of
  uids). With a podFailurePolicy, only a pod in phase Failed is a failure (isPodFailed): a Terminating pod is not.
- A failed pod is matched against spec.podFailurePolicy (pod_failure_policy.go matchPodFailurePolicy: the rules in
  order; onExitCodes against the named container's terminated exit code, onPodConditions against the pod's
  conditions); a FailJob match gives the interim condition FailureTarget, reason PodFailurePolicy, with
  getFailJobMessage's wording. Otherwise `failed > backoffLimit` gives FailureTarget, BackoffLimitExceeded, "Job has
  reached the specified backoff limit" (newFailureCondition: FailureTarget rather than Failed whenever
  delayTerminalCondition(), i.e. JobManagedBy or JobPodReplacementPolicy is on: every release since 1.31).
- With a finished condition, every active pod is deleted (deleteActivePods), and the terminal condition (Failed with
  the FailureTarget's reason and message, newFailedConditionForFailureTarget; Complete after SuccessCriteriaMet) is
  added only once no pod is terminating (trackJobStatusAndRemoveFinalizers -> enactJobFinished returns early while
  `*jobCtx.terminating > 0` under delayTerminalCondition). A pod on a lost node never lets it come.
- Complete: an Indexed Job whose every index succeeded and with no active pod gets SuccessCriteriaMet, then
  Complete once no pod is terminating (same two steps).
- The controller keeps no pod of a Job that is finished (IsJobFinished: syncJob returns at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Mapping
from typing import Any

from grpolora.testing.kube_emulator import NAMESPACE, Cluster

JOBS = "batch/v1/jobs"
PODS = "v1/pods"


def _stamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(job: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    for found in (job.get("status") or {}).get("conditions") or []:
        if found.get("type") == type_ and found.get("status") == "True":
            return found
    return None


def _terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _deleting(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(
        k.get("type") == "Ready" and k.get("status") == "True"
        for k in (pod.get("status") or {}).get("conditions") or []
    )


def _fail_job_message(job: Mapping[str, Any], pod: Mapping[str, Any]) -> str | None:
    """pod_failure_policy.go matchPodFailurePolicy / getFailJobMessage for one failed pod: the message of the first
    FailJob rule that matches, None if none does."""
    policy = (job.get("spec") or {}).get("podFailurePolicy") or {}
    name = f"{pod['metadata'].get('namespace', NAMESPACE)}/{pod['metadata']['name']}"
    for index, rule in enumerate(policy.get("rules") or []):
        codes = rule.get("onExitCodes")
        if codes:
            for container in (pod.get("status") or {}).get("containerStatuses") or []:
                if codes.get("containerName") and container.get("name") != codes["containerName"]:
                    continue
                code = ((container.get("state") or {}).get("terminated") or {}).get("exitCode")
                if code is None or code == 0:
                    continue
                hit = code in codes["values"] if codes["operator"] == "In" else code not in codes["values"]
                if hit and rule["action"] == "FailJob":
                    return (
                        f"Container {container['name']} for pod {name} failed with exit code {code} matching "
                        f"{rule['action']} rule at index {index}"
                    )
        for wanted in rule.get("onPodConditions") or []:
            for found in (pod.get("status") or {}).get("conditions") or []:
                matches = found.get("type") == wanted["type"] and found.get("status") == wanted.get("status", "True")
                if matches and rule["action"] == "FailJob":
                    return f"Pod {name} has condition {wanted['type']} matching FailJob rule at index {index}"
    return None


class JobController:
    """The Job controller's status sync over every Job of the namespace, every `period` seconds (as the test's
    client: the RBAC check counts only the operator's calls)."""

    def __init__(self, cluster: Cluster, *, period: float = 0.05):
        self.cluster, self.period = cluster, period
        self._counted: dict[str, dict[str, set[str]]] = {}
        """Per Job uid, the uids of its pods counted as succeeded and as failed."""
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> JobController:
        self._task = asyncio.create_task(self._run(), name="job controller")
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            for name in list(self.cluster.objects(JOBS)):
                await self.sync(name)

    def pods_of(self, job: Mapping[str, Any]) -> list[dict[str, Any]]:
        uid = job["metadata"]["uid"]
        return [
            pod
            for pod in self.cluster.objects(PODS).values()
            if any(r.get("controller") and r.get("uid") == uid for r in pod["metadata"].get("ownerReferences") or [])
        ]

    async def sync(self, name: str) -> None:
        """One syncJob of the Job `name`."""
        job = self.cluster.get(JOBS, name)
        if job is None or _condition(job, "Failed") or _condition(job, "Complete"):
            return
        spec, status = job["spec"], dict(job.get("status") or {})
        pods = self.pods_of(job)
        counted = self._counted.setdefault(job["metadata"]["uid"], {"succeeded": set(), "failed": set()})
        for pod in pods:
            phase = (pod.get("status") or {}).get("phase")
            if phase == "Succeeded":
                counted["succeeded"].add(pod["metadata"]["uid"])
            elif phase == "Failed":
                counted["failed"].add(pod["metadata"]["uid"])
        active = [p for p in pods if not _terminal(p) and not _deleting(p)]
        terminating = [p for p in pods if _deleting(p) and not _terminal(p)]
        conditions = [dict(k) for k in status.get("conditions") or []]
        finished = _condition(job, "FailureTarget") or _condition(job, "SuccessCriteriaMet")
        if finished is None:
            failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
            message = next((m for p in failed if (m := _fail_job_message(job, p)) is not None), None)
            if message is not None:
                finished = {"type": "FailureTarget", "reason": "PodFailurePolicy", "message": message}
            elif len(counted["failed"]) > int(spec.get("backoffLimit", 6)):
                finished = {
                    "type": "FailureTarget",
                    "reason": "BackoffLimitExceeded",
                    "message": "Job has reached the specified backoff limit",
                }
            elif len(counted["succeeded"]) >= int(spec.get("completions") or 1) and not active:
                finished = {"type": "SuccessCriteriaMet", "reason": "CompletionsReached", "message": ""}
            if finished is not None:
                finished = {**finished, "status": "True", "lastTransitionTime": _stamp()}
                conditions.append(finished)
        if finished is not None and finished["type"] == "FailureTarget":
            for pod in active:  # deleteActivePods
                await self.cluster.delete_pod(pod["metadata"]["name"])
            terminating += active
            active = []
        if finished is not None and not terminating and not active:
            terminal = "Failed" if finished["type"] == "FailureTarget" else "Complete"
            conditions.append(
                {
                    "type": terminal,
                    "status": "True",
                    "reason": finished.get("reason", ""),
                    "message": finished.get("message", ""),
                    "lastTransitionTime": _stamp(),
                }
            )
        new = {
            "active": len(active),
            "ready": sum(1 for p in active if _ready(p)),
            "terminating": len(terminating),
            "succeeded": len(counted["succeeded"]),
            "failed": len(counted["failed"]),
            "conditions": conditions,
        }
        if any(status.get(key) != value for key, value in new.items()):
            await self.cluster.set_status(JOBS, name, new)
