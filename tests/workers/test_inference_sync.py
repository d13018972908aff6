"""Two real inference servers (vLLM CPU engines, separate processes) receive adapters from a sender in this
process, round after round, over gloo: parity with HF + peft, swaps under load, refused corruption, a replica
killed mid-round and its replacement, fingerprint mismatch, vLLM's own statistics on /metrics. One pair of engines
serves the whole module (engine starts dominate the suite's time: a check that needs a real engine joins them)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import re
import signal
import socket
import time

import httpx
import pytest
import torch

from grpolora.api.pool import job_key
from grpolora.testing.servers import (
    TOKEN,
    ServerProcess,
    alive,
    cpu_seconds,
    descendants,
    engine_core,
    free_port,
    generate,
    http_sender,
    thread_name,
    tiny_cpu_job,
    wait_in_flight,
)
from grpolora.workers.adapter import lora_config, lora_tensors
from grpolora.workers.inference.member_host import MEMBER_THREAD_NAME
from grpolora.workers.inference.metrics import VLLM_SERIES
from grpolora.workers.models import resolve_model
from grpolora.workers.sync import wire
from grpolora.workers.sync.control import FingerprintMismatch, HttpMember, SyncError
from grpolora.workers.sync.sender import AdapterSender
from grpolora.workers.sync.transport import connect_store
from grpolora.workers.trainer.grpo import token_logprobs
from grpolora.workers.trainer.policy import Policy, build_batch
from grpolora.workers.trainer.rollout import RolloutClient, Sampling, prompt_seed
from tests.workers.parity import (
    greedy,
    hf_logprobs,
    peft_policy,
    randomize_adapter,
    raw_request,
    tokens,
    wait_live,
)

pytestmark = pytest.mark.vllm
log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def job():
    # Small buckets: every round spans several broadcasts, so "mid-round" exists.
    return tiny_cpu_job(inference={"replicas": 2}, sync={"bucketMiB": 1, "timeoutSeconds": 10})


@pytest.fixture(scope="module")
def servers(job, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("inference")
    started: list[ServerProcess] = []
    try:
        started += [ServerProcess(job, i, log_dir) for i in range(2)]
        for server in started:
            server.wait_healthy()
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("offline:tiny-llama")


@pytest.fixture(scope="module")
def policy(model_dir):
    """HF + peft with the same LoRA config as the job; B starts at zero as peft initialises it."""
    return peft_policy(model_dir)


@pytest.fixture(scope="module")
def sender(job, servers, model_dir):
    made = http_sender(
        job.inference_endpoints,
        TOKEN,
        store_port=job.sync.port,
        model_dir=model_dir,
        timeout_seconds=job.sync.timeout_seconds,
        bucket_bytes=job.sync.bucket_bytes,
    )
    made.form_group(wait_for_all_seconds=60)
    yield made
    made.close()


def test_control_endpoints_need_the_token(servers):
    url = servers[0].url
    assert httpx.post(f"{url}/v1/generate", json={"prompts": ["x"]}).status_code == 401
    assert httpx.get(f"{url}/v1/sync/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    assert "grpolora_inference_adapter_version" in httpx.get(f"{url}/metrics").text


def sample(text: str, name: str) -> float | None:
    """The value of the first sample of `name` in a Prometheus text exposition."""
    found = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def test_the_engines_statistics_are_served_beside_ours(servers):
    """vLLM's own statistics beside ours on /metrics: the KV-cache usage, the requests running and waiting, and the
    preemptions, which are what maxNumSeqs and gpuMemoryUtilization are tuned with. vLLM records them only with its
    stats on (`disable_log_stats=False`): its PrometheusStatLogger (vllm/v1/metrics/loggers.py) registers `vllm:*`
    series in prometheus_client's global registry, or a multiprocess one when PROMETHEUS_MULTIPROC_DIR is set
    (vllm/v1/metrics/prometheus.py, get_prometheus_registry). Read from this module's engines (an engine of its
    own cost a minute): the counter is compared with its value before this test's request, whatever others sent."""
    url = servers[0].url
    before = sample(httpx.get(f"{url}/metrics").text, "vllm:generation_tokens_total") or 0
    out = greedy(url, [1, 2, 3, 4], None, max_tokens=8)
    assert len(out["token_ids"]) == 8
    # The engine's logger records each step's stats as its output arrives: wait for this request's tokens.
    deadline = time.monotonic() + 30
    while (sample(text := httpx.get(f"{url}/metrics").text, "vllm:generation_tokens_total") or 0) < before + 8:
        assert time.monotonic() < deadline, text[-3000:]
        time.sleep(0.2)
    for name in VLLM_SERIES:
        assert sample(text, name) is not None, f"{name} missing from /metrics"
    assert 0 <= sample(text, "vllm:kv_cache_usage_perc") <= 1
    assert "grpolora_inference_generated_tokens_total" in text  # ours, as before
    # One exposition: every family once (a scraper refuses a repeated HELP/TYPE).
    families = re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE)
    assert len(families) == len(set(families))


