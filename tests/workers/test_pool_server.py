"""A RolloutPool's inference server: several jobs on one vLLM engine, each with its own token, sync group, adapter
versions and LoRA ids.

The first tests run the real pool app (create_pool_app, the attachment list, tenants, fair gates, sync receivers)
around a stand-in for vLLM's generation (GatedEngine), for what must be deterministic: the fair order of two
jobs' prompts, readiness, the attachment list's life. The rest run ONE real pool server process (vLLM CPU
engine, tiny Llama) for the module, into which two trainers' senders push at once over gloo: parity per job with
HF + peft, cross-job refusal, a bad attachment list, detachment."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from grpolora.api import contract
from grpolora.api.contract import ContractError, PoolEnv
from grpolora.api.pool import Attachments, PoolReplicas, replicas_file, write_attachments
from grpolora.testing.servers import (
    PoolServerProcess,
    free_port,
    generate,
    http_sender,
    pool_attachment,
    tiny_cpu_pool,
    wait_in_flight,
)
from grpolora.workers.adapter import lora_config, lora_tensors
from grpolora.workers.inference.app import create_pool_app
from grpolora.workers.inference.tenants import pool_tenants, tenant_ready
from grpolora.workers.inference.vllm_engine import EngineConfig, EngineLimits, Sample, SamplingRequest, VllmEngine
from grpolora.workers.models import resolve_model
from grpolora.workers.sync.control import JoinRequest, SyncError
from grpolora.workers.sync.receiver import AdapterReceiver
from tests.workers.fakeengine import AppThread
from tests.workers.parity import greedy, hf_logprobs, peft_policy, randomize_adapter, raw_request, tokens

log = logging.getLogger(__name__)
JOB_A, JOB_B, JOB_C = "team-a/job-a", "team-a/job-b", "team-a/job-c"
TOKENS = {JOB_A: "token-of-a", JOB_B: "token-of-b", JOB_C: "token-of-c"}


def bearer(job: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[job]}"}


# ---- the pool app around a stand-in for vLLM's generation ---------------------------------------------------------


class GatedEngine(VllmEngine):
    """vLLM's side, stood in for: records each prompt as it enters generation (with how many prompts of each job
    were generating then) and answers only once `release` is set; LoRA ids added and removed are kept as vLLM would."""

    errored = False  # AsyncLLM.errored, which VllmEngine.dead reads: this one never dies

    def __init__(self) -> None:
        super().__init__(EngineConfig(model_dir="fake", dtype="float32", max_lora_rank=8, max_loras=8))
        self.release = threading.Event()
        self.release.set()
        self.entered: list[tuple[int, dict[int, int]]] = []  # (prompt's first token, running by first token)
        self.running: dict[int, int] = {}
        self.loras: set[int] = set()

    async def start(self) -> None:
        self.limits = EngineLimits(max_model_len=256, vocab_size=1000)
        self._engine = self  # started

    def shutdown(self) -> None:
        self._engine = None

    async def collective_rpc(self, method: str, *_, **__) -> list[None]:  # AsyncLLM's: the health round trip
        return [None]

    async def add_lora(self, request, tensors, adapter_config: dict) -> None:
        self.loras.add(request.lora_int_id)

    async def remove_lora(self, lora_id: int) -> None:
        self.loras.discard(lora_id)

    async def list_loras(self) -> list[int]:
        return sorted(self.loras)

    async def generate(self, prompt_token_ids: list[int], request: SamplingRequest, lora) -> list[Sample]:
        first = prompt_token_ids[0]
        self.running[first] = self.running.get(first, 0) + 1
        self.entered.append((first, dict(self.running)))
        try:
            while not self.release.is_set():
                await asyncio.sleep(0.005)
        finally:
            self.running[first] -= 1
        return [Sample([prompt_token_ids[-1]], [-0.5], "x", "length") for _ in range(request.n)]


def pool_app(
    engine: GatedEngine,
    tmp: Path,
    *,
    grace: float,
    jobs: tuple[str, ...] = (JOB_A, JOB_B),
    replica_index: int = 0,
    **spec,
):
    pool = tiny_cpu_pool(**spec)
    tmp.mkdir(parents=True, exist_ok=True)
    jobs_file = tmp / "jobs.json"
    write_attachments(jobs_file, Attachments(pool=pool.name, jobs=[pool_attachment(j, TOKENS[j]) for j in jobs]))

    def receiver(book, key: bytes, job: str) -> AdapterReceiver:
        return AdapterReceiver(book, replica_index=replica_index, fingerprint="fp", key=key, name=job)

    attachments = pool_tenants(
        engine, pool.pool.spec, pool=pool.name, jobs_file=jobs_file, receiver=receiver, join_grace_seconds=grace
    )
    return create_pool_app(engine, attachments, version_wait_seconds=1), attachments


def wait_for(condition, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_job_flooding_the_pool_leaves_room_for_another(tmp_path):
    """Job A's 8 prompts against a cap of 2 sequences: 2 enter generation, 6 wait in A's own queue; job B's prompt
    enters at once, while A's backlog still waits (without the cap, all of A's would be in vLLM before B's)."""
    engine = GatedEngine()
    app, _ = pool_app(engine, tmp_path, grace=0, maxInFlightPerJob=2)
    engine.release.clear()
    with AppThread(app) as server, concurrent.futures.ThreadPoolExecutor(2) as threads:
        flood = {"prompt_token_ids": [[1, i] for i in range(8)], "max_tokens": 1}
        a = threads.submit(httpx.post, f"{server.url}/v1/generate", json=flood, headers=bearer(JOB_A), timeout=30)
        wait_for(lambda: len(engine.entered) >= 2, "A's first prompts")
        b = threads.submit(
            httpx.post, f"{server.url}/v1/generate", json={"prompt_token_ids": [[2, 0]]}, headers=bearer(JOB_B)
        )
        wait_for(lambda: any(first == 2 for first, _ in engine.entered), "B's prompt")
        metrics = httpx.get(f"{server.url}/metrics").text
        engine.release.set()
        assert a.result().status_code == 200 and b.result().status_code == 200
    first, running = engine.entered[2]
    assert first == 2 and running[1] == 2  # B entered third, next to A's two: A's other six were still waiting
    assert max(r.get(1, 0) for _, r in engine.entered) == 2  # A never had more than its cap generating
    assert f'grpolora_inference_sequences_waiting{{job="{JOB_A}"}} 6.0' in metrics
    assert f'grpolora_inference_sequences_in_flight{{job="{JOB_B}"}} 1.0' in metrics


