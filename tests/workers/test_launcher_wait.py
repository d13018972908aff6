"""How `grpolora run` reads its workers' exits and, on a RolloutPool, attaches and detaches jobs, without starting
any worker: exit codes come from a script, one poll at a time; everything else (plans, ports, the attachment list
in the run folder, status.json) is the launcher's own.

A follower trainer rank leaves as soon as the final collective is done, while rank 0 still writes the final
adapter: that is the run ending, not a failure."""

from __future__ import annotations

import http.server
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from grpolora.api import contract
from grpolora.api.load import parse_job
from grpolora.api.pool import Attachments, auth_digest, sync_key
from grpolora.api.spec import RolloutPool
from grpolora.api.status import TrainerStatus
from grpolora.workers.launcher import liveness, local
from grpolora.workers.launcher.local import LocalRun, RunFailed, Worker, _Live
from tests.helpers import job_doc

MODEL = {"name": "offline:tiny-llama", "dtype": "float32"}


class ScriptedRun(LocalRun):
    """Workers are not started: each poll's exit codes come from the script, a dict from `<job> <role> <index>` to
    an exit code (a worker not named is still running). What the attachment list held when each trainer was
    started is kept in `started`."""

    def __init__(self, tmp_path: Path, jobs, polls, pool: RolloutPool | None = None):
        super().__init__(jobs, tmp_path, pool=pool, ray_address=None, show_progress=True)
        self._polls = iter(polls)
        self.started: list[tuple[str, list[str]]] = []

    def _init_ray(self) -> None:
        pass

    def _launch(self, worker: Worker, env: dict[str, str]) -> _Live:
        attached = Attachments.from_json(self.jobs_file.read_text()).jobs if self.pool else []
        self.started.append((f"{worker.job} {worker.role} {worker.index}", [a.job for a in attached]))
        live = _Live(worker, env, actor=None)
        self._live.append(live)
        return live

    def _stop_workers(self, lives) -> None:
        for live in lives:
            self._live.remove(live)

    def _exit_codes(self):
        script = next(self._polls)
        return [script.get(f"{live.worker.job} {live.worker.role} {live.worker.index}") for live in self._live]


def test_a_follower_rank_that_finished_first_is_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "POLL_SECONDS", 0.01)
    job = parse_job(job_doc(trainer={"replicas": 2, "gpusPerReplica": 0}, inference={"gpusPerReplica": 0}))
    run = ScriptedRun(tmp_path, [job], [{}, {"demo trainer 1": 0}, {"demo trainer 1": 0}, {"demo trainer 0": 0}])
    run.start()
    run.wait()  # returns once trainer 0 is done; raised RunFailed("trainer 1 exited with code 0") before
    assert [j.state for j in run.jobs] == ["succeeded"]


def test_an_inference_replica_with_a_spec_error_is_not_restarted(tmp_path, monkeypatch):
    """Exit 78 (EX_CONFIG: a model that is not there, a token that cannot read it) is met again by every restart:
    the run stops at once with the replica's own words, as the trainer's 78 ends its job. (Restarted three times,
    each start a Ray actor and a process, it held the end of a run with a mistyped model for seconds.)"""
    monkeypatch.setattr(local, "POLL_SECONDS", 0.01)
    job = parse_job(job_doc(trainer={"gpusPerReplica": 0}, inference={"gpusPerReplica": 0}))
    run = ScriptedRun(tmp_path, [job], [{}, {"demo inference 0": contract.EXIT_INVALID_SPEC}, {}, {}])
    run.start()
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / "inference-0.log").write_text(
        "ERROR inference server\nTraceback ...\nModelUnavailable: spec.model.name: model path /x does not exist\n"
        "INFO:     Shutting down\n"
    )
    with pytest.raises(RunFailed) as failed:
        run.wait()
    # Its words first (status.json keeps the message's first lines), then the end of its log.
    assert str(failed.value).startswith(
        "inference 0 exited with code 78: a spec error, not restarted: spec.model.name: model path /x does not exist;"
    )
    assert [name for name, _ in run.started].count("demo inference 0") == 1  # never started again
    assert run.inference_restarts == 0