def test_an_idle_replicas_engine_processes_leave_the_cores_alone(servers):
    """After a request, vLLM's worker and engine-core processes soon wait without spinning (vllm_plugin: on CPUs
    their message-queue readers busy-loop 0.1 s after a message, not vLLM's 1 s): in the second after a generation
    returns, the replica's vLLM processes use a small fraction of a core (0.89 s of it before)."""
    server = servers[0]
    engines = [pid for pid in descendants(server.proc.pid) if alive(pid)]
    assert engines  # EngineCore and its worker
    assert greedy(server.url, [1, 2, 3], None)["token_ids"]  # every process has just read a message
    before = {pid: cpu_seconds(pid) for pid in engines}
    time.sleep(1.0)
    used = {pid: cpu_seconds(pid) - before[pid] for pid in engines}
    assert sum(used.values()) < 0.3, f"CPU seconds in the idle second after a request, by process: {used}"


def test_unauthenticated_requests_are_refused_before_their_body_is_read(servers):
    # Headers announce 10 MB that never come: the server must answer without waiting for them.
    head = "POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000"
    answer = raw_request(servers[0].url, head, b'{"prompts": [')
    assert answer.startswith("HTTP/1.1 401"), answer[:200]


def test_a_body_over_the_limit_is_413_before_it_is_read(servers):
    head = (
        "POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Length: {50 << 20}"
    )
    answer = raw_request(servers[0].url, head, b'{"prompts": [')
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    # Without a Content-Length (chunked), the count is kept as the body arrives.
    host, port = servers[0].url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        chunk = b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n"
        with contextlib.suppress(OSError):  # the server may close the connection once it has answered
            for _ in range(40):
                conn.sendall(chunk)
        answer = conn.recv(65536).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 413"), answer[:200]


BAD_REQUESTS = [
    ({"prompts": [""]}, 422, "prompts"),
    ({"prompts": []}, 422, "prompts"),
    ({"prompt_token_ids": [[]]}, 422, "prompt_token_ids"),
    ({"prompt_token_ids": [[1, 2, 10**9]]}, 400, "out of vocabulary"),
    ({"prompt_token_ids": [[1, -5]]}, 400, "out of vocabulary"),
    ({"prompt_token_ids": [[1, 2]], "seed": 2**64 + 1}, 422, "seed"),
    ({"prompt_token_ids": [[1, 2]], "stop_token_ids": [2**70]}, 400, "stop_token_ids"),
    ({"prompt_token_ids": [[1]] * 5000}, 422, "prompt_token_ids"),
    # vLLM's own check (not repeated here): its reason comes back with a 400.
    ({"prompt_token_ids": [[1, 2]], "n": 10**6}, 400, "n must be at most 16384"),
    ({"prompt_token_ids": [[1, 2]], "max_tokens": 10_000}, 400, "max_tokens 10000 exceeds the model length 256"),
    ({"prompt_token_ids": [[1] * 256]}, 400, "prompt 0 has 256 tokens"),
    ({"prompt_token_ids": [[1, 2]], "temperature": "NaN"}, 422, "temperature"),
]