def test_readiness_waits_for_each_jobs_current_adapter_but_not_for_a_trainer_never_heard_from(tmp_path):
    assert tenant_ready(asked=True, current=False, attached_seconds=1e6, grace=0) is False
    assert tenant_ready(asked=True, current=True, attached_seconds=0, grace=None) is True
    assert tenant_ready(asked=False, current=False, attached_seconds=5, grace=10) is False
    assert tenant_ready(asked=False, current=False, attached_seconds=10, grace=10) is True
    assert tenant_ready(asked=False, current=False, attached_seconds=1e6, grace=None) is False  # a job's own server
    # A replacement replica: its jobs' trainers have not reached it yet, and the grace has not passed.
    with AppThread(pool_app(GatedEngine(), tmp_path / "waiting", grace=3600)[0]) as server:
        assert httpx.get(f"{server.url}/ready").status_code == 503
    # A job attached to a replica already serving, whose trainer has not started (pending pods, a slow download),
    # does not take it out of service, however long the grace.
    app, attachments = pool_app(GatedEngine(), tmp_path / "serving", grace=3600, jobs=())
    with AppThread(app) as server:
        assert httpx.get(f"{server.url}/ready").status_code == 200
        write_attachments(
            attachments.path, Attachments(pool=attachments.pool, jobs=[pool_attachment(JOB_C, TOKENS[JOB_C])])
        )
        wait_for(lambda: JOB_C in httpx.get(f"{server.url}/v1/adapter").json()["jobs"], "C attached")
        assert httpx.get(f"{server.url}/ready").status_code == 200
    # Past the grace, jobs whose trainers never came do not hold it back; one whose trainer asked it to join at
    # version 3 does, until it serves version 3.
    app, _ = pool_app(GatedEngine(), tmp_path / "joined", grace=0)
    with AppThread(app) as server:
        assert httpx.get(f"{server.url}/ready").status_code == 200
        join = JoinRequest(
            epoch=0,
            rank=1,
            world_size=2,
            store_addr="127.0.0.1",
            store_port=free_port(),  # nobody listens: the group never forms
            backend="gloo",
            timeout_seconds=1,
            join_timeout_seconds=1,
            trainer_fingerprint="fp",
            current_version=3,
        )
        assert (
            httpx.post(f"{server.url}/v1/sync/join", json=join.model_dump(), headers=bearer(JOB_B)).status_code == 202
        )
        assert httpx.get(f"{server.url}/ready").status_code == 503
        state_a = httpx.get(f"{server.url}/v1/sync/state", headers=bearer(JOB_A)).json()
        state_b = httpx.get(f"{server.url}/v1/sync/state", headers=bearer(JOB_B)).json()
        assert (state_a["required_version"], state_b["required_version"]) == (0, 3)  # B's join was B's alone


