"""Failure policy: disruptions (drain, preemption, spot reclaim) restart the trainer group without spending
spec.trainer.maxRestarts; the trainer's "bad spec or data" exit codes fail the job at once with its message;
a PodDisruptionBudget keeps a drain from taking every inference replica at once; restarts are counted by cause."""

from __future__ import annotations

from typing import Any

from grpolora.api import contract
from grpolora.api.load import parse_job
from grpolora.api.plan import plan
from grpolora.api.status import JobStatus, RestartCounts
from grpolora.operator import builders, job_failure, names
from grpolora.operator.reconcile import ChildRef, Observed, decide
from tests.helpers import job_doc
from tests.unit.test_operator_reconcile import NOW, STAMP, applied_view, condition, running, statefulset, trainer_job

NS = "team-a"


def rendered(kind: str, **spec: Any) -> dict[str, Any]:
    objects = builders.build_children(plan(parse_job(job_doc(**spec))), owner_uid="u", token="t")
    return next(o for o in objects if o["kind"] == kind)


def test_the_trainer_job_fails_at_once_on_a_disruption_or_a_bad_spec_exit_code():
    job = rendered("Job")
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules == [
        {
            "action": "FailJob",
            "onExitCodes": {
                "containerName": "trainer",
                "operator": "In",
                "values": sorted(contract.TRAINER_INPUT_EXIT_CODES),
            },
            "onPodConditions": [],  # required by Kubernetes 1.28's schema (tests/unit/test_render.py)
        },
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [contract.EXIT_FENCED]},
            "onPodConditions": [],
        },
    ]
    # The rule indexes are what the Job's failure message names; the operator maps them back to the cause.
    assert job_failure.TRAINER_FAILURE_RULE_CAUSES == (
        names.CAUSE_INVALID_INPUT,
        names.CAUSE_DISRUPTION,
        names.CAUSE_FENCED,
    )
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_the_exit_codes_are_distinct_and_not_the_generic_failure():
    codes = contract.TRAINER_INPUT_EXIT_CODES
    assert set(codes) == {contract.EXIT_INVALID_SPEC, contract.EXIT_INVALID_DATA}
    assert len(codes) == 2 and not {0, 1, 2, 137, 143} & set(codes)
    assert contract.EXIT_FENCED not in {0, 1, 2, 137, 143, *codes}


def test_a_fenced_trainer_is_replaced_as_a_disruption_not_a_failure():
    """FailureTarget (or Failed) naming the fenced rule: a restart with a new incarnation, maxRestarts unspent."""
    view = applied_view(trainer={"maxRestarts": 0})
    message = (
        f"Container trainer for pod team-a/demo-trainer-0-x failed with exit code {contract.EXIT_FENCED} matching "
        "FailJob rule at index 2"
    )
    failed = trainer_job(condition="FailureTarget", message=message)
    failed["status"]["conditions"][0]["reason"] = names.R_POD_FAILURE_POLICY
    decision = decide(view, running(), Observed(failed, statefulset(1)), NOW)
    assert decision.status.phase == "Running" and decision.status.trainer_restarts == 1
    assert decision.status.restarts_by_cause == RestartCounts(failure=0, disruption=1)
    assert "fenced" in decision.events[0].message


def test_inference_pods_get_a_disruption_budget_that_selects_them():
    budget = rendered("PodDisruptionBudget", inference={"replicas": 3})
    statefulset_ = rendered("StatefulSet", inference={"replicas": 3})
    assert budget["apiVersion"] == "policy/v1" and budget["metadata"]["name"] == "demo-inference"
    assert budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": statefulset_["spec"]["selector"]["matchLabels"]},
    }


DISRUPTED = "Pod team-a/demo-trainer-0-x7k2p has condition DisruptionTarget matching FailJob rule at index 1"
BAD_DATA = f"Container trainer for pod team-a/demo-trainer-0-x7k2p failed with exit code {contract.EXIT_INVALID_DATA} matching FailJob rule at index 0"  # noqa: E501


