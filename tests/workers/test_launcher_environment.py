"""`grpolora run` of a job with spec.environment.server, without an engine or a trainer: the launcher's own
supervision (test_launcher_wait.ScriptedRun plays the Ray workers' exits), with the environment servers as real
processes of the project's service. The trainer starts only once each server answers /health, with their URLs and
the job's token; the servers go with the job however it ends, and a job whose server fails fails with its command
and output while a pool's other jobs carry on."""

from __future__ import annotations

import httpx

from grpolora.api import contract
from grpolora.api.load import parse_job
from grpolora.api.pool import environment_token
from grpolora.api.status import TrainerStatus
from grpolora.testing.servers import alive
from grpolora.workers.launcher import local
from tests.helpers import job_doc
from tests.workers.test_environment_server import group_members
from tests.workers.test_launcher_wait import ScriptedRun, pool, pool_job

CALCULATOR = {"builtin": "calculator", "maxEpisodeTokens": 1024}


def served_job(**server):
    doc = job_doc(trainer={"gpusPerReplica": 0}, inference={"gpusPerReplica": 0},
                  environment={**CALCULATOR, "server": server})  # fmt: skip
    return parse_job(doc)


class HealthAtStart(ScriptedRun):
    """Also keeps, for each trainer started, its env and what each URL of GRPOLORA_ENVIRONMENT_URL answered to GET
    /health at that moment."""

    def _launch(self, worker, env):
        if worker.role == "trainer":
            urls = env.get(contract.ENVIRONMENT_URL, "").split(",")
            self.health = [httpx.get(f"{url}/health").status_code for url in urls if url]
            self.trainer_env = env
        return super()._launch(worker, env)


def server_pids(run: ScriptedRun) -> list[int]:
    return [p.pid for job in run.jobs if job.environment for p in job.environment._running if p is not None]


def test_the_trainer_starts_once_every_server_is_ready_and_the_servers_stop_with_the_job(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "POLL_SECONDS", 0.01)
    run = HealthAtStart(tmp_path, [served_job(replicas=2)], [{}, {}, {"demo trainer 0": 0}])
    run.start()
    [job] = run.jobs
    urls = run.trainer_env[contract.ENVIRONMENT_URL].split(",")
    assert len(set(urls)) == 2 and run.health == [200, 200]
    # The trainer has the job's token and derives the servers' from it; the servers hold only theirs.
    assert run.trainer_env[contract.TOKEN] == job.token and contract.ENVIRONMENT_TOKEN not in run.trainer_env
    servers = job.environment.processes
    assert [p.env[contract.ENVIRONMENT_TOKEN] for p in servers] == [environment_token(job.token)] * 2
    assert all(job.token not in p.env.values() for p in servers)
    pids = server_pids(run)
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    assert [(tmp_path / "logs" / f"environment-{i}.log").exists() for i in (0, 1)] == [True, True]
    run.wait()
    assert job.state == "succeeded"
    assert not any(alive(pid) or group_members(pid) for pid in pids)  # stopped when the job ended


def test_a_server_that_exits_at_once_fails_the_job_with_its_command_and_output(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "POLL_SECONDS", 0.01)
    command = ["python", "-c", "import sys; sys.exit('the sandbox runtime is missing')"]
    doc = job_doc(trainer={"gpusPerReplica": 0}, inference={"gpusPerReplica": 0},
                  environment={"server": {"command": command}, "maxEpisodeTokens": 1024})  # fmt: skip
    run = HealthAtStart(tmp_path, [parse_job(doc)], [{}])
    run.start()
    [job] = run.jobs
    assert job.state == "failed" and not hasattr(run, "trainer_env")  # no trainer started
    run.wait()  # nothing left to wait for
    status = TrainerStatus.model_validate_json((tmp_path / "status.json").read_text())
    assert status.phase == "Failed"
    assert status.message.startswith(f"spec.environment.server.command {command}: server 0 exited with code 1 "
                                     "before it was ready")  # fmt: skip
    assert "the sandbox runtime is missing" in status.message
    assert server_pids(run) == []
    run.stop()


def test_a_servers_env_from_the_cluster_is_said_to_be_unset_here(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(local, "POLL_SECONDS", 0.01)
    secret = {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "tools", "key": "key"}}}
    job = served_job(env=[secret, {"name": "MODE", "value": "x"}])
    run = HealthAtStart(tmp_path, [job], [{}, {"demo trainer 0": 0}])
    run.start()
    run.wait()
    err = capsys.readouterr().err
    assert "warning: spec.environment.server.env: API_KEY come from the cluster (valueFrom), which is not here" in err


def test_a_server_lost_while_the_job_runs_is_started_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(local, "POLL_SECONDS", 0.01)
    run = HealthAtStart(tmp_path, [served_job()], [{}, {}, {"demo trainer 0": 0}])
    run.start()
    [job] = run.jobs
    [first] = job.environment._running
    first.kill()
    first.wait()
    run.wait()
    assert job.state == "succeeded"
    assert "environment server 0 exited with code -9; started it again (restart 1 of 3)" in capsys.readouterr().err
    [second] = server_pids(run) or [None]
    assert second is None  # stopped at the end
    assert not alive(first.pid)


def test_on_a_pool_a_jobs_failing_server_ends_that_job_only(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "POLL_SECONDS", 0.01)
    broken = {"server": {"command": ["python", "-c", "raise SystemExit(4)"]}, "maxEpisodeTokens": 1024}
    jobs = [pool_job("a", environment=broken), pool_job("b")]
    run = ScriptedRun(tmp_path, jobs, [{}, {"b trainer 0": 0}], pool=pool(maxJobs=2))
    run.start()
    run.wait()
    assert [j.state for j in run.jobs] == ["failed", "succeeded"]
    assert [name for name, _ in run.started] == ["shared-pool inference 0", "b trainer 0"]
    status = TrainerStatus.model_validate_json((tmp_path / "a" / "status.json").read_text())
    assert "exited with code 4 before it was ready" in status.message


class KernelPorts:
    """A socket whose bind to port 0 gets the next of `ports`: the kernel may give a port it gave before, free both
    times as nothing has bound it yet (Linux's inet_csk_find_open_port starts at a random offset in
    ip_local_port_range on each call). Binding a given port always succeeds (every port is free)."""

    def __init__(self, ports):
        self.ports = iter(ports)

    def socket(self):
        outer = self

        class Probe:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def bind(self, address):
                self.port = next(outer.ports) if address[1] == 0 else address[1]

            def getsockname(self):
                return ("127.0.0.1", self.port)

        return Probe()


def test_a_port_handed_out_is_not_handed_out_again(monkeypatch):
    """The run picks every port before anything binds one (the plan's, then its environment servers'), so a port the
    kernel gives twice must not go to two processes: one of them could never listen."""
    monkeypatch.setattr(local, "_handed_out", set())
    monkeypatch.setattr(local, "socket", KernelPorts([41001, 41001, 41002, 41002, 41001, 41003, 41010]))
    assert local.free_ports(2) == [41001, 41002]
    assert local.free_ports(1) == [41003]
    assert local.free_ports(3, consecutive=True) == [41010, 41011, 41012]
