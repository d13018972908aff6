"""spec.environment.server (issue 48) on one machine: `grpolora run`'s server processes (workers/launcher/
environment_servers.py) and the trainer's client of them (load_environment's server branch, workers/environments/
remote.py). The servers are real processes of the project's service (python -m grpolora.workers.environments.service)
on loopback, or a test's own command; the replicas are played by test_episodes.ScriptedReplicas.

Where each rule comes from: a pod's command and args expand `$(NAME)` by Kubernetes' rule
(kubernetes/third_party/forked/golang/expansion/expand.go, Expand and tryReadVariableName: `$$` is an escaped `$`,
an unknown name is left as written, an unclosed `$(` is kept); readiness is an HTTP probe's rule (the kubelet's
pkg/probe/http/http.go: a status in 200-399). Each episode's state lives in the one service process that reset it
(service.py keeps its episodes in the process's memory), so a step sent to another answers 404."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import httpx
import pytest

from grpolora.api import contract
from grpolora.api.pool import environment_token
from grpolora.api.spec import EnvironmentSpec
from grpolora.testing.servers import alive
from grpolora.workers.environments import check_environment, load_environment
from grpolora.workers.environments.remote import AVOID_SECONDS, EnvironmentService
from grpolora.workers.launcher.environment_servers import (
    EnvironmentServerFailed,
    EnvironmentServers,
    expand,
    server_processes,
)
from grpolora.workers.launcher.local import free_ports
from grpolora.workers.models import resolve_model
from grpolora.workers.remote_service import AuthRefused
from grpolora.workers.trainer.main import exit_code
from grpolora.workers.trainer.rollout import Sampling
from tests.helpers import example
from tests.workers.test_episodes import PROMPT, ScriptedReplicas, _runner
from tests.workers.test_remote_environment import wait_for

TOKEN = "job-s3cret"  # the job's token: the trainer's; its environment servers hold environment_token(TOKEN)


def served(**server) -> EnvironmentSpec:
    return EnvironmentSpec.model_validate({"builtin": "calculator", "server": server})


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().split(") ", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("offline:smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    """Two processes of the project's service serving the calculator, as `grpolora run` starts them for the example
    job's `server: {replicas: 2}`."""
    spec = EnvironmentSpec.model_validate(example("calculator-server.yaml")["spec"]["environment"])
    assert spec.builtin == "calculator" and spec.server is not None and spec.server.replicas == 2
    servers = EnvironmentServers(spec, tmp_path_factory.mktemp("logs"), TOKEN, ports=free_ports(2))
    servers.start()
    yield servers
    servers.stop()


@pytest.fixture
def trainer_env(monkeypatch, two_servers):
    """The trainer's environment as `grpolora run` gives it: the servers' URLs and the job's token (from which the
    trainer derives the servers')."""
    monkeypatch.setenv(contract.ENVIRONMENT_URL, ",".join(two_servers.urls))
    monkeypatch.setenv(contract.TOKEN, TOKEN)
    monkeypatch.delenv(contract.TOKEN_FILE, raising=False)
    monkeypatch.delenv(contract.ENVIRONMENT_TOKEN, raising=False)
    return two_servers


def open_episodes(urls: list[str]) -> list[int]:
    return [httpx.get(f"{url}/health").json()["episodes"] for url in urls]


# ---- the $(NAME) expansion of a command and its args --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expanded"),
    [
        ("--port=$(PORT)", "--port=8123"),
        ("$(PORT)$(PORT)", "81238123"),
        ("$$(PORT)", "$(PORT)"),  # escaped
        ("$$$(PORT)", "$8123"),
        ("$(UNKNOWN)", "$(UNKNOWN)"),  # left as written
        ("$(PORT", "$(PORT"),  # unclosed
        ("a$b", "a$b"),
        ("cost: 5$", "cost: 5$"),
        ("$()", "$()"),
    ],
)
def test_references_expand_as_kubernetes_expands_a_pods_command(text, expanded):
    assert expand(text, {"PORT": "8123"}) == expanded


