"""What a reconcile pass knows about a GRPOLoraJob itself, pure: its spec as applied (or as changed), its runtime, the
Kueue queue it runs under (JobView, job_view); grpolora.operator.reconcile decides from it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from grpolora.api import constants as c
from grpolora.api import runtime as rt
from grpolora.api.load import InvalidJob, parse_job, parse_runtime
from grpolora.api.spec import GRPOLoraJob, GRPOLoraJobSpec, ObjectMeta, RuntimeRef
from grpolora.api.status import (
    JobStatus,
)
from grpolora.operator import conditions as cond
from grpolora.operator import kueue, names
from grpolora.operator import observe as obs
from grpolora.operator.job_status import is_finished, stored_status

K8sObject = dict[str, Any]


# ---- what a pass knows about the job itself ------------------------------------------------------------------


@dataclass(frozen=True)
class JobView:
    namespace: str
    name: str
    uid: str
    generation: int | None
    job: GRPOLoraJob | None
    """What runs: the applied spec with the current suspend/ttl. None if the job was never valid."""
    record_applied: str | None = None
    """The applied-spec annotation to write before creating anything (first valid pass only)."""
    problems: tuple[str, ...] = ()
    """Why the current spec is invalid (field path: message)."""
    refused: tuple[str, ...] = ()
    """Field paths changed since the spec was applied that cannot change on a created job."""
    deleting: bool = False
    """The job has a deletionTimestamp: the garbage collector is removing its children (in the foreground, the job
    stays until they are gone). Nothing may be created for it any more."""
    record_runtime: str | None = None
    """The runtime annotation to write with the applied spec (a job on a runtime, until it starts)."""
    runtime: str | None = None
    """The runtime the job runs on, as the RuntimeResolved condition names it (jobs with spec.runtimeRef only)."""
    runtime_wait: tuple[str, str] | None = None
    """(reason, message): the job waits, Pending, for the runtime it names to exist or to be valid."""
    queue_refused: str | None = None
    """Why the job's Kueue queue label did not change what it runs under (with_queue_in_effect)."""
    queue_left: str | None = None
    """The Kueue Workload of a queue the job left before Kueue admitted it (its label removed): deleted."""


def spec_json(spec: GRPOLoraJobSpec) -> str:
    return json.dumps(spec.to_wire(), sort_keys=True, separators=(",", ":"))


def job_view(body: Mapping[str, Any], runtime: Mapping[str, Any] | None = None) -> JobView:
    """Parse the job and reconcile its current spec with the applied one (see names.APPLIED_SPEC_ANNOTATION).

    Until its children have been created (status condition Created), a job has no applied spec to keep: a spec
    fixed after the API server refused a child applies as a whole. A job on a runtime (spec.runtimeRef) is merged
    with it (grpolora.api.runtime): until it starts with `runtime`, the one the API has now (None: not found), and
    from then on with the one recorded when it started (names.RUNTIME_ANNOTATION), so that an edit of the runtime
    changes no running job.
    """
    meta = body.get("metadata") or {}
    namespace, name = meta.get("namespace", "default"), meta.get("name", "")
    uid, generation = meta.get("uid", ""), meta.get("generation")
    deleting = bool(meta.get("deletionTimestamp"))
    created = cond.is_true(stored_status(body.get("status")).conditions, names.CREATED)
    applied = _applied_spec(meta) if created else None
    recorded = obs.recorded_runtime(meta) if created else None
    used: Mapping[str, Any] | None = None
    try:
        current = parse_job(body)
        ref = current.spec.runtime_ref
        if ref is not None:
            used = recorded
            if used is None:
                wait = _runtime_wait(ref, namespace, runtime)
                if wait is not None:
                    return JobView(namespace, name, uid, generation, None, runtime_wait=wait, deleting=deleting)
                assert runtime is not None
                used = rt.record_of(runtime)
            current = rt.parse_resolved(body, used.get("spec") or {}, rt.describe(ref, namespace))
    except InvalidJob as exc:
        problems = tuple(str(problem) for problem in exc.problems)
        job = _fallback_job(body, applied) if applied is not None else None
        return JobView(namespace, name, uid, generation, job, problems=problems, deleting=deleting)
    on = rt.describe_record(used, namespace) if used is not None else None
    if applied is None:
        return JobView(
            namespace,
            name,
            uid,
            generation,
            current,
            record_applied=spec_json(current.spec),
            record_runtime=json.dumps(used, sort_keys=True, separators=(",", ":")) if used is not None else None,
            runtime=on,
            deleting=deleting,
        )
    refused = tuple(changed_fields(applied.to_wire(), current.spec.to_wire()))
    running = applied.model_copy(
        update={
            "suspend": current.spec.suspend,
            "ttl_seconds_after_finished": current.spec.ttl_seconds_after_finished,
        }
    )
    job = current.model_copy(update={"spec": running})
    return JobView(namespace, name, uid, generation, job, refused=refused, runtime=on, deleting=deleting)


