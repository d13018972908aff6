"""The RolloutPool decisions, pure: which jobs a pool serves (admission), where each waiting job stands, and the
pool's status. No I/O and no clock; grpolora.operator.controller reads the inputs and carries the decision out.

One writer: only the pool's own pass decides its attachments and writes them (the Secret its servers read, then its
status, which the jobs read). Two jobs that are created at once therefore never over-fill a pool: they are two
entries in one list that one pass orders and cuts at spec.maxJobs. A job's pass only reads the pool's status (am I
attached? where do I stand?) and acts on its own children.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from grpolora.api import runtime as rt
from grpolora.api.constants import KUEUE_QUEUE_LABEL
from grpolora.api.load import InvalidJob, parse_job, parse_pool
from grpolora.api.pool import Admission, Candidate, fit_errors, job_key
from grpolora.api.spec import GRPOLoraJob, RolloutPool
from grpolora.api.status import AttachedJob, Condition, PoolStatus, ReplicaAdapter, RoleReplicas
from grpolora.operator import conditions as cond
from grpolora.operator import names
from grpolora.operator import observe as obs
from grpolora.operator.kube import format_selector

# Phases after which a job no longer uses its pool (a Failed job that never started counts too).
DONE_PHASES: Final = ("Succeeded", "Failed")


def candidate(body: Mapping[str, Any], pool: RolloutPool) -> Candidate | None:
    """The job as a candidate for `pool`; None when it names another pool, or none."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    ref = ((spec.get("inference") or {}).get("poolRef") or {}).get("name")
    if ref != pool.name or meta.get("namespace") != pool.namespace:
        return None
    job = _as_it_runs(body)
    status = body.get("status") or {}
    phase = status.get("phase")
    active = not meta.get("deletionTimestamp") and not spec.get("suspend") and phase not in DONE_PHASES
    # Under Kueue, only an admitted job wants a place: a queued one holding a place while Kueue admits a later job
    # first (BestEffortFIFO) would leave that job holding GPU quota and waiting for the place, and neither runs.
    queue = job.queue_name if job is not None else (meta.get("labels") or {}).get(KUEUE_QUEUE_LABEL)
    active = active and (queue is None or admitted_by_kueue(body))
    # A job on a runtime is judged as it runs only once it recorded that runtime (its first pass): before, the queue
    # its runtime names (spec.scheduling.queueName there) is unknown here, and it took a place Kueue had not given it.
    active = active and (rt.ref_in(body) is None or obs.recorded_runtime(meta) is not None)
    return Candidate(
        key=job_key(meta.get("namespace", ""), meta.get("name", "")),
        uid=meta.get("uid", ""),
        created=meta.get("creationTimestamp") or "",
        active=active,
        fits=job is not None and not fit_errors(pool.name, pool.spec, job.spec),
        job=job,
        token=str(status.get("tokenDigest") or ""),
    )


def _as_it_runs(body: Mapping[str, Any]) -> GRPOLoraJob | None:
    """The job merged with the runtime it recorded as it started (the grpolora.dev/runtime annotation), or as written
    when it names none or has not started yet: its first pass records the runtime before it makes its token Secret,
    so a job cannot attach before then (a runtime sets nothing else the pool reads: model, LoRA, staleness).
    None when it does not parse."""
    try:
        recorded = obs.recorded_runtime(body.get("metadata") or {}) if rt.ref_in(body) is not None else None
        if recorded is None:
            return parse_job(body)
        return rt.parse_resolved(body, recorded["spec"], "its recorded runtime")
    except InvalidJob:
        return None


def admitted_by_kueue(body: Mapping[str, Any]) -> bool:
    """Whether the job's status says Kueue admitted its Workload (the job's own pass writes that condition from the
    Workload, so the pool reads no Workload)."""
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(x.get("type") == names.ADMITTED and x.get("status") == "True" for x in conditions)


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


@dataclass(frozen=True)
class PoolPlace:
    """Where a job stands with its pool, read from the pool's status by the job's pass."""

    attached: bool
    reason: str
    message: str
    ready: int = 0
    desired: int = 0
    """The pool's ready and desired server replicas (the job's inference replicas in `kubectl get glj`)."""
    room: bool = True
    """The pool has a place for the job: it is attached, or fewer than spec.maxJobs jobs are. Under Kueue a job
    without one keeps its Workload inactive (job_queue.waits_for_pool_room)."""