def test_the_attachment_list_is_followed_by_content_and_a_bad_one_keeps_the_last_good(tmp_path):
    engine = GatedEngine()
    app, attachments = pool_app(engine, tmp_path, grace=0, maxJobs=2)
    jobs_file, pool = attachments.path, attachments.pool
    with AppThread(app) as server:

        def served() -> set[str]:
            return set(httpx.get(f"{server.url}/v1/adapter").json()["jobs"])

        def error() -> str | None:
            return httpx.get(f"{server.url}/v1/adapter").json()["attachment_error"]

        assert served() == {JOB_A, JOB_B}
        # Version 1 of each job (as their receivers activate it): two LoRA ids, and no folder written.
        books = {job: attachments.tenants.get(job).book for job in (JOB_A, JOB_B)}
        for job, book in books.items():
            book.activate(1, {"w": torch.full((2,), float(job == JOB_B))}, {"r": 8})
        ids = {job: book.lora_ids() for job, book in books.items()}
        assert ids[JOB_A] != ids[JOB_B] and engine.loras == {*ids[JOB_A], *ids[JOB_B]}
        assert not [path for path in tmp_path.rglob("*") if path.is_file() and path != jobs_file]
        ok = {"prompt_token_ids": [[1, 2]]}
        assert httpx.post(f"{server.url}/v1/generate", json=ok, headers=bearer(JOB_C)).status_code == 401
        for bad, words in (
            ('{"pool": "' + pool + '", "jobs": [{"job": "te', "not a valid attachment list"),  # half written
            ('{"pool": "another", "jobs": []}', "it is the list of pool 'another'"),
            (
                Attachments(pool=pool, jobs=[pool_attachment(j, TOKENS[j]) for j in TOKENS]).to_json(),
                "3 jobs listed, the pool has slots for 2",
            ),
        ):
            jobs_file.write_text(bad)
            wait_for(lambda words=words: words in (error() or ""), words)
            assert served() == {JOB_A, JOB_B}
            assert httpx.post(f"{server.url}/v1/generate", json=ok, headers=bearer(JOB_B)).status_code == 200
        # Replaced (renamed over, as the kubelet swaps a Secret's files): C in, B out.
        write_attachments(
            jobs_file, Attachments(pool=pool, jobs=[pool_attachment(j, TOKENS[j]) for j in (JOB_A, JOB_C)])
        )
        wait_for(lambda: served() == {JOB_A, JOB_C}, "C attached and B detached")
        assert error() is None
        wait_for(lambda: engine.loras == set(ids[JOB_A]), "B's version unloaded")
        assert httpx.post(f"{server.url}/v1/generate", json=ok, headers=bearer(JOB_B)).status_code == 401
        assert httpx.post(f"{server.url}/v1/generate", json=ok, headers=bearer(JOB_C)).status_code == 200


def test_a_job_whose_member_the_worker_refuses_is_left_out_and_the_others_attached(tmp_path):
    """A GPU replica's member worker refuses a tenant that would not fit outside gpuMemoryUtilization
    (member_host.MemberHost, the refusal itself tested in test_sync_members.py): that one job is left out, with the
    worker's reason as the attachment error, and every other job of the list is attached. It is tried again at each
    poll, the list unchanged: the job it replaces may still be leaving (a detached job's member goes in the
    background), and it must not wait for the next change of the list."""
    pool = tiny_cpu_pool(maxJobs=3)
    jobs_file = tmp_path / "jobs.json"
    write_attachments(jobs_file, Attachments(pool=pool.name, jobs=[pool_attachment(j, TOKENS[j]) for j in TOKENS]))
    refused = {JOB_B}

    def receiver(book, key: bytes, job: str) -> AdapterReceiver:
        if job in refused:
            raise RuntimeError(f"the member worker could not attach {job}: job {job} not attached: 1112 MiB ...")
        return AdapterReceiver(book, replica_index=0, fingerprint="fp", key=key, name=job)

    attachments = pool_tenants(GatedEngine(), pool.pool.spec, pool=pool.name, jobs_file=jobs_file, receiver=receiver)
    for _ in range(2):  # refused at each poll while it does not fit
        asyncio.run(attachments.refresh())
        assert {tenant.job for tenant in attachments.tenants} == {JOB_A, JOB_C}
        assert attachments.error == (
            f"{jobs_file}: job {JOB_B} not attached: the member worker could not attach {JOB_B}: job {JOB_B} not "
            "attached: 1112 MiB ..."
        )
    refused.clear()  # the member that held its room has left
    asyncio.run(attachments.refresh())
    assert {tenant.job for tenant in attachments.tenants} == {JOB_A, JOB_B, JOB_C} and attachments.error is None