@pytest.mark.parametrize(("body", "status", "words"), BAD_REQUESTS, ids=[w for _, _, w in BAD_REQUESTS])
def test_client_errors_are_4xx_with_the_reason(servers, body, status, words):
    response = generate(servers[0].url, body)
    assert response.status_code == status, response.text[:300]
    assert words in response.text
    assert generate(servers[0].url, {"prompt_token_ids": [[1, 2]], "max_tokens": 2}).status_code == 200


def test_synced_adapter_serves_with_logprob_parity(servers, sender, policy, model_dir):
    prompt = tokens(model_dir)
    randomize_adapter(policy, seed=1)
    report = sender.send(lora_tensors(policy), lora_config(policy))
    assert report.members == (0, 1) and not report.refused
    for server in servers:
        out = greedy(server.url, prompt, report.version)
        assert out["version"] == report.version
        expected = hf_logprobs(policy, prompt, out["token_ids"])
        delta = (expected - torch.tensor(out["logprobs"])).abs().max().item()
        log.warning("parity: replica %d, version %d, max |dlogprob| = %.2e", server.index, report.version, delta)
        assert delta <= 1e-3
        # Greedy tokens are the trainer's argmax too, and the adapter really changed the output distribution.
        ids = torch.tensor([prompt + out["token_ids"]])
        with torch.no_grad():
            argmax = policy(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        assert argmax == out["token_ids"]
        base = hf_logprobs(policy, prompt, out["token_ids"], adapter=False)
        assert (base - expected).abs().max().item() > 0.05
    assert httpx.get(f"{servers[0].url}/ready").status_code == 200


def test_vllms_worker_and_the_sync_members_threads_may_use_every_cpu_of_the_replica(servers, sender):
    """vLLM's "auto" binding pins a CPU worker's OpenMP threads one per core from the first core of the NUMA node
    (`OMP_PROC_BIND`, vllm/utils/ompmultiprocessing.py), as if the engine had the machine to itself, and a thread
    inherits the CPUs of the thread that starts it. So both replicas' workers ran their main thread on core 0,
    and so did the sync member started from it, its receiver and gloo's threads: a round waited ~140 ms on one
    core while the other idled. The servers leave vLLM's threads unbound on CPUs (cpu_engine_env), and the
    member's threads (named MEMBER_THREAD_NAME; gloo's are started by them) take the server's CPUs in any case,
    should a user bind vLLM's threads."""
    for server in servers:
        allowed = os.sched_getaffinity(server.proc.pid)
        workers = [pid for pid in descendants(server.proc.pid) if thread_name(pid, pid) == "VLLM::Worker"]
        assert len(workers) == 1, workers
        assert os.sched_getaffinity(workers[0]) == allowed, f"replica {server.index}: vLLM's worker is bound"
        tasks = [int(t) for t in os.listdir(f"/proc/{workers[0]}/task")]
        members = [t for t in tasks if thread_name(workers[0], t) == MEMBER_THREAD_NAME]
        # The host, and per job its control and receiver threads.
        assert len(members) >= 3, f"replica {server.index}: member threads {members} among {len(tasks)}"
        pinned = {t: os.sched_getaffinity(t) for t in members if os.sched_getaffinity(t) != allowed}
        assert not pinned, f"replica {server.index}: member threads on fewer CPUs than {sorted(allowed)}: {pinned}"


def test_requests_racing_a_swap_complete_each_on_one_version(servers, sender, policy, model_dir):
    prompt = tokens(model_dir)
    randomize_adapter(policy, seed=2)
    before = sender.send(lora_tensors(policy), lora_config(policy)).version
    for server in servers:  # send() returns once verified; activation follows on each replica
        wait_live(server.url, before)
    old_state = {k: v.clone() for k, v in policy.state_dict().items() if "lora_" in k}
    body = {"prompt_token_ids": [prompt], "n": 2, "temperature": 1.0, "max_tokens": 24, "seed": 7}
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(generate, servers[i % 2].url, body) for i in range(8)]
        randomize_adapter(policy, seed=3)
        after = sender.send(lora_tensors(policy), lora_config(policy)).version
        for server in servers:
            wait_live(server.url, after)
        futures += [pool.submit(generate, servers[i % 2].url, body) for i in range(4)]
        responses = [f.result() for f in futures]
    new_state = {k: v.clone() for k, v in policy.state_dict().items() if "lora_" in k}
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    versions = [r.json()["adapter_version"] for r in responses]
    assert set(versions) <= {before, after} and versions[-4:] == [after] * 4
    for response in responses:  # every sample's logprobs belong wholly to the version the response names
        version = response.json()["adapter_version"]
        policy.load_state_dict(old_state if version == before else new_state, strict=False)
        for sample in response.json()["results"][0]["samples"]:
            expected = hf_logprobs(policy, prompt, sample["token_ids"])
            assert (expected - torch.tensor(sample["logprobs"])).abs().max().item() <= 1e-3
    policy.load_state_dict(new_state, strict=False)


