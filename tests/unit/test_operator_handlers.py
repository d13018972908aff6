"""The Kopf handlers map the controller's outcomes to Kopf's errors; the options and settings the CLI builds."""

from __future__ import annotations

import datetime
from typing import Any

import kopf
import pytest

from grpolora.api.status import JobStatus
from grpolora.operator import handlers, kube, names
from grpolora.operator.job_view import job_view
from grpolora.operator.main import OperatorOptions, build_settings
from grpolora.operator.reconcile import Decision, Observed, decide
from grpolora.operator.scheduler import Gone
from tests.helpers import job_doc

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


class FakeController:
    def __init__(self, outcome: Any):
        self.outcome = outcome
        self.bodies: list[dict[str, Any]] = []

    async def reconcile(self, body: dict[str, Any]) -> Decision:
        self.bodies.append(body)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


async def call(outcome: Any) -> FakeController:
    controller = FakeController(outcome)
    body = kopf.Body(job_doc())
    await handlers.reconcile(body=body, memo=kopf.Memo(controller=controller))
    return controller


async def test_a_valid_pass_returns_and_hands_over_a_plain_body():
    controller = await call(decide(job_view(job_doc()), JobStatus(), Observed(), NOW))
    (body,) = controller.bodies
    assert type(body) is dict and type(body["spec"]) is dict and body["metadata"]["name"] == "demo"


async def test_an_invalid_spec_is_a_permanent_error():
    decision = decide(job_view(job_doc(grpo={"steps": 0})), JobStatus(), Observed(), NOW)
    with pytest.raises(kopf.PermanentError, match=r"invalid spec: spec\.grpo\.steps"):
        await call(decision)


async def test_an_unreachable_api_is_a_temporary_error_and_others_are_left_to_kopf():
    with pytest.raises(kopf.TemporaryError) as caught:
        await call(kube.ApiError(503, "ServiceUnavailable", "etcd", method="GET", path="/x"))
    assert caught.value.delay == handlers.API_RETRY_SECONDS
    with pytest.raises(kube.ApiError):
        await call(kube.ApiError(403, "Forbidden", "rbac", method="POST", path="/x"))


async def test_a_job_deleted_during_the_pass_is_not_an_error():
    await call(Gone("team-a/demo"))


def test_the_registry_has_one_reconcile_handler_for_create_resume_and_spec_updates():
    """For GRPOLoraJobs, and for RolloutPools through the same machinery; a job's Kueue queue label too (it moves a
    waiting job to another queue, job_view.with_queue_in_effect)."""
    registry = handlers.build_registry()
    for function, more in ((handlers.reconcile, {"queue-label/metadata.labels.kueue.x-k8s.io/queue-name"}),
                           (handlers.reconcile_pool, set())):  # fmt: skip
        changing = [h.id for h in registry._changing.get_all_handlers() if h.fn is function]
        assert set(changing) == {"reconcile", "reconcile/spec"} | more and len(changing) == 3 + len(more), changing


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({}, "either all namespaces or a list"),
        ({"namespaces": ("a",), "all_namespaces": True}, "either all namespaces or a list"),
        ({"namespaces": ("a",), "metrics_port": 70000}, "--metrics-port: 70000"),
        ({"all_namespaces": True, "status_interval": 0}, "--status-interval must be positive"),
    ],
)
def test_bad_options_are_refused_naming_the_flag(options, error):
    with pytest.raises(ValueError, match=error):
        OperatorOptions(**options)


def test_kopf_settings():
    settings = build_settings()
    assert settings.scanning.disabled is True  # no cluster-wide namespace/CRD permissions needed
    assert settings.posting.enabled is False  # our own events only
    assert settings.persistence.diffbase_storage.prefix == names.KOPF_PREFIX
