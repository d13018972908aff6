"""Kubernetes quantities parsed as the API server parses them (k8s.io/apimachinery pkg/api/resource/quantity.go,
ParseQuantity and parseQuantityString; suffix.go), and the API server's rules on a container's resources
(kubernetes pkg/apis/core/validation/validation.go, ValidateResourceRequirements and ValidateResourceQuantityValue),
checked where a job is validated, each naming its field."""

from __future__ import annotations

from fractions import Fraction

import pytest

from grpolora.api.load import InvalidJob, parse_job
from grpolora.api.quantity import QuantityError, parse
from tests.helpers import job_doc


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0), ("1", 1), ("500m", Fraction(1, 2)), ("16Gi", 16 * 2**30), ("1.5Gi", 3 * 2**29), ("2k", 2000),
        ("1e3", 1000), ("1E3", 1000), ("1e-3", Fraction(1, 1000)), ("1e+3", 1000), ("1E", 10**18),
        ("5n", Fraction(5, 10**9)), ("3u", Fraction(3, 10**6)),
        (".5", Fraction(1, 2)), ("1.", 1), ("1.G", 10**9), ("+2", 2), ("-1Gi", -(2**30)),
        ("007", 7), ("0.9n", Fraction(1, 10**9)),  # finer than nano: rounded away from zero, to 1n
        ("8Ei", 2**63 - 1),  # a binary quantity is capped at 2^63-1, silently
        # The scanner's quirks, which the API server takes: no digits before the suffix read as 0.
        ("-", 0), ("+", 0), (".", 0), ("Gi", 0), ("e3", 0), (" 2Gi ", 2 * 2**30),  # Quantity.UnmarshalJSON trims
        (2, 2), (0.5, Fraction(1, 2)), (17179869184, 16 * 2**30),
    ],
)  # fmt: skip
def test_quantities_parse_as_apimachinery_parses_them(text, value):
    assert parse(text) == value


@pytest.mark.parametrize(
    "text", ["", "16 GB", "16GB", "1Gib", "1e", "1K", "1ki", "1.5.5", "1Ki2", "1e3.5", "--1", "1e9999999999999999999"]
)
def test_what_apimachinery_refuses_is_refused(text):
    with pytest.raises(QuantityError):
        parse(text)


def problems_of(**spec) -> dict[str, str]:
    with pytest.raises(InvalidJob) as caught:
        parse_job(job_doc(**spec))
    return {p.path: p.message for p in caught.value.problems}


def test_a_negative_quantity_is_refused_at_its_field():
    found = problems_of(trainer={"resources": {"limits": {"memory": "-1Gi"}, "requests": {"cpu": -1}}})
    assert found["spec.trainer.resources.limits.memory"] == 'Invalid value: "-1Gi": must be greater than or equal to 0'
    assert found["spec.trainer.resources.requests.cpu"] == 'Invalid value: "-1": must be greater than or equal to 0'


def test_a_request_above_its_limit_is_refused_naming_both():
    found = problems_of(inference={"resources": {"requests": {"memory": "64Gi"}, "limits": {"memory": "32Gi"}}})
    assert found["spec.inference.resources.requests.memory"] == (
        'Invalid value: "64Gi": must be less than or equal to memory limit of 32Gi'
    )
    # Equal values written differently are equal (1Gi is 1024Mi): accepted.
    parse_job(job_doc(inference={"resources": {"requests": {"memory": "1024Mi", "cpu": "1"}, "limits": {
        "memory": "1Gi", "cpu": "1000m"}}}))  # fmt: skip


def test_an_extended_resource_is_whole_and_its_request_equals_its_limit():
    found = problems_of(trainer={"resources": {"limits": {"example.com/fpga": "500m", "rdma/hca": "2"},
                                               "requests": {"rdma/hca": "1", "vendor.io/nic": "1"}}})  # fmt: skip
    assert found["spec.trainer.resources.limits.example.com/fpga"] == 'Invalid value: "500m": must be an integer'
    assert found["spec.trainer.resources.requests.rdma/hca"] == (
        'Invalid value: "1": must be equal to rdma/hca limit of 2'
    )
    assert found["spec.trainer.resources.limits.vendor.io/nic"] == (
        "Required value: Limit must be set for non overcommitable resources"
    )


def test_a_sidecars_resources_in_the_pod_template_are_checked_too():
    sidecar = {"name": "proxy", "resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}}
    found = problems_of(trainer={"podTemplate": {"spec": {"containers": [sidecar]}}})
    assert found["spec.trainer.podTemplate.spec.containers[0].resources.requests.memory"] == (
        'Invalid value: "2Gi": must be less than or equal to memory limit of 1Gi'
    )


def test_the_size_limits_are_quantities_and_not_negative():
    found = problems_of(trainer={"shmSizeLimit": "-8Gi", "cacheSizeLimit": "40GB"})
    assert "must be greater than or equal to 0" in found["spec.trainer.shmSizeLimit"]
    assert "is not a Kubernetes quantity" in found["spec.trainer.cacheSizeLimit"]


def test_the_api_emulator_refuses_what_the_api_server_refuses():
    """The API emulator (grpolora/testing/kube_apiserver.py) plays the same rules on the pods it is sent, with the
    API server's field paths (`limits[memory]`, and `requests` for a request against its limit)."""
    pytest.importorskip("kubernetes_validate")
    from grpolora.testing import kube_apiserver

    container = {"name": "trainer", "image": "x", "resources": {"limits": {"memory": "32Gi", "cpu": "-1"},
                                                                "requests": {"memory": "64Gi"}}}  # fmt: skip
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
           "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}}  # fmt: skip
    with pytest.raises(kube_apiserver.Refused) as refused:
        kube_apiserver.validate_builtin(job, strict=True)
    causes = {cause["field"]: cause["message"] for cause in refused.value.details["causes"]}
    where = "spec.template.spec.containers[0].resources"
    assert causes == {
        f"{where}.limits[cpu]": 'Invalid value: "-1": must be greater than or equal to 0',
        f"{where}.requests": 'Invalid value: "64Gi": must be less than or equal to memory limit of 32Gi',
    }


def test_the_cache_request_the_operator_adds_stays_within_the_roles_limit():
    """The operator requests cacheSizeLimit of ephemeral-storage for the pods (operator/builders.py _resources) unless
    the role requests some: above the role's own ephemeral-storage limit, the API server would refuse the pods."""
    found = problems_of(trainer={"cacheSizeLimit": "40Gi", "resources": {"limits": {"ephemeral-storage": "20Gi"}}})
    assert found["spec.trainer.cacheSizeLimit"] == (
        "'40Gi' is requested as the pods' ephemeral-storage, above resources.limits.ephemeral-storage (20Gi): the API "
        "server would refuse the pods; raise the limit or lower cacheSizeLimit"
    )
    parse_job(job_doc(trainer={"cacheSizeLimit": "20Gi", "resources": {"limits": {"ephemeral-storage": "20Gi"}}}))