def pool(**spec) -> RolloutPool:
    return RolloutPool.model_validate(
        {
            "apiVersion": "grpolora.dev/v1alpha1",
            "kind": "RolloutPool",
            "metadata": {"name": "shared", "namespace": "team-a"},
            "spec": {"model": MODEL, "replicas": 1, "gpusPerReplica": 0, **spec},
        }
    )


def pool_job(name: str, **spec):
    doc = job_doc(model=MODEL, inference={"poolRef": {"name": "shared"}}, trainer={"gpusPerReplica": 0}, **spec)
    doc["metadata"]["name"] = name
    return parse_job(doc)


def test_a_pool_attaches_up_to_max_jobs_and_the_next_in_line_when_one_ends(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(local, "POLL_SECONDS", 0.01)
    jobs = [pool_job("a"), pool_job("b"), pool_job("c")]
    script = [{}, {"a trainer 0": 0}, {}, {"b trainer 0": 1}, {}, {"c trainer 0": 0}]
    run = ScriptedRun(tmp_path, jobs, script, pool=pool(maxJobs=2))
    (tmp_path / "b" / "logs").mkdir(parents=True)
    (tmp_path / "b" / "logs" / "trainer-0.log").write_text("Traceback ...\nValueError: the reward plugin broke\n")
    run.start()
    # The servers start with the first two jobs' entries; each trainer only once its own entry is in the list.
    assert [name for name, _ in run.started] == ["shared-pool inference 0", "a trainer 0", "b trainer 0"]
    assert all(held == ["team-a/a", "team-a/b"] for _, held in run.started)
    run.wait()
    names = [name for name, _ in run.started]
    assert names == ["shared-pool inference 0", "a trainer 0", "b trainer 0", "c trainer 0"]
    assert run.started[-1][1] == ["team-a/b", "team-a/c"]  # a detached when it ended; c attached before it started
    assert Attachments.from_json(run.jobs_file.read_text()).jobs == []  # every job detached at its end
    assert [j.state for j in run.jobs] == ["succeeded", "failed", "succeeded"]
    err = capsys.readouterr().err
    assert "c: waiting for a slot of RolloutPool shared (2 of 2 jobs attached); place 1 in line" in err
    assert "c: attached to RolloutPool shared (2 of 2 jobs); starting its trainer" in err
    assert "b: trainer 0 exited with code 1" in err and "the reward plugin broke" in err
    failed = TrainerStatus.model_validate_json((tmp_path / "b" / "status.json").read_text())
    assert failed.phase == "Failed" and "trainer 0 exited with code 1" in (failed.message or "")


def test_the_attachment_list_holds_each_jobs_digest_and_sync_key_never_its_token(tmp_path):
    jobs = [pool_job("a", grpo={"maxStaleness": 1}), pool_job("b")]
    run = ScriptedRun(tmp_path, jobs, [], pool=pool())
    run.start()
    text = run.jobs_file.read_text()
    entries = Attachments.from_json(text).jobs
    assert [(e.job, e.kept_versions) for e in entries] == [("team-a/a", 2), ("team-a/b", 1)]
    for job, entry in zip(run.jobs, entries, strict=True):
        assert job.token not in text
        assert entry.auth == auth_digest(job.token) and entry.sync_key == sync_key(job.token).hex()
        assert entry.uid == job.uid
    assert run.jobs_file.stat().st_mode & 0o077 == 0  # it holds the sync keys: the user's alone
    assert not list(tmp_path.glob(".*partial"))  # written aside, then renamed over the list


def test_each_job_on_a_pool_trains_in_its_own_folder_against_the_pools_servers(tmp_path):
    run = ScriptedRun(tmp_path, [pool_job("a"), pool_job("b")], [], pool=pool(replicas=2))
    run.start()
    server_ports = [int(e.rsplit(":", 1)[1]) for e in run.pool_plan.endpoints]
    assert server_ports[1] == server_ports[0] + 1  # consecutive, as LoopbackNetwork addresses replica i
    envs = {f"{live.worker.job} {live.worker.role} {live.worker.index}": live.env for live in run._live}
    assert set(envs) == {"shared-pool inference 0", "shared-pool inference 1", "a trainer 0", "b trainer 0"}
    assert envs["shared-pool inference 1"]["GRPOLORA_POOL_JOBS_FILE"] == str(run.jobs_file.resolve())
    for name in ("a", "b"):
        env = envs[f"{name} trainer 0"]
        assert env["GRPOLORA_INFERENCE_ENDPOINTS"] == ",".join(run.pool_plan.endpoints)
        assert env["GRPOLORA_OUTPUT_DIR"] == str((tmp_path / name).resolve())
        assert env["GRPOLORA_CHECKPOINT_DIR"] == str((tmp_path / name / "checkpoints").resolve())
        assert env["GRPOLORA_SYNC_WORLD_SIZE"] == "3"  # trainer rank 0 and both pool replicas
    # Each job its own ports: two trainers on one machine.
    names = (contract.MASTER_PORT, contract.SYNC_PORT, contract.STATUS_PORT)
    ports = [envs[f"{n} trainer 0"][name] for n in "ab" for name in names]
    assert len(set(ports)) == 6


def test_two_jobs_on_a_pool_share_the_cores_between_their_trainers(tmp_path, monkeypatch):
    monkeypatch.setattr(local.os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run = ScriptedRun(tmp_path, [pool_job("a"), pool_job("b")], [], pool=pool())
    run.start()
    threads = {f"{live.worker.job} {live.worker.role}": live.env["OMP_NUM_THREADS"] for live in run._live}
    # Their training phases overlap (one trains while the server generates for the other): a core each. The
    # server generates for both, batched: both cores, as a job's own server has them.
    assert threads == {"shared-pool inference": "2", "a trainer": "1", "b trainer": "1"}
    alone = ScriptedRun(tmp_path / "alone", [parse_job(job_doc(inference={"gpusPerReplica": 0}))], [])
    alone.start()
    assert {live.worker.role: live.env["OMP_NUM_THREADS"] for live in alone._live} == {"inference": "2", "trainer": "2"}


class ScriptedHealth:
    """A server's GET /health on loopback, answering the statuses of `script` in turn (then its last one for good),
    as a real inference server does: 503 while its engine starts, 200 once it serves, 500 once its engine is hung
    (app.EngineProbe)."""

    def __init__(self, port: int, script: list[int]):
        self.script, self.answered = list(script), []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler) -> None:
                status = self.script.pop(0) if len(self.script) > 1 else self.script[0]
                self.answered.append(status)
                body = b"ok" if status == 200 else b"failed: vLLM's engine has not answered a round trip"
                handler.send_response(status)
                handler.send_header("Content-Length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)

            def log_message(self, *_) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    ("script", "replaced"),
    [
        ([503, 503, 200, 500, 500, 500], True),  # started, then hung: three failures in a row
        ([503, 503, 500, 500, 500], True),  # hung right after its start, before any probe saw it well
        ([503, 503, 503, 503, 503, 503, 503], False),  # still starting: the startup probe's part, nothing counts
        ([200, 500, 500, 200, 500, 500, 200], False),  # a success resets the count
    ],
    ids=["hung", "hung-at-start", "starting", "recovering"],
)
def test_the_liveness_probe_counts_failures_in_a_row_after_the_first_success(script, replaced, monkeypatch):
    """The kubelet's rule (pkg/kubelet/prober/worker.go, Kubernetes 1.31): failureThreshold failures in a row
    restart the container, a success resets the count; the start (503) is not counted against it. A server hung
    between its start and the probe's next look answers 500 from its first probe on: it counts from there (it was
    never replaced before: seen in test_local_run, a replica whose engine was stopped 7 s after its start)."""
    monkeypatch.setattr(liveness, "LIVENESS_PERIOD_SECONDS", 0.0)
    health = ScriptedHealth(local.free_ports(1)[0], script)
    probe = liveness.Liveness(f"http://127.0.0.1:{health.server.server_port}/health")
    verdicts = []
    with ThreadPoolExecutor(1) as probes:
        # One probe at a time: once a probe past the script is answered, every answer of the script was checked.
        while len(health.answered) <= len(script):
            verdicts.append(probe.check(probes))
            time.sleep(0.005)
    health.close()
    faults = [v for v in verdicts if v is not None]
    assert bool(faults) == replaced, (health.answered, faults)
    if replaced:
        assert faults[0].startswith("GET /health answered 500: failed: vLLM's engine has not answered")


def test_an_inference_replica_that_fails_its_liveness_probe_is_replaced(tmp_path, monkeypatch, capsys):
    """A hung engine lives on and answers nothing: no exit code says it, only /health (app.EngineProbe). The run
    plays the pod's livenessProbe (workers/launcher/liveness.py) and replaces the server as it replaces one that
    exited, within the same budget of restarts. The real hung engine, SIGSTOPped: test_local_run.py."""
    monkeypatch.setattr(local, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(liveness, "LIVENESS_PERIOD_SECONDS", 0.01)
    job = parse_job(job_doc(trainer={"gpusPerReplica": 0}, inference={"gpusPerReplica": 0}))

    deadline = time.monotonic() + 30

    class Hung(ScriptedRun):
        def _exit_codes(self):  # the trainer finishes once the hung server has been replaced (or time is up)
            done = bool(self.restarts) or time.monotonic() > deadline
            return [0 if live.worker.role == "trainer" and done else None for live in self._live]

        def _restart(self, live, why):
            self.restarts[live.worker.index] = self.restarts.get(live.worker.index, 0) + 1
            self.why = why
            self._live.remove(live)
            self._launch(live.worker, live.env)

    run = Hung(tmp_path, [job], [])
    run.start()
    (server,) = [live for live in run._live if live.worker.role == "inference"]
    port = int(liveness.health_url(server.env).rsplit(":", 1)[1].split("/")[0])
    health = ScriptedHealth(port, [200, 500])
    try:
        run.wait()
    finally:
        health.close()
    assert [name for name, _ in run.started].count("demo inference 0") == 2, "the hung server was not replaced"
    assert run.inference_restarts == 1 and run.why == "killed: it failed its liveness probe"
    err = capsys.readouterr().err
    assert "inference 0 failed 3 liveness probes in a row (GET /health answered 500: failed: vLLM's engine" in err
    assert "starting it again (restart 1 of 3)" in err


def test_the_pods_liveness_probe_is_the_rule_the_run_plays():
    """One rule for a hung server, in a cluster and on one machine: the inference pod's livenessProbe has the numbers
    workers/launcher/liveness.py plays, and gives each probe longer than the server's own bound on its engine's
    round trip, so that the kubelet reads the server's verdict (a 500 naming the hung engine), not its own timeout.
    (The kubelet's default timeoutSeconds is 1 s: pkg/apis/core/v1/defaults.go.)"""
    from grpolora.api.plan import plan
    from grpolora.operator import builders
    from grpolora.workers.inference.app import ENGINE_PROBE_SECONDS

    pod = builders.inference_statefulset(plan(parse_job(job_doc())))["spec"]["template"]["spec"]
    probe = pod["containers"][0]["livenessProbe"]
    # The start is the startup probe's, on a path that does not ask the engine: a hung one is the liveness probe's.
    assert pod["containers"][0]["startupProbe"]["httpGet"]["path"] == "/started"
    assert probe["httpGet"]["path"] == "/health"
    assert probe["periodSeconds"] == liveness.LIVENESS_PERIOD_SECONDS
    assert probe["failureThreshold"] == liveness.LIVENESS_FAILURES
    assert probe["timeoutSeconds"] == liveness.LIVENESS_TIMEOUT_SECONDS > ENGINE_PROBE_SECONDS
