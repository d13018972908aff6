"""When a job's pods count as ready, pure, in one place (run by the operator's reconcile pass). Two questions, two
rules, both counted the same way:
- Can the job make progress (`makes_progress`)? Every trainer rank up, one serving replica ready and, with
  spec.environment.server, one environment server pod ready (the trainer's episodes run on the pods that answer).
  Kueue's PodsReady on the job's Workload says this (waitForPodsReady evicts only a job that cannot go on), and the
  startup deadline fails only such a job.
- Are all its pods ready (`all_ready`)? The job's own PodsReady condition, for people: every rank, replica and
  environment server pod.

A trainer rank is up when it is ready or has finished (`trainer_ranks_up`): ranks > 0 exit after the final gather
while rank 0 saves and pushes the final adapter. Kueue's own batch/v1 Job integration counts the same
(kubernetes-sigs/kueue pkg/controller/jobs/job/job_controller.go, (*Job).PodsReady: Status.Succeeded + Status.Ready
>= podsCount(), unchanged from release-0.6 to main).
"""

from __future__ import annotations

from grpolora.api.spec import GRPOLoraJobSpec
from grpolora.api.status import ReplicaCounts, RoleReplicas
from grpolora.operator import observe as obs
from grpolora.operator import pools
from grpolora.operator.job_view import K8sObject


def trainer_ranks_up(trainer_job: K8sObject | None) -> int:
    """The trainer Job's ranks that are ready or have finished (status.ready + status.succeeded)."""
    status = (trainer_job or {}).get("status") or {}
    return obs.job_ready(trainer_job) + int(status.get("succeeded") or 0)


def serving_replicas(
    spec: GRPOLoraJobSpec, sts: K8sObject | None, place: pools.PoolPlace | None
) -> RoleReplicas | None:
    """The inference replicas serving the job: its own StatefulSet's, or on a pool the pool's servers (while it is
    attached); None while it has none."""
    if place is not None:
        return RoleReplicas(desired=place.desired, ready=place.ready) if place.attached else None
    return None if sts is None else RoleReplicas(desired=spec.inference.replicas, ready=obs.statefulset_ready(sts))


def environment_replicas(spec: GRPOLoraJobSpec, sts: K8sObject | None) -> RoleReplicas | None:
    """The environment server's pods (its StatefulSet's ready ones); None for a job without spec.environment.server."""
    server = spec.environment_server
    return None if server is None else RoleReplicas(desired=server.replicas, ready=obs.statefulset_ready(sts))


def makes_progress(
    trainer_up: int, trainer_desired: int, serving: RoleReplicas | None, environment: RoleReplicas | None = None
) -> bool:
    """What a job needs to make progress: every trainer rank up (the ranks train together) and at least one
    serving replica ready (the trainer generates on the replicas that serve and syncs the adapter to those; a lost or
    unscheduled replica rejoins at the next sync round). Kueue's PodsReady on the job's Workload says this, so that
    waitForPodsReady (timeout, and since Kueue 0.16 recoveryTimeout, which defaults to timeout) evicts only a job that
    cannot go on."""
    served = environment is None or environment.ready >= min(1, environment.desired)
    return served and serving is not None and trainer_up >= trainer_desired and serving.ready >= min(1, serving.desired)


def summary(counts: ReplicaCounts) -> str:
    """`trainer 1/1 ready, inference 1/2 ready` (and `, environment 2/2 ready` with an environment server)."""
    t, i, e = counts.trainer, counts.inference, counts.environment
    said = f"trainer {t.ready}/{t.desired} ready, inference {i.ready}/{i.desired} ready"
    return said if e is None else f"{said}, environment {e.ready}/{e.desired} ready"


def all_ready(counts: ReplicaCounts) -> bool:
    """Every pod the job wants is up: the job's own PodsReady condition."""
    t, i, e = counts.trainer, counts.inference, counts.environment
    return t.ready >= t.desired and i.ready >= i.desired and (e is None or e.ready >= e.desired)
