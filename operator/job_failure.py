"""The trainer's failure handling in one place, pure (run by the operator's reconcile pass), as JobSet keeps its
failure policy in failure_policy.go: the podFailurePolicy the trainer Job is built with, which Job conditions mean
that it failed, which cause that failure had, and what the job does about it (restart, counted or not, or fail).

The causes, and where each comes from:
- a podFailurePolicy FailJob rule, named by its index in the Job controller's message (pkg/controller/job/
  pod_failure_policy.go getFailJobMessage: "... matching FailJob rule at index N"): the trainer's "bad spec or
  data" exit codes (the job fails at once), DisruptionTarget (a drain, a preemption, a taint eviction: restarted
  without spending spec.trainer.maxRestarts), the fenced exit code (a newer incarnation took over: likewise);
- anything else the Job controller failed the Job for (the backoff limit: a rank crashed): a counted failure;
- a current trainer pod on a lost node, past its lost deadline (observe.pod_lost_at): a disruption, found by the
  job's pass, since the Job controller neither fails nor replaces a pod that never becomes terminal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from grpolora.api import constants as c
from grpolora.api import contract
from grpolora.api.spec import GRPOLoraJobSpec
from grpolora.api.status import RestartCounts
from grpolora.operator import names
from grpolora.operator.observe import job_condition

K8sObject = Mapping[str, Any]

TRAINER_FAILURE_RULE_CAUSES: Final = (names.CAUSE_INVALID_INPUT, names.CAUSE_DISRUPTION, names.CAUSE_FENCED)
"""The cause of each rule of the trainer Job's podFailurePolicy, by index. Append only: a Job's failure message
names its rule by index, and Jobs created by an older operator keep their rules."""


def trainer_failure_policy() -> dict[str, Any]:
    """The trainer Job's spec.podFailurePolicy (its rules in TRAINER_FAILURE_RULE_CAUSES' order)."""
    rules = {
        names.CAUSE_INVALID_INPUT: {
            "action": "FailJob",
            "onExitCodes": {
                "containerName": c.ROLE_TRAINER,
                "operator": "In",
                "values": sorted(contract.TRAINER_INPUT_EXIT_CODES),
            },
            # Kubernetes 1.28 (the chart's minimum) requires the field in every rule; empty is "not both" to its
            # validation (pkg/apis/batch/validation: len(rule.OnPodConditions) > 0), and 1.29+ made it optional.
            "onPodConditions": [],
        },
        # FailJob, not Ignore: Ignore would replace only the disrupted rank, whose peers are stuck in the broken
        # collective; the operator restarts the whole group instead, without counting it. The rule sees the pod
        # only once it is terminal (a pod on a lost node never is: see the module docstring).
        names.CAUSE_DISRUPTION: {
            "action": "FailJob",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        },
        # A fenced trainer (a newer incarnation took over): the job's trainer is replaced, never counted as a crash.
        names.CAUSE_FENCED: {
            "action": "FailJob",
            "onExitCodes": {"containerName": c.ROLE_TRAINER, "operator": "In", "values": [contract.EXIT_FENCED]},
            "onPodConditions": [],
        },
    }
    return {"rules": [rules[cause] for cause in TRAINER_FAILURE_RULE_CAUSES]}


def failure_condition(job: K8sObject | None) -> Mapping[str, Any] | None:
    """The trainer Job's failure: Failed, or the FailureTarget that precedes it. Since Kubernetes 1.31 the Job
    controller writes FailureTarget as soon as the Job has failed (backoff limit, a FailJob rule) and adds Failed,
    with the same reason and message, only once no pod of the Job is terminating (pkg/controller/job/job_controller.go
    newFailureCondition, delayTerminalCondition; enactJobFinished). A pod on a lost node never stops terminating, so
    Failed may never come: the job is failed from FailureTarget on."""
    return job_condition(job, "Failed") or job_condition(job, "FailureTarget")


def job_failed(job: K8sObject | None) -> bool:
    return failure_condition(job) is not None


def job_failure_message(job: K8sObject | None) -> str:
    condition = failure_condition(job) or {}
    reason, message = condition.get("reason", ""), condition.get("message", "")
    return ": ".join(part for part in (reason, message) if part) or "the trainer Job failed"


# The batch/v1 Job controller's wording of a podFailurePolicy FailJob (pkg/controller/job/pod_failure_policy.go).
_POLICY_RULE = re.compile(r"matching FailJob rule at index (\d+)")


@dataclass(frozen=True)
class TrainerFailure:
    cause: str
    """names.CAUSE_FAILURE, CAUSE_DISRUPTION, CAUSE_FENCED or CAUSE_INVALID_INPUT."""
    message: str


def trainer_failure(job: K8sObject | None, pods: Sequence[K8sObject] = ()) -> TrainerFailure:
    """Why the (failed) trainer Job failed: the podFailurePolicy rule it names, else an ordinary failure. For bad
    spec or data the message is the trainer's own termination message, when its pod is still there to say it."""
    condition = failure_condition(job) or {}
    message = job_failure_message(job)
    matched = _POLICY_RULE.search(condition.get("message") or "")
    index = int(matched.group(1)) if matched and condition.get("reason") == names.R_POD_FAILURE_POLICY else None
    if index is None or index >= len(TRAINER_FAILURE_RULE_CAUSES):
        return TrainerFailure(names.CAUSE_FAILURE, message)
    cause = TRAINER_FAILURE_RULE_CAUSES[index]
    if cause == names.CAUSE_INVALID_INPUT:
        told = [
            state["message"].strip()
            for pod in pods
            if ((pod.get("metadata") or {}).get("labels") or {}).get(c.LABEL_ROLE) == c.ROLE_TRAINER
            for container in (pod.get("status") or {}).get("containerStatuses") or []
            if container.get("name") == c.ROLE_TRAINER
            and (state := (container.get("state") or {}).get("terminated") or {}).get("exitCode")
            in contract.TRAINER_INPUT_EXIT_CODES
            and (state.get("message") or "").strip()
        ]
        if told:
            message = f"{told[0]} ({message})"
    return TrainerFailure(cause, message)