def compared_logprobs(trainer: Policy, prompt: list[int], samples: list[dict], **baseline) -> tuple[torch.Tensor, ...]:
    """Over the completion tokens of vLLM's `samples`: the trainer's logprobs (Policy.logprobs, at the spec's
    sampling settings), vLLM's own, and the trainer's under `baseline` settings (what a setting left out would
    give)."""
    batch = build_batch(
        [(prompt, s["token_ids"], s["logprobs"]) for s in samples], [0.0] * len(samples), trainer.tokenizer.pad_token_id
    )
    keep = batch.completion_mask.bool()
    with torch.no_grad():
        ours = trainer.logprobs(batch)[keep]
        logits = trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        other = token_logprobs(logits, batch.input_ids[:, 1:], **baseline)[keep]
    return ours, batch.behaviour_logprobs[keep], other


def test_trainer_logprobs_match_vllms_at_temperature_and_top_p(job, servers, sender, model_dir):
    """With topP < 1 vLLM samples from, and reports logprobs of, the nucleus renormalised: the trainer's
    Policy.logprobs must describe that same distribution, or every importance ratio is biased."""
    spec = job.job.spec
    spec = spec.model_copy(update={"grpo": spec.grpo.model_copy(update={"temperature": 0.7, "top_p": 0.9})})
    trainer = Policy(model_dir, spec, device=torch.device("cpu"))
    randomize_adapter(trainer.model, seed=5)
    report = sender.send(lora_tensors(trainer.model), lora_config(trainer.model))
    prompt = tokens(model_dir)
    body = {"prompt_token_ids": [prompt], "n": 8, "temperature": 0.7, "top_p": 0.9, "max_tokens": 24, "seed": 11}
    response = generate(servers[0].url, body | {"adapter_version": report.version})
    assert response.status_code == 200, response.text
    samples = response.json()["results"][0]["samples"]
    ours, vllm, full_softmax = compared_logprobs(trainer, prompt, samples, temperature=0.7)
    delta = (ours - vllm).abs().max().item()
    log.warning("top-p parity: %d tokens, max |dlogprob| = %.2e", len(ours), delta)
    assert delta <= 1e-3
    # The nucleus really truncated something: over the full softmax the trainer's logprobs would be lower by
    # -ln(mass kept), far beyond the parity above, at the tokens whose nucleus left out a real share of the mass.
    bias = vllm - full_softmax
    log.warning("top-p: the full softmax would be off by up to %.2e", bias.max().item())
    assert bias.min().item() > -1e-3 and bias.max().item() > 0.05