def place(pool: RolloutPool, status: PoolStatus, key: str, uid: str, token: str | None = None) -> PoolPlace:
    """The job's attachment as the pool's status says it (the pool writes it after its servers' list). `token`: the
    fingerprint of the job's current token; an attachment that holds another (the job is being re-keyed) does not
    count until the pool has renewed it."""
    replicas = status.replicas or RoleReplicas()
    where = f"RolloutPool {pool.name}"
    for entry in status.attached_jobs:
        if entry.job != key or entry.uid != uid:
            continue
        if token is not None and entry.token_digest and entry.token_digest != token:
            return PoolPlace(False, names.R_WAITING_FOR_POOL, f"waiting for {where} to renew its key for the job")
        return PoolPlace(True, names.R_POOL_ATTACHED, f"attached to {where}", replicas.ready, replicas.desired)
    count = f"{len(status.attached_jobs)}/{pool.spec.max_jobs} jobs attached"
    full = len(status.attached_jobs) >= pool.spec.max_jobs
    # Room: a place not held by another job (an entry of this job's name, e.g. one the pool's status still lists
    # under an older uid or token, is about to be renewed or dropped, and is no reason to give up its quota).
    room = sum(1 for entry in status.attached_jobs if entry.job != key) < pool.spec.max_jobs
    if key in status.waiting_jobs:
        position = ordinal(status.waiting_jobs.index(key) + 1)
        # Not full: the job is about to attach (its token Secret is being made, or the pool's next pass is due).
        reason = names.R_POOL_FULL if full else names.R_WAITING_FOR_POOL
        return PoolPlace(False, reason, f"{position} in line for {where} ({count})", room=room)
    return PoolPlace(False, names.R_WAITING_FOR_POOL, f"waiting for {where} to attach it ({count})", room=room)


# ---- the pool's status ------------------------------------------------------------------------------------------


def replica_versions(reports: Sequence[Mapping[str, Any] | None], key: str) -> list[ReplicaAdapter]:
    """The adapter version of job `key` on each replica that answered GET /v1/adapter
    ({"jobs": {"<ns>/<name>": {"live_version": N, ...}}, ...}); replicas that did not, or that do not serve it yet,
    are left out."""
    found = []
    for index, report in enumerate(reports):
        entry = ((report or {}).get("jobs") or {}).get(key) if isinstance(report, Mapping) else None
        version = entry.get("live_version") if isinstance(entry, Mapping) else None
        if isinstance(version, int) and not isinstance(version, bool):
            found.append(ReplicaAdapter(replica=index, live_version=version))
    return found


def tokens_per_second(reports: Sequence[Mapping[str, Any] | None]) -> float | None:
    """The replicas' completion tokens per second, summed (a replica that does not report it counts for none)."""
    rates = [
        float(r["tokens_per_second"])
        for r in reports
        if isinstance(r, Mapping) and isinstance(r.get("tokens_per_second"), int | float)
    ]
    return round(sum(rates), 1) if rates else None


