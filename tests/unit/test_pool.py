"""RolloutPool: whether a job fits, the spec its trainer runs with on the pool, the attachment list, the plans."""

from __future__ import annotations

import json

import pytest

from grpolora.api import contract
from grpolora.api.load import parse_job
from grpolora.api.plan import LoopbackNetwork, PoolMismatch, plan, plan_pool
from grpolora.api.pool import Attachments, attachment, auth_digest, bind, fit_errors
from grpolora.api.spec import GRPOLoraJobSpec, RolloutPool
from grpolora.testing.jobs import job_doc


def pool_doc(**spec) -> dict:
    return {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "RolloutPool",
        "metadata": {"name": "shared", "namespace": "rl"},
        "spec": {"model": {"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, "replicas": 2, **spec},
    }


def pool(**spec) -> RolloutPool:
    return RolloutPool.model_validate(pool_doc(**spec))


def job_on_pool(**spec):
    doc = job_doc(model={"name": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}, inference={"poolRef": {"name": "shared"}})
    doc["metadata"]["namespace"] = "rl"
    for key, value in spec.items():
        doc["spec"][key] = doc["spec"].get(key, {}) | value
    return parse_job(doc)


def test_a_matching_job_fits():
    assert fit_errors("shared", pool().spec, job_on_pool().spec) == []


@pytest.mark.parametrize(
    ("job_spec", "pool_spec", "path", "words"),
    [
        ({"model": {"name": "Qwen/Qwen3-1.7B"}}, {}, "model.name", "'Qwen/Qwen3-1.7B' but RolloutPool shared serves"),
        ({"model": {"dtype": "float32"}}, {}, "model.dtype", "'float32'"),
        ({"model": {"revision": "abc"}}, {}, "model.revision", "'abc' but RolloutPool shared serves unset"),
        ({"lora": {"rank": 64}}, {"maxLoraRank": 32}, "lora.rank", "64 is above RolloutPool shared's maxLoraRank (32)"),
        ({"lora": {"targetModules": ["q_proj", "o_proj"]}}, {"loraTargetModules": ["q_proj", "v_proj"]},
         "lora.targetModules", "o_proj not within"),
        ({}, {"loraTargetModules": ["q_proj"]}, "lora.targetModules", "all-linear not within"),
        ({"grpo": {"maxStaleness": 2}}, {}, "grpo.maxStaleness", "keeps 3 adapter versions in use"),
        ({"grpo": {"maxNewTokens": 512}}, {"maxModelLen": 256}, "grpo.maxNewTokens", "maxModelLen (256)"),
        ({"environment": {"builtin": "calculator"}}, {"maxModelLen": 512}, "environment.maxEpisodeTokens",
         "1024 does not fit in RolloutPool shared's maxModelLen (512), which holds a whole episode"),
        ({"sync": {"backend": "nccl"}, "trainer": {"gpusPerReplica": 1}}, {"gpusPerReplica": 0}, "sync.backend",
         "needs GPUs on the trainer and on RolloutPool shared"),
    ],
)  # fmt: skip
def test_a_mismatch_names_the_field_and_both_values(job_spec, pool_spec, path, words):
    errors = fit_errors("shared", pool(**pool_spec).spec, job_on_pool(**job_spec).spec)
    assert [p for p, _ in errors] == [path]
    assert words in errors[0][1]


def test_staleness_fits_when_the_pool_gives_each_job_enough_slots():
    assert fit_errors("shared", pool(adaptersPerJob=3).spec, job_on_pool(grpo={"maxStaleness": 2}).spec) == []


def test_a_job_that_fits_binds():
    """What fit_errors lets through, bind takes: an episode budget within the pool's maxModelLen (a larger one was
    let through and then failed bind's validation, a traceback from `grpolora run`)."""
    p = pool(maxModelLen=512)
    for budget, fits in ((512, True), (513, False)):
        job = job_on_pool(environment={"builtin": "calculator", "maxEpisodeTokens": budget}).spec
        assert (fit_errors("shared", p.spec, job) == []) == fits
        if fits:
            assert bind(job, p.spec).environment.max_episode_tokens == budget


def test_a_job_on_a_pool_sets_none_of_its_own_serving_fields():
    with pytest.raises(ValueError, match=r"inference.replicas: a job on a RolloutPool .* remove it"):
        parse_job(job_doc(inference={"poolRef": {"name": "shared"}, "replicas": 2}))


def test_bound_spec_carries_the_pools_serving_and_validates_as_a_plain_job():
    p = pool(gpusPerReplica=0, maxModelLen=512, port=9000, adaptersPerJob=3)
    bound = bind(job_on_pool(grpo={"maxStaleness": 2}).spec, p.spec)
    assert bound.inference.pool_ref is None
    assert (bound.inference.replicas, bound.inference.gpus_per_replica) == (2, 0)
    assert (bound.inference.max_model_len, bound.inference.port, bound.inference.max_loras) == (512, 9000, 3)
    assert bound.sync_backend == "gloo"
    assert GRPOLoraJobSpec.model_validate(bound.to_wire()) == bound  # what the trainer reads back from its env


def test_job_plan_on_a_pool_has_no_inference_role_and_reaches_the_pools_servers():
    p = pool()
    job_plan = plan(job_on_pool(), pool=p)
    pool_plan = plan_pool(p)
    assert job_plan.inference is None and job_plan.roles == (job_plan.trainer,) and job_plan.pool == "shared"
    assert (
        job_plan.inference_endpoints
        == pool_plan.endpoints
        == (
            "http://shared-pool-0.shared-pool.rl.svc:8000",
            "http://shared-pool-1.shared-pool.rl.svc:8000",
        )
    )
    env = job_plan.env_for("trainer", 0, token="t")
    assert env[contract.SYNC_WORLD_SIZE] == "3"
    assert json.loads(env[contract.SPEC])["inference"]["replicas"] == 2
    with pytest.raises(ValueError, match="runs on RolloutPool shared"):
        job_plan.role("inference")


def test_job_plan_needs_its_pool_and_one_it_fits():
    with pytest.raises(
        PoolMismatch, match=r"inference\.poolRef\.name: names RolloutPool rl/shared, but the pool given is none"
    ):
        plan(job_on_pool())
    with pytest.raises(PoolMismatch, match=r"lora\.rank"):
        plan(job_on_pool(lora={"rank": 64}), pool=pool())


def test_pool_plan_env_and_loopback_ports():
    p = pool(gpusPerReplica=0, port=9100)
    pool_plan = plan_pool(p, LoopbackNetwork())
    assert pool_plan.endpoints == ("http://127.0.0.1:9100", "http://127.0.0.1:9101")
    env = pool_plan.env_for(1, jobs_file="/run/jobs.json")
    assert env[contract.POOL_NAME] == "shared" and env[contract.REPLICA_INDEX] == "1"
    assert env[contract.HTTP_PORT] == "9101" and plan_pool(p).env_for(1, jobs_file="j")[contract.HTTP_PORT] == "9100"
    assert env[contract.POOL_JOBS_FILE] == "/run/jobs.json" and env[contract.SYNC_BACKEND] == "gloo"
    assert contract.TOKEN not in env and contract.SPEC not in env
    assert json.loads(env[contract.POOL_SPEC])["maxJobs"] == 4


def test_attachment_list_round_trips_and_holds_no_token():
    entry = attachment("rl", "job-a", "uid-1", "s3cret-token", job_on_pool(grpo={"maxStaleness": 1}).spec)
    text = Attachments(pool="shared", jobs=[entry]).to_json()
    assert "s3cret-token" not in text
    back = Attachments.from_json(text)
    assert back.jobs[0].job == "rl/job-a" and back.jobs[0].kept_versions == 2
    assert back.jobs[0].auth == auth_digest("s3cret-token")


def test_pool_spec_refuses_a_rank_vllm_cannot_slot():
    with pytest.raises(ValueError, match="not a vLLM LoRA slot size"):
        pool(maxLoraRank=24)
