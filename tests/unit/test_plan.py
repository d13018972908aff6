"""plan(): the one source of names, ranks, world sizes, ports, placement and the env contract."""

from __future__ import annotations

import json

import pytest

from grpolora.api import contract
from grpolora.api.contract import ContractError, WorkerEnv
from grpolora.api.load import parse_job
from grpolora.api.plan import LoopbackNetwork, plan
from tests.helpers import job_doc

SHAPES = [
    # trainer replicas, trainer GPUs, inference replicas, inference GPUs, TP
    (1, 1, 1, 1, 1),
    (2, 4, 3, 2, 2),
    (4, 0, 2, 0, 1),
    (1, 8, 4, 4, 4),
]


@pytest.mark.parametrize(("t", "tg", "m", "ig", "tp"), SHAPES)
def test_plan_shapes(t, tg, m, ig, tp):
    job = parse_job(
        job_doc(
            trainer={"replicas": t, "gpusPerReplica": tg},
            inference={"replicas": m, "gpusPerReplica": ig, "tensorParallelSize": tp},
        )
    )
    p = plan(job)
    procs = max(tg, 1)
    assert p.trainer_world_size == t * procs
    assert p.trainer.replicas == t and p.trainer.procs_per_replica == procs
    assert p.inference.replicas == m and p.inference.procs_per_replica == 1
    assert p.sync.world_size == 1 + m
    assert p.sync.backend == ("nccl" if tg and ig else "gloo")
    assert p.trainer.hosts == tuple(f"demo-trainer-{i}.demo-trainer.team-a.svc" for i in range(t))
    assert p.inference.hosts == tuple(f"demo-inference-{i}.demo-inference.team-a.svc" for i in range(m))
    assert p.master_addr == p.sync.addr == p.trainer.hosts[0]
    assert p.inference_endpoints == tuple(f"http://{h}:8000" for h in p.inference.hosts)
    assert p.trainer.placement.gpus == tg and p.inference.placement.gpus == ig
    for role in ("trainer", "inference"):
        for index in range(p.role(role).replicas):
            worker = WorkerEnv.from_environ(p.env_for(role, index, token="s3cret"))
            assert worker.role == role and worker.replica_index == index
            assert worker.world_size == t * procs and worker.local_world_size == procs
            assert worker.sync_world_size == 1 + m and worker.token == "s3cret"
            assert worker.spec == job.spec
            if role == "inference":
                assert worker.sync_rank == 1 + index
                assert worker.own_endpoint == p.inference_endpoints[index]


def test_loopback_plan_gives_each_inference_replica_its_own_port():
    job = parse_job(job_doc(trainer={"gpusPerReplica": 0}, inference={"replicas": 3, "gpusPerReplica": 0}))
    p = plan(job, LoopbackNetwork())
    assert p.inference_endpoints == ("http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert p.master_addr == "127.0.0.1"
    env = p.env_for("inference", 2, token="t")
    assert env[contract.BIND_ADDR] == "127.0.0.1"
    assert WorkerEnv.from_environ(env).own_endpoint == "http://127.0.0.1:8002"


def test_env_contract_is_the_same_for_both_roles_apart_from_role_and_index():
    p = plan(parse_job(job_doc(inference={"replicas": 2})))
    trainer = p.env_for("trainer", 0, token="t")
    inference = p.env_for("inference", 1, token="t")
    differing = {k for k in trainer if trainer[k] != inference.get(k)}
    assert differing == {contract.ROLE, contract.REPLICA_INDEX, contract.NODE_RANK}
    assert set(trainer) <= set(contract.ALL)


def test_spec_travels_whole_in_the_env():
    job = parse_job(job_doc(grpo={"steps": 7}, lora={"rank": 8}))
    spec = json.loads(plan(job).env_for("trainer", 0, token="t")[contract.SPEC])
    assert spec["grpo"]["steps"] == 7 and spec["lora"]["rank"] == 8


def test_model_from_a_pvc_is_read_at_the_mount():
    job = parse_job(job_doc(model={"name": "qwen3", "source": {"pvc": {"claimName": "models"}}}))
    assert plan(job).model == "/models/qwen3"
    assert plan(parse_job(job_doc())).model == "Qwen/Qwen3-0.6B"


def test_worker_env_names_the_missing_variable():
    env = plan(parse_job(job_doc())).env_for("trainer", 0, token="t")
    del env[contract.SYNC_PORT]
    with pytest.raises(ContractError, match="GRPOLORA_SYNC_PORT"):
        WorkerEnv.from_environ(env)
    env = plan(parse_job(job_doc())).env_for("trainer", 0, token="t")
    env[contract.MASTER_PORT] = "http"
    with pytest.raises(ContractError, match="MASTER_PORT='http' is not an integer"):
        WorkerEnv.from_environ(env)


def test_default_images_follow_gpus():
    p = plan(parse_job(job_doc(trainer={"gpusPerReplica": 0}, inference={"image": "mine:1"})))
    assert "cpu" in p.trainer.placement.image
    assert p.inference.placement.image == "mine:1"


def test_every_contract_variable_is_documented():
    from tests.helpers import ROOT

    doc = (ROOT / "docs" / "contract.md").read_text()
    missing = [name for name in contract.ALL if f"`{name}`" not in doc]
    assert not missing, f"document in docs/contract.md: {missing}"