def test_the_default_command_serves_the_jobs_kind_and_an_own_command_gets_its_port_and_token():
    default = server_processes(served(replicas=2, args=["--max-episodes", "64"]), [8101, 8102], "t")
    assert [p.argv for p in default] == [
        (sys.executable, "-m", "grpolora.workers.environments.service", "--environment", "calculator", "--host",
         "127.0.0.1", "--port", str(port), "--max-episodes", "64")
        for port in (8101, 8102)
    ]  # fmt: skip
    # The environment token, never the job's: the server runs model-driven code (grpolora.api.pool.environment_token).
    assert default[1].env == {contract.ENVIRONMENT_PORT: "8102", contract.ENVIRONMENT_TOKEN: environment_token("t")}
    assert default[1].url == "http://127.0.0.1:8102"
    own = EnvironmentSpec.model_validate(
        {
            "server": {
                "command": ["python3", "-m", "my_env.serve"],
                "args": ["--listen=:$(GRPOLORA_ENVIRONMENT_PORT)", "--mode=$(MODE)", "$$(MODE)"],
                "env": [{"name": "MODE", "value": "sandbox"},
                        {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
            }
        }
    )  # fmt: skip
    [process] = server_processes(own, [8200], "t")
    assert process.argv == (sys.executable, "-m", "my_env.serve", "--listen=:8200", "--mode=sandbox", "$(MODE)")
    assert process.env == {"MODE": "sandbox", contract.ENVIRONMENT_PORT: "8200",
                           contract.ENVIRONMENT_TOKEN: environment_token("t")}  # fmt: skip


# ---- the trainer's client: episodes pinned to one server each -----------------------------------------------------


def test_each_episode_stays_on_the_server_that_holds_it(trainer_env):
    factory = load_environment(served(replicas=2))
    assert isinstance(factory, EnvironmentService) and list(factory.urls) == trainer_env.urls
    episodes = [factory() for _ in range(4)]
    assert [e.url for e in episodes] == trainer_env.urls * 2  # spread: the least loaded, round-robin among equals
    for env in episodes:
        env.reset(PROMPT)
    assert open_episodes(trainer_env.urls) == [2, 2]
    for env in episodes:  # a step sent to the other server would answer 404: no such episode
        [answer] = env.step({"role": "assistant", "content": "<calc>12*7</calc>"}).messages
        assert answer["content"] == "<result>84</result>"
        assert env.step({"role": "assistant", "content": "Answer: 84"}).done
    for env in episodes:
        env.close()
    assert open_episodes(trainer_env.urls) == [0, 0] and factory.open_episodes() == dict.fromkeys(trainer_env.urls, 0)
    factory.close()


def test_new_episodes_go_to_the_least_loaded_server_and_avoid_one_that_just_failed(trainer_env):
    factory = load_environment(served(replicas=2))
    first, second = trainer_env.urls
    held = [factory() for _ in range(3)]  # first, second, first
    assert [e.url for e in held] == [first, second, first]
    held[0].close()
    held[2].close()
    assert factory().url == first  # the first now holds none, the second one
    # A call to the second fails (its process is being replaced): new episodes go to the first for a while.
    factory._failed_at[second] = time.monotonic()
    assert [factory().url for _ in range(3)] == [first] * 3
    factory._failed_at[second] = time.monotonic() - AVOID_SECONDS  # as if AVOID_SECONDS had passed
    assert factory().url == second  # avoided no longer: the least loaded again
    factory.close()


def test_a_lost_server_sends_new_episodes_to_the_other_until_it_is_back(tmp_path, monkeypatch):
    """A pod lost and replaced, walked through: the episodes it held fail as unavailable (played again by the
    runner, on a fresh environment), new ones go to the other server while the lost one is avoided, and once it is
    back and the avoidance over, episodes spread over both again."""
    from grpolora.workers.environments.base import EnvironmentUnavailable, close_environment

    servers = EnvironmentServers(served(replicas=2), tmp_path, TOKEN, ports=free_ports(2))
    servers.start()
    try:
        monkeypatch.setenv(contract.ENVIRONMENT_URL, ",".join(servers.urls))
        monkeypatch.setenv(contract.TOKEN, TOKEN)
        spec = {"builtin": "calculator", "server": {"replicas": 2}, "stepTimeoutSeconds": 2, "retries": 1}
        factory = load_environment(EnvironmentSpec.model_validate(spec))
        first, second = servers.urls
        held = factory(), factory()
        assert [env.url for env in held] == [first, second]
        for env in held:
            env.reset(PROMPT)
        servers._running[0].kill()
        servers._running[0].wait()
        with pytest.raises(EnvironmentUnavailable, match="cannot reach it"):
            held[0].step({"role": "assistant", "content": "Answer: 84"})
        close_environment(held[0])  # as the runner closes a lost play's environment: its close fails, logged
        replayed = [factory() for _ in range(3)]  # the lost episode played again, and more
        assert [env.url for env in replayed] == [second] * 3
        for env in replayed:
            env.reset(PROMPT)
            assert env.step({"role": "assistant", "content": "Answer: 84"}).done
            env.close()
        assert held[1].step({"role": "assistant", "content": "Answer: 84"}).done  # the other's own went on
        held[1].close()
        assert servers.revive()[0].startswith("environment server 0 exited with code -9; started it again")
        factory._failed_at[first] -= AVOID_SECONDS  # the avoidance over
        again = [factory() for _ in range(2)]
        assert [env.url for env in again] == [first, second]  # the least loaded, round-robin among equals
        for env in again:
            env.reset(PROMPT)
            assert env.step({"role": "assistant", "content": "Answer: 84"}).done
            env.close()
        factory.close()
    finally:
        servers.stop()


def test_a_job_plays_its_episodes_over_both_servers(tokenizer, trainer_env):
    script = {0: ["<calc>12*7</calc>", "Answer: 84"], 1: ["Answer: 80"], 2: ["Answer: 84"], 3: ["<calc>1+1</calc>",
              "Answer: 84"]}  # fmt: skip
    runner = _runner(tokenizer, factory=load_environment(served(replicas=2)))
    sampling = Sampling(4, 1.0, 1.0, 32)
    [group] = runner.run([PROMPT], [[1]], [0], sampling, ScriptedReplicas(tokenizer, script), replicas=[0], version=3)
    assert [e.episode.error for e in group] == [None] * 4
    assert [e.episode.turns for e in group] == [2, 1, 1, 2]
    results = [[m["content"] for m in e.episode.messages if m["role"] == "tool"][-1] for e in (group[0], group[3])]
    assert results == ["<result>84</result>", "<result>2</result>"]  # each answered by the server holding it
    runner.close()


def test_the_server_needs_the_environment_token_and_refuses_the_jobs(trainer_env, monkeypatch, tmp_path):
    """The server holds a token derived from the job's (it runs model-driven code: with the job's token a compromised
    server could call the replicas' generate and control endpoints). It refuses the job's token itself; the trainer,
    which holds the job's, derives the server's and is let in."""
    url = trainer_env.urls[0]
    body = {"episode": "auth", "prompt": {"text": "What is 1+1?"}}
    assert environment_token(TOKEN) != TOKEN
    assert httpx.post(f"{url}/reset", json=body, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 401
    bearer = {"Authorization": f"Bearer {environment_token(TOKEN)}"}
    assert httpx.post(f"{url}/reset", json=body, headers=bearer).status_code == 200
    httpx.post(f"{url}/close", json={"episode": "auth"}, headers=bearer)

    monkeypatch.setenv(contract.TOKEN, "not-the-token")
    env = load_environment(served(replicas=2))()
    with pytest.raises(AuthRefused, match=r"^spec.environment.server: .*/reset refused the job's credentials: HTTP "
                       "401") as refused:  # fmt: skip
        env.reset(PROMPT)
    assert exit_code(refused.value) == contract.EXIT_INVALID_SPEC
    # In a trainer pod: the job's token as a file (GRPOLORA_TOKEN_FILE), from which the server's is derived.
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv(contract.TOKEN_FILE, str(tmp_path / "token"))
    env = load_environment(served(replicas=2))()
    assert env.reset(PROMPT).messages[-1]["content"].startswith("What is 12 * 7?")
    env.close()


def test_the_service_takes_its_port_and_token_file_from_a_pods_environment(tmp_path):
    """How the operator's pods run the default command: GRPOLORA_ENVIRONMENT_PORT and the token's file in
    GRPOLORA_ENVIRONMENT_TOKEN_FILE, no flags for either."""
    import subprocess

    (tmp_path / "token").write_text(TOKEN + "\n")
    [port] = free_ports(1)
    env = dict(os.environ) | {contract.ENVIRONMENT_PORT: str(port),
                              contract.ENVIRONMENT_TOKEN_FILE: str(tmp_path / "token")}  # fmt: skip
    env.pop(contract.ENVIRONMENT_TOKEN, None)
    argv = [sys.executable, "-m", "grpolora.workers.environments.service", "--environment", "calculator", "--host",
            "127.0.0.1"]  # fmt: skip
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert server.poll() is None, "the service exited"
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, "the service to answer /health", timeout=30)
        body = {"episode": "e", "prompt": {"text": "What is 1+1?"}}
        assert httpx.post(f"{url}/reset", json=body).status_code == 401
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.post(f"{url}/reset", json=body, headers=bearer).status_code == 200
    finally:
        server.terminate()
        server.wait()


def test_without_its_urls_the_trainer_fails_naming_the_variable(monkeypatch, tmp_path):
    from grpolora.workers.tasks import TaskError

    monkeypatch.delenv(contract.ENVIRONMENT_URL, raising=False)
    with pytest.raises(TaskError, match=r"^spec.environment.server: GRPOLORA_ENVIRONMENT_URL is not set: it names"):
        load_environment(served())
    # headersFrom may add headers, not replace the job's token.
    (tmp_path / "env-auth").mkdir()
    (tmp_path / "env-auth" / "Authorization").write_text("Bearer other")
    monkeypatch.setenv("GRPOLORA_SECRETS_DIR", str(tmp_path))
    monkeypatch.setenv(contract.ENVIRONMENT_URL, "http://127.0.0.1:1")
    spec = EnvironmentSpec.model_validate(
        {"builtin": "calculator", "server": {}, "headersFrom": {"secretName": "env-auth"}}
    )
    with pytest.raises(TaskError, match=r"^spec.environment.headersFrom: its key `Authorization` would replace"):
        load_environment(spec)


def test_validate_checks_what_the_server_serves_not_its_urls(monkeypatch):
    monkeypatch.delenv(contract.ENVIRONMENT_URL, raising=False)
    assert check_environment(served()) == ([], [])
    problems, unreachable = check_environment(
        EnvironmentSpec.model_validate({"plugin": "no_such_module_here:make", "server": {}})
    )
    assert problems == [] and [u.path for u in unreachable] == ["spec.environment.plugin"]
    own = EnvironmentSpec.model_validate({"server": {"command": ["./serve"]}})
    assert check_environment(own) == ([], [])


# ---- grpolora run's processes: ready, failing, restarted, stopped -------------------------------------------------


def test_the_servers_answer_health_on_ports_of_their_own_and_stop_leaving_nothing(tmp_path):
    servers = EnvironmentServers(served(replicas=2), tmp_path, TOKEN, ports=free_ports(2))
    servers.start()
    pids = [p.pid for p in servers._running]
    assert len(set(servers.urls)) == 2 and open_episodes(servers.urls) == [0, 0]
    refused = httpx.post(f"{servers.urls[0]}/reset", json={"episode": "e", "prompt": {"text": "hi"}})
    assert refused.status_code == 401  # the token is required
    servers.stop()
    assert not any(alive(pid) or group_members(pid) for pid in pids)
    for url in servers.urls:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")


def test_a_server_that_exits_at_once_fails_naming_the_command_and_its_output(tmp_path):
    spec = EnvironmentSpec.model_validate(
        {"server": {"replicas": 2, "command": ["python", "-c", "import sys; print('no sandbox here'); sys.exit(3)"]}}
    )
    servers = EnvironmentServers(spec, tmp_path, TOKEN, ports=free_ports(2))
    with pytest.raises(EnvironmentServerFailed) as failed:
        servers.start()
    message = str(failed.value)
    assert message.startswith("spec.environment.server.command ['python', '-c', \"import sys; print('no sandbox here')")
    assert "exited with code 3 before it was ready" in message and message.endswith("no sandbox here")
    assert servers._running == [None, None]


def test_a_server_that_never_answers_health_fails_within_the_bound_and_is_stopped(tmp_path):
    # Its own command: a child that sleeps (the group is stopped, not only the process started).
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
             "print('listening on', sys.argv[1], flush=True); time.sleep(60)"  # fmt: skip
    spec = EnvironmentSpec.model_validate(
        {"server": {"command": ["python", "-c", script], "args": ["$(GRPOLORA_ENVIRONMENT_PORT)"]}}
    )
    [port] = free_ports(1)
    servers = EnvironmentServers(spec, tmp_path, TOKEN, ports=[port], ready_seconds=1.0)
    servers.launch()
    [process] = servers._running
    started = "the server's child started and its line written"
    wait_for(lambda: "listening" in servers.log(0).read_text(), started, timeout=30)
    with pytest.raises(EnvironmentServerFailed) as failed:
        servers.start()  # waits, fails, stops
    assert f"did not answer GET http://127.0.0.1:{port}/health with 200 within 1 s" in str(failed.value)
    assert str(failed.value).endswith(f"listening on {port}")  # the expanded port
    assert process.poll() is not None
    # The child got SIGTERM then SIGKILL, which the kernel delivers when it next runs: on a loaded machine it may
    # still be exiting as stop() returns (seen once), so wait for it to be gone rather than look once.
    wait_for(lambda: not group_members(process.pid), "the server's child gone", timeout=5)


def test_a_server_that_exits_while_the_job_runs_is_started_again_on_its_port(tmp_path):
    servers = EnvironmentServers(served(), tmp_path, TOKEN, ports=free_ports(1))
    servers.start()
    try:
        assert servers.revive() == []
        [first] = servers._running
        first.kill()
        first.wait()
        [said] = servers.revive()
        assert said.startswith("environment server 0 exited with code -9; started it again (restart 1 of 3)")
        assert open_episodes(servers.urls) == [0]  # ready again, on the same URL
        assert "--- grpolora run: exited with code -9; restart 1 ---" in servers.log(0).read_text()
    finally:
        servers.stop()


def test_a_restarted_server_that_exits_before_it_is_ready_is_started_again_within_the_budget(tmp_path):
    """A restart's process that exits before it answers /health (a crash at start, its port taken meanwhile) spends
    one restart of the budget, as a pod's container restarts, rather than failing the job with restarts left."""
    # Each start counts itself in a file: starts 1 and 3 serve /health, every other exits at once with code 3.
    script = textwrap.dedent("""
        import http.server, pathlib, sys
        count = pathlib.Path(sys.argv[2])
        started = int(count.read_text()) + 1 if count.exists() else 1
        count.write_text(str(started))
        if started not in (1, 3):
            sys.exit(3)

        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()

        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """)
    count = tmp_path / "starts"
    spec = EnvironmentSpec.model_validate(
        {"server": {"command": ["python", "-c", script], "args": ["$(GRPOLORA_ENVIRONMENT_PORT)", str(count)]}}
    )
    servers = EnvironmentServers(spec, tmp_path, TOKEN, ports=free_ports(1))
    servers.start()
    try:
        servers._running[0].kill()
        servers._running[0].wait()
        said = servers.revive()  # start 2 exits before it is ready, start 3 serves
        assert [line.split(";")[1].strip() for line in said] == [
            "started it again (restart 1 of 3)",
            "started it again (restart 2 of 3)",
        ]
        assert said[1].startswith("environment server 0 exited with code 3;")
        assert servers.restarts == [2] and count.read_text() == "3"
        assert httpx.get(f"{servers.urls[0]}/health").status_code == 200  # ready
        servers._running[0].kill()
        servers._running[0].wait()
        with pytest.raises(EnvironmentServerFailed, match=r"server 0 exited with code 3 after 3 restarts"):
            servers.revive()  # start 4 exits: the budget is spent
        assert servers.restarts == [3] and count.read_text() == "4"
    finally:
        servers.stop()