def test_a_replica_added_by_a_scale_up_is_ready_only_once_the_trainer_sent_it_the_current_adapter(tmp_path):
    """A pool of one replica scaled to two, then back: the new replica starts with the attachment list (its job
    awaited, so not ready); the trainer, started with one endpoint, learns of the new one from the servers (the
    list's endpoints, newest generation first), joins it into its group and sends it the current adapter, and
    only then is it ready. Scaled back down, the trainer leaves it out of its group and its rounds."""
    from grpolora.workers.sync.control import HttpMember
    from grpolora.workers.sync.sender import AdapterSender
    from grpolora.workers.sync.transport import connect_store

    apps = [pool_app(GatedEngine(), tmp_path / f"r{i}", grace=3600, jobs=(JOB_A,), replica_index=i) for i in (0, 1)]
    servers = [AppThread(app) for app, _ in apps]
    urls = [server.url for server in servers]

    def scale(replicas: int, generation: int) -> None:
        for _, attachments in apps:  # what the operator writes beside the attachment list (the pool's Secret)
            listed = PoolReplicas(generation=generation, endpoints=tuple(urls[:replicas]))
            write_attachments(replicas_file(attachments.path), listed)

    def served(url: str) -> int:
        return httpx.get(f"{url}/v1/adapter").json()["jobs"][JOB_A]["live_version"]

    scale(1, generation=1)
    store_port = free_port()
    store = connect_store("127.0.0.1", store_port, is_master=True, timeout_seconds=30)
    sender = AdapterSender(
        [HttpMember(0, urls[0], TOKENS[JOB_A])],
        store=store,
        store_addr="127.0.0.1",
        store_port=store_port,
        backend="gloo",
        timeout_seconds=30,
        join_timeout_seconds=10,
        bucket_bytes=1 << 20,
        fingerprint="fp",
        token=TOKENS[JOB_A],
        member_factory=lambda index, url: HttpMember(index, url, TOKENS[JOB_A]),
    )
    adapter = {"layer.lora_A.weight": torch.ones(8, 16), "layer.lora_B.weight": torch.zeros(16, 8)}
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    with servers[0], servers[1]:
        try:
            sender.form_group()
            sender.send(adapter, config)
            sender.send(adapter, config)
            assert (sender.group, served(urls[0]), served(urls[1])) == ((0,), 2, 0)
            # The new replica is up (the StatefulSet made it), its job's trainer has not reached it: not ready.
            assert httpx.get(f"{urls[1]}/ready").status_code == 503
            sender.refresh()
            assert sender.group == (0,), "the trainer knows only the replicas the servers list"

            scale(2, generation=2)
            wait_for(lambda: httpx.get(f"{urls[0]}/v1/sync/pool", headers=bearer(JOB_A)).json()["generation"] == 2,
                     "the servers read the scaled list")  # fmt: skip
            assert httpx.get(f"{urls[1]}/ready").status_code == 503
            assert sender.refresh() is True
            assert sender.group == (0, 1) and served(urls[1]) == 2, "caught up with the current version"
            assert httpx.get(f"{urls[1]}/ready").status_code == 200
            sender.send(adapter, config)
            assert (served(urls[0]), served(urls[1])) == (3, 3) and sender.serving(3) == (0, 1)

            scale(1, generation=3)
            wait_for(lambda: httpx.get(f"{urls[0]}/v1/sync/pool", headers=bearer(JOB_A)).json()["generation"] == 3,
                     "the servers read the list scaled down")  # fmt: skip
            assert sender.refresh() is True and sender.group == (0,)
            report = sender.send(adapter, config)
            assert report.members == (0,) and (served(urls[0]), served(urls[1])) == (4, 3)
        finally:
            sender.close()  # the servers' receivers close as the apps stop


def test_lora_names_are_unique_per_job_instance_and_version(tmp_path):
    """vLLM 0.32 keys its prefix cache's blocks on the LoRA's name and path (vllm/v1/core/kv_cache_utils.py,
    `_gen_lora_extra_hash_keys`: ("lora", lora_name, lora_path)), its multimodal cache on the name alone
    (vllm/v1/engine/input_processor.py, `_get_mm_identifier`), and tells LoRARequests apart by name alone
    (vllm/lora/request.py, `__eq__`/`__hash__`). A job deleted and re-created under its name starts again at
    version 1 with other weights, and a job attached again may send a version number again (its trainer restored
    from a checkpoint): none may ever carry a name that another attachment's version had, or its prompts could hit
    KV blocks computed under another adapter. The name alone must tell them apart: the folder in the path is no
    part of an adapter activated from memory."""
    from vllm.v1.core.kv_cache_utils import _gen_lora_extra_hash_keys

    engine = GatedEngine()
    _, attachments = pool_app(engine, tmp_path, grace=0, jobs=())
    tenants = [
        attachments._make_tenant(pool_attachment(JOB_A, "token-of-a", uid="uid-first")),
        attachments._make_tenant(pool_attachment(JOB_A, "token-of-a-again", uid="uid-second")),  # re-created
        attachments._make_tenant(pool_attachment(JOB_A, "token-of-a-again", uid="uid-second")),  # attached again
    ]
    try:
        requests = [t.book._lora_request(v, engine.new_lora_id()) for t in tenants for v in (1, 2)]
    finally:
        for tenant in tenants:
            tenant.receiver.close()
    names = [r.lora_name for r in requests]
    assert len(set(names)) == len(names), names
    assert all(name.startswith(f"{JOB_A}@") for name in names)  # still readable in vLLM's logs and LoRA stats
    assert "uid-first" in names[0] and "uid-second" in names[2]  # which instance of the job
    cache_keys = {_gen_lora_extra_hash_keys(SimpleNamespace(lora_request=r))[0] for r in requests}
    assert len(cache_keys) == len(requests)


def test_pool_env_is_read_from_plan_pools_contract_and_names_a_missing_variable(tmp_path):
    pool = tiny_cpu_pool(maxJobs=3)
    environ = pool.env_for(0, jobs_file=str(tmp_path / "jobs.json"))
    assert contract.is_pool_server(environ)
    env = PoolEnv.from_environ(environ)
    assert (env.pool_name, env.spec.lora_slots, env.jobs_file) == ("shared", 6, str(tmp_path / "jobs.json"))
    assert f":{env.port}" in pool.endpoints[0] and env.sync_backend == "gloo"
    with pytest.raises(ContractError, match=contract.POOL_JOBS_FILE):
        PoolEnv.from_environ({k: v for k, v in environ.items() if k != contract.POOL_JOBS_FILE})
    # A pool created by an earlier release (its pod template lists every replica's endpoint, no port of its own).
    earlier = {k: v for k, v in environ.items() if k != contract.HTTP_PORT}
    earlier[contract.INFERENCE_ENDPOINTS] = "http://127.0.0.1:9000,http://127.0.0.1:9001"
    assert PoolEnv.from_environ(earlier | {contract.REPLICA_INDEX: "1"}).port == 9001
    with pytest.raises(ContractError, match=f"{contract.POOL_SPEC} does not hold a valid RolloutPool spec"):
        PoolEnv.from_environ(environ | {contract.POOL_SPEC: '{"maxJobs": 0}'})