def _runtime_wait(ref: RuntimeRef, namespace: str, runtime: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """Why a job that has not started cannot be resolved on its runtime yet (reason, message); None when it can."""
    where = rt.describe(ref, namespace)
    if runtime is None:
        return (
            names.R_RUNTIME_NOT_FOUND,
            f"waiting for {where}, which does not exist (spec.runtimeRef); nothing is created until it does",
        )
    try:
        parse_runtime(runtime)
    except InvalidJob as exc:
        return (names.R_RUNTIME_INVALID, f"waiting for {where}, which is invalid: {'; '.join(map(str, exc.problems))}")
    return None


def with_queue_in_effect(view: JobView, old: JobStatus, workload: K8sObject | None) -> JobView:
    """The view with the Kueue queue the job runs under (the `kueue.x-k8s.io/queue-name` label it has now, or
    spec.scheduling.queueName): its Workload's queue (`workload`, None: none) while Kueue admits it, or while it runs
    without a queue; the new one otherwise. Kueue's webhooks hold a Job's queue-name label while the Job is not
    suspended (jobframework/validation.go: immutable unless suspended; a Kueue-managed Job is unsuspended only once
    admitted), and a Workload's queueName once quota is reserved (workload_webhook.go). Following a change the
    operator restarts, or the label being read only at restart, killed and requeued a running job, or let it run
    outside Kueue while its old Workload kept its quota."""
    job = view.job
    if job is None:
        return view
    wanted = job.queue_name
    live = workload if workload is not None and not kueue.is_true(workload, kueue.FINISHED) else None
    current = ((live.get("spec") or {}).get("queueName") or None) if live is not None else None
    if wanted == current:
        return view
    suspended = job.spec.suspend
    if live is not None:
        held = kueue.is_true(live, kueue.QUOTA_RESERVED) and not suspended
    else:
        admitted = cond.find(old.conditions, names.ADMITTED)
        held = (
            cond.is_true(old.conditions, names.CREATED)
            and not suspended
            and not is_finished(old)
            and admitted is not None
            and admitted.reason == names.R_NO_QUEUE
        )
    if not held:
        if wanted is None and live is not None:
            return dataclasses.replace(view, queue_left=live["metadata"]["name"])
        return view
    labels = {k: v for k, v in job.metadata.labels.items() if k != c.KUEUE_QUEUE_LABEL}
    if current is not None:
        labels[c.KUEUE_QUEUE_LABEL] = current
    where = f"LocalQueue {current}, which admitted it" if current is not None else "no Kueue queue, as it started"
    message = (
        f"metadata.labels[{c.KUEUE_QUEUE_LABEL}] ({wanted or 'removed'}) cannot change while the job runs (Kueue's "
        f"webhooks refuse it for their Jobs): it stays in {where}. Suspend the job (spec.suspend: true) to move it, "
        "or set the label back"
    )
    meta = job.metadata.model_copy(update={"labels": labels})
    spec = job.spec
    if current is None and spec.scheduling.queue_name is not None:
        spec = spec.model_copy(update={"scheduling": spec.scheduling.model_copy(update={"queue_name": None})})
    return dataclasses.replace(view, job=job.model_copy(update={"metadata": meta, "spec": spec}), queue_refused=message)


def runtime_to_read(body: Mapping[str, Any]) -> RuntimeRef | None:
    """The runtime a pass must read for the job: the one it names, until it has started on a recorded one."""
    ref = rt.ref_in(body)
    started = cond.is_true(stored_status(body.get("status")).conditions, names.CREATED)
    if ref is None or (started and obs.recorded_runtime(body.get("metadata") or {}) is not None):
        return None
    return ref


def _applied_spec(meta: Mapping[str, Any]) -> GRPOLoraJobSpec | None:
    raw = (meta.get("annotations") or {}).get(names.APPLIED_SPEC_ANNOTATION)
    if not raw:
        return None
    try:
        return GRPOLoraJobSpec.model_validate(json.loads(raw))
    except (ValueError, ValidationError):
        # Hand-edited or written by an incompatible version: the current spec becomes the applied one.
        return None


def _fallback_job(body: Mapping[str, Any], applied: GRPOLoraJobSpec) -> GRPOLoraJob | None:
    """The job as applied, for a running job whose current spec became invalid (the children keep running)."""
    raw_spec = body.get("spec") or {}
    update: dict[str, Any] = {}
    if isinstance(raw_spec.get("suspend"), bool):
        update["suspend"] = raw_spec["suspend"]
    try:
        return GRPOLoraJob(
            apiVersion=c.API_VERSION,
            kind=c.KIND,
            metadata=ObjectMeta.model_validate(body.get("metadata") or {}),
            spec=applied.model_copy(update=update),
        )
    except ValidationError:
        return None


def changed_fields(applied: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "spec") -> list[str]:
    """Field paths whose values differ, except the fields a running job may change (names.MUTABLE_SPEC_FIELDS).

    Lists compare whole (a changed toleration list is one path), dicts recursively.
    """
    paths: list[str] = []
    for key in sorted(set(applied) | set(current)):
        if prefix == "spec" and key in names.MUTABLE_SPEC_FIELDS:
            continue
        before, after = applied.get(key), current.get(key)
        if isinstance(before, Mapping) and isinstance(after, Mapping):
            paths += changed_fields(before, after, f"{prefix}.{key}")
        elif before != after:
            paths.append(f"{prefix}.{key}")
    return paths
