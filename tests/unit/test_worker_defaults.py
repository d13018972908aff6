"""Cluster-wide worker defaults: images (by GPU or CPU) and image pull secrets that the operator's flags (the chart's
`workers` values) give every role whose spec names no image, instead of the project's hard-coded tag."""

from __future__ import annotations

import pytest

from grpolora.api import constants as c
from grpolora.api.load import parse_job
from grpolora.api.plan import WorkerDefaults, plan, plan_pool, set_worker_defaults, worker_defaults
from grpolora.api.pool import Attachments
from grpolora.cli import build_parser
from grpolora.operator.builders import build_children, build_pool_children
from tests.helpers import job_doc
from tests.unit.test_pool import pool

GPU = "registry.example.com/grpo/worker-gpu@sha256:" + "b" * 64
CPU = "registry.example.com/grpo/worker-cpu:0.1.0"
CLUSTER = WorkerDefaults(image_gpu=GPU, image_cpu=CPU, image_pull_secrets=("regcred", "mirror"))


@pytest.fixture
def cluster_defaults():
    set_worker_defaults(CLUSTER)
    yield CLUSTER
    set_worker_defaults(WorkerDefaults())


def pods(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("Job", "StatefulSet")}


def children(doc: dict) -> dict[str, dict]:
    return pods(build_children(plan(parse_job(doc)), owner_uid="u", token="t"))


def test_without_cluster_defaults_the_hard_coded_images_and_no_pull_secrets():
    assert worker_defaults() == WorkerDefaults()
    built = children(job_doc(trainer={"gpusPerReplica": 0}, inference={"gpusPerReplica": 1}))
    assert built["Job"]["containers"][0]["image"] == c.DEFAULT_WORKER_IMAGE_CPU
    assert built["StatefulSet"]["containers"][0]["image"] == c.DEFAULT_WORKER_IMAGE_GPU
    assert "imagePullSecrets" not in built["Job"] and "imagePullSecrets" not in built["StatefulSet"]


def test_cluster_defaults_give_images_by_gpu_and_pull_secrets_to_every_worker_pod(cluster_defaults):
    built = children(job_doc(trainer={"gpusPerReplica": 0}, inference={"gpusPerReplica": 1}))
    assert built["Job"]["containers"][0]["image"] == CPU
    assert built["StatefulSet"]["containers"][0]["image"] == GPU
    for pod in built.values():
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]


def test_a_pools_servers_get_the_cluster_defaults_too(cluster_defaults):
    rollout_pool = pool()
    objects = build_pool_children(plan_pool(rollout_pool), owner_uid="u", attachments=Attachments(pool="p", jobs=[]))
    server = pods(objects)["StatefulSet"]
    assert server["containers"][0]["image"] == (GPU if rollout_pool.spec.gpus_per_replica else CPU)
    assert server["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]


def test_the_spec_wins_over_the_cluster_defaults(cluster_defaults):
    built = children(
        job_doc(
            trainer={"image": "mine/trainer:1"},
            inference={
                "gpusPerReplica": 0,
                "podTemplate": {"spec": {"imagePullSecrets": [{"name": "team-a"}, {"name": "regcred"}]}},
            },
        )
    )
    assert built["Job"]["containers"][0]["image"] == "mine/trainer:1"
    assert built["StatefulSet"]["containers"][0]["image"] == CPU
    # The job's own pull secrets come on top, merged by name (grpolora.api.overlay).
    names = [s["name"] for s in built["StatefulSet"]["imagePullSecrets"]]
    assert sorted(names) == ["mirror", "regcred", "team-a"]


def test_the_operators_flags_make_the_cluster_defaults():
    from grpolora.operator.main import OperatorOptions

    secrets = ["--worker-image-pull-secret", "regcred", "--worker-image-pull-secret", "mirror"]
    args = build_parser().parse_args(
        ["operator", "--all-namespaces", "--worker-image-gpu", GPU, "--worker-image-cpu", CPU, *secrets]
    )
    assert (args.worker_image_gpu, args.worker_image_cpu, args.worker_image_pull_secrets) == (
        GPU,
        CPU,
        ["regcred", "mirror"],
    )
    options = OperatorOptions(
        all_namespaces=True,
        worker_image_gpu=GPU,
        worker_image_cpu=CPU,
        worker_image_pull_secrets=("regcred", "mirror"),
    )
    assert options.worker_defaults() == CLUSTER
    unset = build_parser().parse_args(["operator", "--all-namespaces"])
    assert unset.worker_image_gpu is None and unset.worker_image_pull_secrets is None
    assert OperatorOptions(all_namespaces=True).worker_defaults() == WorkerDefaults()


@pytest.mark.parametrize("image", ["", "no spaces allowed", "untagged/image"])
def test_an_image_without_a_tag_or_digest_is_refused(image):
    from grpolora.operator.main import OperatorOptions

    with pytest.raises(ValueError, match="--worker-image-gpu"):
        OperatorOptions(all_namespaces=True, worker_image_gpu=image)