# ---- one real pool server, two trainers ---------------------------------------------------------------------------

VLLM = pytest.mark.vllm


@pytest.fixture(scope="module")
def pool_server(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("pool")
    # adapterWaitSeconds: a request for a version not live waits this long (then 409), and readiness waits this
    # long for a job never heard from.
    pool = tiny_cpu_pool(maxJobs=3, adaptersPerJob=2, adapterWaitSeconds=3)
    jobs_file = log_dir / "jobs.json"
    write_attachments(
        jobs_file, Attachments(pool=pool.name, jobs=[pool_attachment(j, TOKENS[j]) for j in (JOB_A, JOB_B)])
    )
    server = PoolServerProcess(pool, 0, log_dir, jobs_file)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("offline:tiny-llama")


@pytest.fixture(scope="module")
def policies(model_dir):
    return {job: peft_policy(model_dir) for job in (JOB_A, JOB_B)}


@pytest.fixture(scope="module")
def senders(pool_server, model_dir):
    made = {
        job: http_sender(
            [pool_server.url],
            TOKENS[job],
            store_port=free_port(),
            model_dir=model_dir,
            timeout_seconds=10,
            bucket_bytes=1 << 20,
        )
        for job in (JOB_A, JOB_B)
    }
    for sender in made.values():
        sender.form_group(wait_for_all_seconds=60)
    yield made
    for sender in made.values():
        sender.close()


def sync_failures(metrics: str, job: str) -> dict[str, float]:
    """grpolora_inference_sync_failures_total of one job on a replica's /metrics, by reason."""
    prefix = f'grpolora_inference_sync_failures_total{{job="{job}",reason="'
    found = {}
    for line in metrics.splitlines():
        if line.startswith(prefix):
            reason, _, value = line[len(prefix) :].partition('"} ')
            found[reason] = float(value)
    return found


def adapter_status(url: str) -> dict:
    # Not httpx's 5 s default: on 2 shared cores a server unloading a detached job's adapters answered later.
    return httpx.get(f"{url}/v1/adapter", timeout=30).json()


def ok_requests(metrics: str, job: str) -> float:
    """grpolora_inference_requests_total of one job's answered requests on a replica's /metrics (0 before any)."""
    found = re.search(rf'^grpolora_inference_requests_total{{job="{job}",status="ok"}} (\S+)$', metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def pushed(job: str, senders, policies, at_least: int) -> int:
    """`job`'s live version, after pushing rounds of its adapter until its trainer has sent version `at_least`: what
    a test needs live it makes live itself, so that it passes alone or in any order, not only after the module's
    first test pushed some."""
    while senders[job].version < at_least:
        randomize_adapter(policies[job], seed=1000 + senders[job].version)
        senders[job].send(lora_tensors(policies[job]), lora_config(policies[job]))
    return senders[job].version


@VLLM
def test_two_jobs_push_at_once_and_each_generates_under_its_own_adapter(pool_server, senders, policies, model_dir):
    url, rounds = pool_server.url, {JOB_A: 2, JOB_B: 3}
    # From wherever the module's other tests left each job (it passes alone or after them).
    start = {job: senders[job].version for job in rounds}
    served_before = {job: ok_requests(httpx.get(f"{url}/metrics").text, job) for job in rounds}
    seen: dict[str, list[int]] = {JOB_A: [], JOB_B: []}
    done = threading.Event()

    def push(job: str) -> int:
        for r in range(rounds[job]):
            randomize_adapter(policies[job], seed=100 * (job == JOB_B) + r)
            senders[job].send(lora_tensors(policies[job]), lora_config(policies[job]))
        return senders[job].version

    def watch() -> None:  # every job's live version, as often as the server answers, while both push
        while not done.is_set():
            for job, status in adapter_status(url)["jobs"].items():
                seen[job].append(status["live_version"])

    with concurrent.futures.ThreadPoolExecutor(3) as threads:
        watcher = threads.submit(watch)
        versions = dict(zip(rounds, threads.map(push, rounds), strict=True))
        done.set()
        watcher.result()
    assert versions == {job: start[job] + n for job, n in rounds.items()}
    for job, live in seen.items():
        assert live == sorted(live), f"{job}'s live version went back: {live}"  # whatever the other job did
    prompt = tokens(model_dir)
    for job, other in ((JOB_A, JOB_B), (JOB_B, JOB_A)):
        wait_own = {"Authorization": f"Bearer {TOKENS[job]}"}
        assert httpx.get(f"{url}/v1/adapter", headers=wait_own).json()["live_version"] == versions[job]
        out = greedy(url, prompt, versions[job], token=TOKENS[job])
        assert out["version"] == versions[job]
        served = torch.tensor(out["logprobs"])
        delta = (hf_logprobs(policies[job], prompt, out["token_ids"]) - served).abs().max().item()
        log.warning("pool parity: %s version %d, max |dlogprob| = %.2e", job, versions[job], delta)
        assert delta <= 1e-3
        assert (hf_logprobs(policies[other], prompt, out["token_ids"]) - served).abs().max().item() > 0.05
    status = adapter_status(url)
    ids = {job: set(status["jobs"][job]["lora_ids"]) for job in (JOB_A, JOB_B)}
    assert ids[JOB_A] and ids[JOB_B] and not ids[JOB_A] & ids[JOB_B]  # version 2 of each: two LoRA ids
    assert ids[JOB_A] | ids[JOB_B] == set(status["engine_lora_ids"])
    assert httpx.get(f"{url}/ready").status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    for job in (JOB_A, JOB_B):
        assert f'grpolora_inference_adapter_version{{job="{job}"}} {versions[job]}.0' in metrics
        assert ok_requests(metrics, job) == served_before[job] + 1


@VLLM
def test_a_job_acts_only_as_itself(pool_server, senders, policies):
    url = pool_server.url
    a = pushed(JOB_A, senders, policies, 1)
    b = pushed(JOB_B, senders, policies, a + 1)
    # A names a version only B has: for A it is a version of its own not (yet) live, never B's adapter.
    response = generate(url, {"prompt_token_ids": [[1, 2]], "adapter_version": b}, token=TOKENS[JOB_A])
    assert response.status_code == 409 and f"adapter version {b} is not live" in response.text
    states = {j: httpx.get(f"{url}/v1/sync/state", headers=bearer(j)).json() for j in (JOB_A, JOB_B)}
    assert (states[JOB_A]["live_version"], states[JOB_B]["live_version"]) == (a, b)
    assert states[JOB_A]["epoch"] == senders[JOB_A].epoch and states[JOB_B]["epoch"] == senders[JOB_B].epoch
    # A token not in the list: refused before its (announced, never sent) body is read.
    head = "POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000"
    answer = raw_request(url, head + f"\r\nAuthorization: Bearer {TOKENS[JOB_C]}", b'{"prompts": [')
    assert answer.startswith("HTTP/1.1 401"), answer[:200]
    assert httpx.get(f"{url}/v1/sync/state", headers=bearer(JOB_C)).status_code == 401


@VLLM
def test_a_round_macd_with_another_jobs_key_is_refused_in_its_group(pool_server, senders, policies, model_dir):
    """A trainer holding B's token for the control calls but MAC-ing with A's key (what a job that learnt B's
    store and port could do with its own key): B's receiver refuses the header, activates nothing."""
    url, b = pool_server.url, senders[JOB_B].version
    # Each job's failures so far (a round of A's or B's may have failed and been retried earlier in this module,
    # e.g. one that outlived its 10 s timeout on a loaded machine): the rogue's attempts add exactly three to B's,
    # none to A's.
    before = httpx.get(f"{url}/metrics").text
    a_failures, b_failures = sync_failures(before, JOB_A), sync_failures(before, JOB_B)
    logged = pool_server.log.read_text()
    b_rounds, macs = logged.count(f"adapter sync of {JOB_B}: round"), logged.count("header MAC does not verify")
    rogue = http_sender(
        [url], TOKENS[JOB_B], store_port=free_port(), model_dir=model_dir, timeout_seconds=3, bucket_bytes=1 << 20
    )
    rogue._key = senders[JOB_A]._key
    try:
        rogue.form_group()
        with pytest.raises(SyncError):
            rogue.send(lora_tensors(policies[JOB_A]), lora_config(policies[JOB_A]))
    finally:
        rogue.close()
    # Each of the rogue's attempts was refused (after the last one it joined B's receiver again, which clears
    # last_error: the count and the log keep them).
    assert httpx.get(f"{url}/v1/sync/state", headers=bearer(JOB_B)).json()["live_version"] == b
    logged = pool_server.log.read_text()
    assert logged.count(f"adapter sync of {JOB_B}: round") - b_rounds == 3
    assert logged.count("header MAC does not verify") - macs == 3
    metrics = httpx.get(f"{url}/metrics").text
    assert sync_failures(metrics, JOB_B) == {**b_failures, "interrupted": b_failures.get("interrupted", 0.0) + 3}
    assert sync_failures(metrics, JOB_A) == a_failures
    # B's own trainer re-forms its group and goes on; A never noticed.
    randomize_adapter(policies[JOB_B], seed=7)
    assert senders[JOB_B].refresh() is True
    report = senders[JOB_B].send(lora_tensors(policies[JOB_B]), lora_config(policies[JOB_B]))
    assert report.members == (0,) and report.version == b + 1
    assert senders[JOB_A].refresh() is False
    prompt = tokens(model_dir)
    out = greedy(url, prompt, None, token=TOKENS[JOB_B])
    assert out["version"] == b + 1
    assert (hf_logprobs(policies[JOB_B], prompt, out["token_ids"]) - torch.tensor(out["logprobs"])).abs().max() <= 1e-3


@VLLM
def test_a_detached_job_is_unloaded_and_refused_and_the_other_goes_on(pool_server, senders, policies, model_dir):
    """Job C, attached for this test alone and then detached (the module's A and B stay attached for the others,
    whatever their order): its adapters unloaded from vLLM, its token and series gone, A served as before."""
    url, jobs_file = pool_server.url, pool_server.jobs_file
    attached = [pool_attachment(j, TOKENS[j]) for j in (JOB_A, JOB_B)]
    write_attachments(jobs_file, Attachments(pool="shared", jobs=[*attached, pool_attachment(JOB_C, TOKENS[JOB_C])]))
    wait_for(lambda: JOB_C in adapter_status(url)["jobs"], "C attached")
    policy = peft_policy(model_dir)
    sender = http_sender(
        [url], TOKENS[JOB_C], store_port=free_port(), model_dir=model_dir, timeout_seconds=10, bucket_bytes=1 << 20
    )
    try:
        sender.form_group(wait_for_all_seconds=60)
        randomize_adapter(policy, seed=11)
        sender.send(lora_tensors(policy), lora_config(policy))
    finally:
        sender.close()
    c_ids = set(adapter_status(url)["jobs"][JOB_C]["lora_ids"])
    assert c_ids
    # Adapters go to vLLM from memory: this server never writes a folder of them.
    assert not list(Path("/dev/shm").glob(f"grpolora-adapters-*-{pool_server.proc.pid}"))
    body = {"prompt_token_ids": [tokens(model_dir)], "max_tokens": 100, "temperature": 1.0, "seed": 3}

    def late_generate() -> httpx.Response:
        # The request thread starts late, as it does on a busy machine: the detach below must wait for the
        # server's own word that the request is in flight, not assume it.
        time.sleep(0.5)
        return generate(url, body, 120.0, TOKENS[JOB_C])

    with concurrent.futures.ThreadPoolExecutor(1) as threads:
        running = threads.submit(late_generate)  # in flight as C is detached
        # Detached only once the request is in (else it is refused 401): in flight, or already answered.
        wait_in_flight(url, JOB_C, unless=running.done)
        write_attachments(jobs_file, Attachments(pool="shared", jobs=attached))
        wait_for(lambda: set(adapter_status(url)["jobs"]) == {JOB_A, JOB_B}, "C detached")
        assert running.result().status_code == 200
    wait_for(lambda: not c_ids & set(adapter_status(url)["engine_lora_ids"]), "C's adapters unloaded from vLLM")
    assert generate(url, {"prompt_token_ids": [[1, 2]]}, token=TOKENS[JOB_C]).status_code == 401
    assert httpx.get(f"{url}/v1/sync/state", headers=bearer(JOB_C)).status_code == 401
    assert f'job="{JOB_C}"' not in httpx.get(f"{url}/metrics").text
    # A is served as before, and its trainer's rounds still land.
    randomize_adapter(policies[JOB_A], seed=9)
    report = senders[JOB_A].send(lora_tensors(policies[JOB_A]), lora_config(policies[JOB_A]))
    prompt = tokens(model_dir)
    out = greedy(url, prompt, report.version, token=TOKENS[JOB_A])
    assert (hf_logprobs(policies[JOB_A], prompt, out["token_ids"]) - torch.tensor(out["logprobs"])).abs().max() <= 1e-3
    assert httpx.get(f"{url}/ready").status_code == 200


def lora_state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def load_lora_state(model, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in state:
                param.copy_(state[name])


@VLLM
def test_two_concurrent_chat_sessions_pinned_to_different_versions_each_get_their_own_versions_tokens(
    pool_server, senders, policies, model_dir
):
    """Issue 48: OpenAI-compatible chat sessions (the `openai` client) on the pool's real vLLM engine. Session `old`
    opens while A's version v is live, session `new` once v + 1 is (the pool keeps adaptersPerJob 2 versions); their
    second calls, made at once, are served each by its own version: every call's logprobs are HF + peft's under that
    version's weights (<= 1e-3) and not under the other's. The second call's prompt continues the first's ids."""
    import openai

    url, policy = pool_server.url, policies[JOB_A]
    weights = {(old := pushed(JOB_A, senders, policies, 1)): lora_state(policy)}

    def chat(session: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{url}/sessions/{session}/v1", api_key=TOKENS[JOB_A], max_retries=0)

    async def call(client: openai.AsyncOpenAI, messages: list[dict]):
        return await client.chat.completions.create(model="a", messages=messages, temperature=0, max_tokens=8)

    async def play() -> dict[str, dict]:
        conversations = {"old": [{"role": "user", "content": "Count from one."}],
                         "new": [{"role": "user", "content": "Name a colour."}]}  # fmt: skip
        clients = {name: chat(f"pinned-{name}") for name in conversations}
        first = {"old": await call(clients["old"], conversations["old"])}
        randomize_adapter(policy, seed=4242)
        report = await asyncio.to_thread(senders[JOB_A].send, lora_tensors(policy), lora_config(policy))
        weights[report.version] = lora_state(policy)
        first["new"] = await call(clients["new"], conversations["new"])
        for name, messages in conversations.items():
            messages += [first[name].choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "user", "content": "More."}]
        await asyncio.gather(*(call(clients[name], conversations[name]) for name in conversations))
        records = {}
        async with httpx.AsyncClient(headers=bearer(JOB_A), timeout=30) as http:
            for name in conversations:
                records[name] = (await http.post(f"{url}/sessions/pinned-{name}/close")).json()
        for client in clients.values():
            await client.close()
        return records

    try:
        records = asyncio.run(play())
        assert {name: r["adapter_version"] for name, r in records.items()} == {"old": old, "new": old + 1}
        for name, own, other in (("old", old, old + 1), ("new", old + 1, old)):
            calls = records[name]["calls"]
            assert len(calls) == 2 and [c["segment"] for c in calls] == [0, 0]
            first, second = calls
            held = first["prompt_token_ids"] + first["completion_token_ids"]
            assert second["prompt_token_ids"][: len(held)] == held  # token in, token out
            for c in calls:
                load_lora_state(policy, weights[own])
                mine = hf_logprobs(policy, c["prompt_token_ids"], c["completion_token_ids"])
                load_lora_state(policy, weights[other])
                theirs = hf_logprobs(policy, c["prompt_token_ids"], c["completion_token_ids"])
                served = torch.tensor(c["logprobs"])
                log.warning("session %s, call under version %d: max |dlogprob| %.2e own, %.2e other's", name, own,
                            (mine - served).abs().max().item(), (theirs - served).abs().max().item())  # fmt: skip
                assert (mine - served).abs().max().item() <= 1e-3
                assert (theirs - served).abs().max().item() > 0.05
    finally:
        load_lora_state(policy, weights[max(weights)])  # the module's policy stays its trainer's newest


def test_the_inference_worker_starts_a_pool_server_from_the_pool_contract(tmp_path):
    """`grpolora worker inference` reads the pool's env when GRPOLORA_POOL_SPEC is set: its slots are the pool's,
    and a broken pool env fails at once naming the variable (exit EX_CONFIG), before any engine starts."""
    import os
    import subprocess
    import sys

    environ = tiny_cpu_pool(maxJobs=3, adaptersPerJob=2).env_for(0, jobs_file=str(tmp_path / "jobs.json"))
    command = [sys.executable, "-P", "-m", "grpolora.cli", "worker", "inference"]
    run = subprocess.run(
        [*command, "--lora-slots=4"], env=os.environ | environ, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2 and "--lora-slots=4 but the RolloutPool's maxJobs x adaptersPerJob is 6" in run.stderr
    del environ[contract.HTTP_PORT]
    run = subprocess.run(command, env=os.environ | environ, capture_output=True, text=True, timeout=120)
    assert run.returncode == contract.EXIT_INVALID_SPEC and contract.HTTP_PORT in run.stderr


DRAINED_SERVER = """
import asyncio, sys
from pathlib import Path

sys.path.append(sys.argv[1])  # the repository's tests, after the standard library (its operator/ must not shadow it)
from grpolora.workers.inference.server import uvicorn_server
from tests.workers.test_pool_server import JOB_A, GatedEngine, pool_app


class SlowEngine(GatedEngine):
    async def generate(self, prompt_token_ids, request, lora):
        await asyncio.sleep(float(sys.argv[4]))  # a long generation: longer than the old 3 s grace
        return await super().generate(prompt_token_ids, request, lora)


app, _ = pool_app(SlowEngine(), Path(sys.argv[2]), grace=0, jobs=(JOB_A,))
uvicorn_server(app, host="127.0.0.1", port=int(sys.argv[3])).run()
"""


def test_a_sigterm_lets_a_generation_in_flight_finish_and_refuses_new_requests(tmp_path):
    """What a scale-down (or a drain) does to a pool's server: the StatefulSet controller deletes the highest
    ordinals, and the kubelet sends their server SIGTERM, then SIGKILL after terminationGracePeriodSeconds. The
    server stops accepting at once (a trainer's next request or join finds it gone and re-forms without it), and a
    generation in flight still completes within the grace."""
    import os
    import signal
    import subprocess
    import sys

    from grpolora.workers.inference.server import DRAIN_SECONDS
    from tests.helpers import ROOT

    generation_seconds = 6.0
    assert 3 < generation_seconds < DRAIN_SECONDS
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", DRAINED_SERVER, str(ROOT), str(tmp_path), str(port), str(generation_seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def up() -> bool:
            try:
                return httpx.get(f"{url}/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                return False

        wait_for(up, "the server", seconds=60)
        with concurrent.futures.ThreadPoolExecutor(1) as threads:
            body = {"prompt_token_ids": [[1, 2, 3]], "max_tokens": 1}
            answer = threads.submit(httpx.post, f"{url}/v1/generate", json=body, headers=bearer(JOB_A), timeout=60)
            wait_in_flight(url, JOB_A, unless=answer.done)
            assert not answer.done(), "answered before the SIGTERM: the test proves nothing"
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)

            def refused() -> bool:
                try:
                    httpx.get(f"{url}/health", timeout=1)
                except httpx.ConnectError:
                    return True
                return False

            wait_for(refused, "the server to stop accepting", seconds=10)
            response = answer.result()
        assert response.status_code == 200, response.text
        assert response.json()["results"][0]["samples"][0]["token_ids"] == [3]
        assert time.monotonic() - sent < DRAIN_SECONDS
        # Shut down cleanly, then ended by the signal it caught (uvicorn raises it again once it has shut down).
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
