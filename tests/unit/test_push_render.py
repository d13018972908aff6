"""The Secrets of spec.output.push reach the trainer pod as the S3 one does: mounted read-only under
/var/run/grpolora/secrets/<name>/ (the trainer reads HF_TOKEN from there), never on inference pods; and the spec
takes a Hub destination, an S3 one or both, with everySteps."""

from __future__ import annotations

import kubernetes_validate
import pytest

from grpolora.api import contract
from grpolora.api.load import InvalidJob, parse_job
from tests.helpers import job_doc
from tests.unit.test_render import K8S_VERSION, by_kind, children, env_of

PUSH = {
    "hub": {"repo": "org/adapter", "secretName": "hf-hub", "branch": "runs", "private": True},
    "s3": {"url": "s3://b/p", "secretName": "s3"},
    "everySteps": 10,
}


def test_trainer_mounts_the_hub_token_secret():
    objs = by_kind(children(job_doc(output={"push": PUSH})))
    trainer = objs[("Job", "demo-trainer")]
    pod = trainer["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted = {m["mountPath"]: volumes[m["name"]]["secret"]["secretName"] for m in pod["containers"][0]["volumeMounts"]
               if m["name"].startswith("secret-") and m["readOnly"]}  # fmt: skip
    assert mounted == {"/var/run/grpolora/secrets/s3": "s3", "/var/run/grpolora/secrets/hf-hub": "hf-hub"}
    assert env_of(trainer)[contract.SECRETS_DIR] == "/var/run/grpolora/secrets"
    inference = objs[("StatefulSet", "demo-inference")]["spec"]["template"]["spec"]
    assert not any(v["name"].startswith("secret-") for v in inference["volumes"])
    for obj in objs.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    ("push", "field"),
    [
        ({"everySteps": 5}, "spec.output.push"),
        ({"hub": {"repo": "no-owner"}}, "spec.output.push.hub.repo"),
        ({"hub": {"repo": "org/a"}, "everySteps": 0}, "spec.output.push.everySteps"),
    ],
)
def test_bad_push_fields_are_named(push, field):
    with pytest.raises(InvalidJob) as caught:
        parse_job(job_doc(output={"push": push}))
    assert [p.path for p in caught.value.problems] == [field], str(caught.value)