def test_trainer_logprobs_match_vllms_with_top_k_and_stop_strings_end_completions(job, servers, sender, model_dir):
    """grpo.topK: vLLM keeps the k most likely tokens (ties kept) before the nucleus; the trainer's logprobs must
    describe that distribution too. grpo.stop: a seeded completion, asked again with a stop string taken from its
    own text, ends before that string (the same tokens up to there, finish reason `stop`)."""
    spec = job.job.spec
    grpo = spec.grpo.model_copy(update={"temperature": 0.7, "top_p": 0.9, "top_k": 5})
    trainer = Policy(model_dir, spec.model_copy(update={"grpo": grpo}), device=torch.device("cpu"))
    randomize_adapter(trainer.model, seed=6)
    report = sender.send(lora_tensors(trainer.model), lora_config(trainer.model))
    prompt = tokens(model_dir)
    body = {"prompt_token_ids": [prompt], "n": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 24,
            "seed": 12, "adapter_version": report.version}  # fmt: skip
    response = generate(servers[0].url, body)
    assert response.status_code == 200, response.text
    samples = response.json()["results"][0]["samples"]
    ours, vllm, nucleus_only = compared_logprobs(trainer, prompt, samples, temperature=0.7, top_p=0.9)
    delta = (ours - vllm).abs().max().item()
    log.warning("top-k parity: %d tokens, max |dlogprob| = %.2e", len(ours), delta)
    assert delta <= 1e-3
    assert (vllm - nucleus_only).max().item() > 0.05  # top-k cut more than the nucleus alone would have
    # Stop strings: a stretch from the middle of a sample's own text ends the same seeded sample there.
    one = body | {"n": 1, "top_k": 0, "top_p": 1.0}
    full = generate(servers[0].url, one).json()["results"][0]["samples"][0]
    text = full["text"]
    assert len(text) > 12, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = generate(servers[0].url, one | {"stop": [stop]}).json()["results"][0]["samples"][0]
    assert stopped["finish_reason"] == "stop"
    assert text.startswith(stopped["text"]) and stop not in stopped["text"]
    assert stopped["token_ids"] == full["token_ids"][: len(stopped["token_ids"])]


def test_replicas_score_the_reference_the_trainer_would_compute(job, servers, sender, model_dir):
    """grpo.referenceFrom: inference: with each rollout the replica returns the sampled tokens' logprobs under the
    base model (adapter off), which must be what the trainer's own reference pass gives, within the parity bound.

    A long generation on the adapter runs on the same replica meanwhile, so the scoring shares vLLM batches with
    requests on another adapter: vLLM 0.32's CPU LoRA path killed the engine there (the grpolora vLLM plugin's
    add_lora_logits)."""
    trainer = Policy(model_dir, job.job.spec, device=torch.device("cpu"))
    randomize_adapter(trainer.model, seed=6)
    report = sender.send(lora_tensors(trainer.model), lora_config(trainer.model))
    for server in servers:
        wait_live(server.url, report.version)
    client = RolloutClient(job.inference_endpoints, TOKEN, timeout_seconds=120)
    prompts = [tokens(model_dir), tokens(model_dir)[1:]]
    sampling = Sampling(n=4, temperature=1.0, top_p=1.0, max_tokens=24, reference_logprobs=True)
    long = {"prompt_token_ids": [prompts[0]], "n": 4, "max_tokens": 200, "seed": 5, "adapter_version": report.version}
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            busy = pool.submit(generate, servers[0].url, long)
            # The scoring must share batches with it: wait for the server's word that it is generating.
            wait_in_flight(servers[0].url, job_key(job.job.namespace, job.job.name), sequences=4, unless=busy.done)
            groups = client.generate(prompts, sampling, version=report.version, replicas=[0], seeds=[21, 22])
            assert busy.result().status_code == 200
    finally:
        client.close()
    completions = [(p, c) for p, group in zip(prompts, groups, strict=True) for c in group]
    assert all(len(c.reference_logprobs) == len(c.token_ids) for _, c in completions)
    batch = build_batch(
        [(p, c.token_ids, c.logprobs) for p, c in completions],
        [0.0] * len(completions),
        trainer.tokenizer.pad_token_id,
        [c.reference_logprobs for _, c in completions],
    )
    keep = batch.completion_mask.bool()
    with torch.no_grad(), trainer.reference():
        ours = trainer.logprobs(batch)[keep]
    delta = (ours - batch.reference_logprobs[keep]).abs().max().item()
    log.warning("reference parity: %d tokens, max |dlogprob| = %.2e", int(keep.sum()), delta)
    assert delta <= 1e-3
    # The samples came from the adapter, the reference from the base model: they really differ.
    assert (batch.behaviour_logprobs[keep] - batch.reference_logprobs[keep]).abs().max().item() > 0.05
    # A sequence that would leave vLLM no room for the one token it must generate to score is refused up front.
    body = {"prompt_token_ids": [[1] * 200], "max_tokens": 56, "reference_logprobs": True}
    response = generate(servers[0].url, body)
    assert response.status_code == 400 and "must stay below the model length 256" in response.text