def label_selector(statefulset: Mapping[str, Any] | None) -> str | None:
    """The StatefulSet's pod selector as the scale subresource states it (metav1.FormatLabelSelector of its
    matchLabels); None before the StatefulSet is seen."""
    labels = (((statefulset or {}).get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return format_selector(labels) or None


def pool_status(
    pool: RolloutPool,
    old: PoolStatus,
    admission: Admission,
    uids: Mapping[str, str],
    statefulset: Mapping[str, Any] | None,
    reports: Sequence[Mapping[str, Any] | None],
    *,
    generation: int | None,
    now: datetime.datetime,
    tokens: Mapping[str, str] | None = None,
    pods: Sequence[Mapping[str, Any]] = (),
) -> PoolStatus:
    """The pool's whole status after a pass; `pods`, its server pods, say why replicas are not ready."""
    spec = pool.spec
    ready = obs.statefulset_ready(statefulset) if statefulset is not None else 0
    attached = [
        AttachedJob(
            job=key,
            uid=uids.get(key, ""),
            token_digest=(tokens or {}).get(key, ""),
            adapter_versions=replica_versions(reports, key),
        )
        for key in admission.attached
    ]
    jobs = f"{len(attached)}/{spec.max_jobs}"
    why = obs.why_not_ready(pods) if ready < spec.replicas else None
    replicas = f"{ready}/{spec.replicas} replicas ready" + (f" ({why.message})" if why else "")
    message = f"{replicas}; {jobs} jobs attached, {len(admission.waiting)} waiting"
    wants = [
        cond.Want(names.READY, "True", names.R_ALL_READY, message)
        if ready >= spec.replicas
        else cond.Want(names.READY, "False", why.reason if why else names.R_WAITING_FOR_PODS, message),
        cond.Want(names.INVALID_SPEC, "False", names.R_VALID),
    ]
    return PoolStatus(
        message=message,
        observed_generation=generation,
        conditions=cond.merge(old.conditions, wants, now=cond.rfc3339(now), generation=generation),
        replicas=RoleReplicas(desired=spec.replicas, ready=ready),
        selector=label_selector(statefulset),
        attached_jobs=attached,
        waiting_jobs=list(admission.waiting),
        jobs=jobs,
        waiting=len(admission.waiting),
        slots_in_use=len(attached) * spec.adapters_per_job,
        slots=spec.lora_slots,
        tokens_per_second=tokens_per_second(reports),
    )


def invalid_pool_status(old: PoolStatus, problems: Sequence[str], *, generation: int | None, now: datetime.datetime):
    """An invalid pool gets no children and serves nobody; the condition says why at each field."""
    message = "invalid spec: " + "; ".join(problems)
    wants = [
        cond.Want(names.READY, "False", names.R_INVALID, "nothing is created for an invalid spec"),
        cond.Want(names.INVALID_SPEC, "True", names.R_INVALID, message),
    ]
    return PoolStatus(
        message=message,
        observed_generation=generation,
        conditions=cond.merge(old.conditions, wants, now=cond.rfc3339(now), generation=generation),
    )


def refused_pool_status(
    old: PoolStatus, kind: str, name: str, error: str, *, generation: int | None, now: datetime.datetime
) -> PoolStatus:
    """The API server refused a child of the pool (RBAC, an admission webhook, a quota): said in the status, with
    the API's message; the pass is retried (a refusal lasts until something changes)."""
    message = f"the API server refused the {kind} {name}: {error}"
    wants = [
        cond.Want(names.READY, "False", names.R_CREATE_REFUSED, message),
        cond.Want(names.INVALID_SPEC, "False", names.R_VALID),
    ]
    return old.model_copy(
        update={
            "message": message,
            "observed_generation": generation,
            "conditions": cond.merge(old.conditions, wants, now=cond.rfc3339(now), generation=generation),
        }
    )


def stored_pool_status(raw: Mapping[str, Any] | None) -> PoolStatus:
    """The status as stored; an unreadable one counts as empty (the next write replaces it)."""
    try:
        return PoolStatus.model_validate({k: v for k, v in (raw or {}).items() if k != "kopf"})
    except ValueError:
        return PoolStatus()


def attached_condition(old: Sequence[Condition]) -> bool:
    """Was the job attached to its pool (so that losing the pool fails it rather than making it wait)?"""
    return cond.is_true(old, names.POOL_ATTACHED)


# ---- what a job's pass reads of its pool ---------------------------------------------------------------------


@dataclass(frozen=True)
class PoolView:
    """A job's pool as its pass sees it."""

    name: str
    pool: RolloutPool | None
    """None: not found, or its spec is invalid (problems)."""
    status: PoolStatus
    problems: tuple[str, ...] = ()

    def fit_errors(self, job: GRPOLoraJob) -> list[tuple[str, str]]:
        return fit_errors(self.pool.name, self.pool.spec, job.spec) if self.pool is not None else []

    def usable_by(self, job: GRPOLoraJob) -> bool:
        """The job can be planned on this pool (it exists, is valid, and the job fits it)."""
        return self.pool is not None and not self.fit_errors(job)


def pool_view(name: str, body: Mapping[str, Any] | None) -> PoolView:
    if body is None:
        return PoolView(name, None, PoolStatus())
    status = stored_pool_status(body.get("status"))
    try:
        return PoolView(name, parse_pool(body), status)
    except InvalidJob as exc:
        return PoolView(name, None, status, tuple(str(p) for p in exc.problems))