def policy_failed(message: str, attempt: int = 0) -> dict[str, Any]:
    job = trainer_job(condition="Failed", message=message, attempt=attempt)
    job["status"]["conditions"][0]["reason"] = "PodFailurePolicy"
    return job


def trainer_pod(exit_code: int, message: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "demo-trainer-0-x7k2p", "labels": {"grpolora.dev/role": "trainer"}},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {"name": "trainer", "state": {"terminated": {"exitCode": exit_code, "message": message}}}
            ],
        },
    }


def test_a_disruption_restarts_the_trainer_without_spending_max_restarts():
    view = applied_view(trainer={"maxRestarts": 0})
    first = decide(view, running(), Observed(policy_failed(DISRUPTED), statefulset(1)), NOW)
    assert first.status.phase == "Running" and first.status.trainer_restarts == 1
    assert first.status.restarts_by_cause is not None
    assert first.status.restarts_by_cause.disruption == 1 and first.status.restarts_by_cause.failure == 0
    assert "disruption" in first.events[0].message and "DisruptionTarget" in first.events[0].message
    second = decide(view, first.status, Observed(policy_failed(DISRUPTED), statefulset(1)), NOW)
    assert second.delete == (ChildRef("Job", "demo-trainer"),) and second.create == ()  # created once it is gone
    # Another disruption of the replacement restarts it again: still nothing spent.
    third = decide(view, second.status, Observed(policy_failed(DISRUPTED, attempt=1), statefulset(1)), NOW)
    assert third.status.phase == "Running" and third.status.trainer_restarts == 2
    assert third.status.restarts_by_cause.disruption == 2


def test_a_fault_after_disruptions_still_gets_its_max_restarts():
    view = applied_view(trainer={"maxRestarts": 1})
    disrupted = running(trainer_restarts=2, restarts_by_cause=RestartCounts(disruption=2))
    failed = trainer_job(condition="Failed", message="BackoffLimitExceeded", attempt=2)
    decision = decide(view, disrupted, Observed(failed, statefulset(1)), NOW)
    assert decision.status.phase == "Running" and decision.status.trainer_restarts == 3
    assert decision.status.restarts_by_cause.failure == 1 and decision.status.restarts_by_cause.disruption == 2


def test_a_bad_spec_or_data_exit_fails_the_job_at_once_with_the_trainers_message():
    view = applied_view(trainer={"maxRestarts": 3})
    pod = trainer_pod(contract.EXIT_INVALID_DATA, "spec.task.dataset.path: file not found: /data/x.jsonl")
    decision = decide(view, running(), Observed(policy_failed(BAD_DATA), statefulset(1), pods=(pod,)), NOW)
    assert decision.status.phase == "Failed" and decision.status.completion_time == STAMP
    assert condition(decision, names.FAILED) == ("True", names.R_POD_FAILURE_POLICY)
    assert "spec.task.dataset.path: file not found: /data/x.jsonl" in decision.status.message
    assert decision.status.trainer_restarts == 0
    assert decision.delete == (ChildRef("StatefulSet", "demo-inference"),)


def test_without_the_pod_the_bad_input_failure_still_says_which_exit_code():
    decision = decide(applied_view(), running(), Observed(policy_failed(BAD_DATA), statefulset(1)), NOW)
    assert decision.status.phase == "Failed" and f"exit code {contract.EXIT_INVALID_DATA}" in decision.status.message


def test_a_status_from_before_restarts_by_cause_counts_its_restarts_as_failures():
    view = applied_view(trainer={"maxRestarts": 1})
    old = JobStatus.model_validate(
        {k: v for k, v in running(trainer_restarts=1).to_wire().items() if k != "restartsByCause"}
    )
    failed = trainer_job(condition="Failed", attempt=1, message="OOMKilled")
    assert decide(view, old, Observed(failed, statefulset(1)), NOW).status.phase == "Failed"