def test_seeded_rollouts_repeat_token_for_token(job, servers, sender, model_dir):
    """The trainer's per-prompt seeds (from grpo.seed and the prompt's place in the stream) make a rollout
    repeatable: the same request twice gives the same tokens; the same prompt at another place gets others."""
    client = RolloutClient(job.inference_endpoints, TOKEN, timeout_seconds=120)
    prompt = tokens(model_dir)
    sampling = Sampling(n=3, temperature=1.0, top_p=0.95, max_tokens=16)
    seeds = [prompt_seed(7, 0), prompt_seed(7, 1)]
    try:
        runs = [
            client.generate([prompt, prompt], sampling, version=sender.version, replicas=[0], seeds=seeds)
            for _ in range(2)
        ]
    finally:
        client.close()
    first, again = ([[c.token_ids for c in group] for group in run] for run in runs)
    assert first == again
    assert first[0] != first[1]
    assert len({tuple(t) for t in first[0]}) > 1  # the n samples of one prompt differ too (seed, seed + 1, ...)


def test_a_seeded_round_larger_than_one_prefill_step_is_served(job, servers, sender, model_dir):
    """vLLM 0.32's CPU engine died ("CPU Generator does not use offset") when a round of seeded requests was more than
    one step's prefill budget (2048 tokens) and a prompt got prefilled in chunks: it rewinds a seeded generator for
    the token a partial prefill discards, which a CPU generator cannot. A quickstart-sized job (8 prompts x 8 of the
    chat template's ~60 tokens) is such a round; CPU engines therefore prefill whole prompts."""
    client = RolloutClient(job.inference_endpoints, TOKEN, timeout_seconds=120)
    base = (tokens(model_dir) * 40)[:200]
    # 16 different prompts of 200 tokens: 3,200 prefill tokens (a prompt's n samples share its prefix cache).
    prompts = [base[i:] + base[:i] for i in range(16)]
    sampling = Sampling(n=4, temperature=1.0, top_p=1.0, max_tokens=4)
    try:
        groups = client.generate(
            prompts, sampling, version=sender.version, replicas=[0], seeds=[prompt_seed(3, i) for i in range(16)]
        )
    finally:
        client.close()
    assert [len(group) for group in groups] == [4] * 16
    assert all(len(c.token_ids) == 4 for group in groups for c in group)