@dataclass(frozen=True)
class Restart:
    """Restart the trainer group: the counts to commit (the status write is the commit point) and why."""

    restarts: int
    by_cause: RestartCounts
    note: str


@dataclass(frozen=True)
class Fail:
    """Fail the job for good: its Failed reason and message."""

    reason: str
    message: str


def outcome(failure: TrainerFailure, restarts: int, by_cause: RestartCounts, spec: GRPOLoraJobSpec) -> Restart | Fail:
    """What the job does about a failure of its trainer: bad spec or data fails it; a disruption or a fenced trainer
    restarts it without spending spec.trainer.maxRestarts; a failure restarts it while restarts are left."""
    if failure.cause == names.CAUSE_INVALID_INPUT:
        return Fail(
            names.R_POD_FAILURE_POLICY,
            f"the trainer cannot work with its spec or data (a restart would not help): {failure.message}",
        )
    if failure.cause == names.CAUSE_FENCED:
        counted = by_cause.model_copy(update={"disruption": by_cause.disruption + 1})
        note = (
            f"restart {restarts + 1} with a new incarnation: the inference replicas fenced the trainer off as older "
            f"than the newest they saw (exit {contract.EXIT_FENCED}; not counted against spec.trainer.maxRestarts): "
            f"{failure.message}"
        )
        return Restart(restarts + 1, counted, note)
    if failure.cause == names.CAUSE_DISRUPTION:
        counted = by_cause.model_copy(update={"disruption": by_cause.disruption + 1})
        note = (
            f"restart {restarts + 1} from the latest checkpoint after a disruption (not counted against "
            f"spec.trainer.maxRestarts): {failure.message}"
        )
        return Restart(restarts + 1, counted, note)
    limit = spec.trainer.max_restarts
    if by_cause.failure < limit:
        counted = by_cause.model_copy(update={"failure": by_cause.failure + 1})
        note = f"restart {counted.failure} of {limit} from the latest checkpoint: {failure.message}"
        return Restart(restarts + 1, counted, note)
    return Fail(
        names.R_BACKOFF_LIMIT,
        f"the trainer failed and spec.trainer.maxRestarts ({limit}) restarts are used up; last failure: "
        f"{failure.message}",
    )