def test_a_corrupted_round_is_refused_and_the_old_version_keeps_serving(servers, sender, policy, monkeypatch):
    live = sender.version
    real_pack = wire.pack

    def corrupting_pack(*args, **kwargs):
        header, buckets = real_pack(*args, **kwargs)
        buckets[-1][-1] ^= 0x5A
        return header, buckets

    monkeypatch.setattr(wire, "pack", corrupting_pack)
    with pytest.raises(SyncError, match="every replica refused"):
        sender.send(lora_tensors(policy), lora_config(policy))
    monkeypatch.setattr(wire, "pack", real_pack)
    for server in servers:
        assert httpx.get(f"{server.url}/v1/adapter").json()["live_version"] == live
        assert greedy(server.url, [1, 2, 3], None)["version"] == live
        state = httpx.get(f"{server.url}/v1/sync/state", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert "payload MAC does not verify" in state["last_error"]
        refused = 'grpolora_inference_sync_failures_total{job="team-a/demo",reason="refused"} 1.0'
        assert refused in httpx.get(f"{server.url}/metrics").text


def test_fingerprint_mismatch_is_refused_with_both_named(job, servers):
    store = connect_store("127.0.0.1", free_port(), is_master=True, timeout_seconds=5)
    members = [HttpMember(i, url, TOKEN) for i, url in enumerate(job.inference_endpoints)]
    wrong = AdapterSender(
        members,
        store=store,
        store_addr="127.0.0.1",
        store_port=0,
        backend="gloo",
        timeout_seconds=5,
        join_timeout_seconds=5,
        bucket_bytes=1 << 20,
        fingerprint="0" * 64,
        token=TOKEN,
    )
    with pytest.raises(FingerprintMismatch, match=f"the trainer loaded {'0' * 64}, inference replica 0 loaded"):
        wrong.form_group()
    wrong.close()


def test_a_replica_killed_mid_round_is_dropped_then_its_replacement_catches_up(
    job, servers, sender, policy, model_dir, tmp_path_factory
):
    victim = servers[1]
    epoch = sender.epoch

    def kill_after_first_bucket(index: int) -> None:
        if index == 0 and victim.proc.poll() is None:
            victim.kill()

    randomize_adapter(policy, seed=4)
    sender._on_bucket_sent = kill_after_first_bucket
    try:
        report = sender.send(lora_tensors(policy), lora_config(policy))
    finally:
        sender._on_bucket_sent = None
    assert report.members == (0,) and report.epoch > epoch and report.attempts >= 2
    prompt = tokens(model_dir)
    out = greedy(servers[0].url, prompt, report.version)
    assert (hf_logprobs(policy, prompt, out["token_ids"]) - torch.tensor(out["logprobs"])).abs().max() <= 1e-3

    replacement = ServerProcess(job, 1, tmp_path_factory.mktemp("replacement"))
    servers[1] = replacement  # the module fixture stops it
    replacement.wait_healthy()
    assert httpx.get(f"{replacement.url}/ready").status_code == 503  # not before it has the adapter
    assert sender.refresh() is True
    assert sender.group == (0, 1)
    out = greedy(replacement.url, prompt, report.version)
    assert (hf_logprobs(policy, prompt, out["token_ids"]) - torch.tensor(out["logprobs"])).abs().max() <= 1e-3
    assert httpx.get(f"{replacement.url}/ready").status_code == 200
    report = sender.send(lora_tensors(policy), lora_config(policy))
    assert report.members == (0, 1)


def test_a_server_whose_engine_core_is_sigkilled_exits_non_zero_and_the_group_goes_on_without_it(
    servers, sender, policy
):
    """The EngineCore killed (an OOM kill, a CUDA error, a fault of the sync member in its process): the HTTP process
    must die too (exit 1: the kubelet or `grpolora run` starts a new one), never live on NotReady for good, and the
    trainer's next round goes on without the replica. The launcher's restart of it: test_local_run.py."""
    victim = servers[1]
    os.kill(engine_core(victim.proc.pid), signal.SIGKILL)
    assert victim.proc.wait(60) == 1, victim.log.read_text()[-3000:]
    assert "vLLM's engine died" in victim.log.read_text()
    randomize_adapter(policy, seed=6)
    report = sender.send(lora_tensors(policy), lora_config(policy))
    assert report.members == (0,) and sender.group == (0,)


def test_engine_processes_die_with_their_server(servers):
    """The server process alone killed (as the OOM killer does): vLLM's engine processes must not live on."""
    victim = servers[0]
    engine = descendants(victim.proc.pid)
    assert engine, "the inference server has no engine processes"
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(30)
    deadline = time.monotonic() + 5
    while [p for p in engine if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in engine if alive(p)], "vLLM's engine processes outlived their server"
