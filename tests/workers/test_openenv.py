"""OpenEnv environments through workers/environments/openenv.py (issue 48, item 4), against a real OpenEnv server.

The environment is openenv-core's own: `openenv init echo_env` writes the echo environment of its template
(openenv-core 0.3.0, openenv/cli/templates/openenv_env: models.py's EchoAction/EchoObservation, server/app.py's
`create_app(..., max_concurrent_envs=1)`, client.py's EchoEnv). Its server runs as OpenEnv serves it (uvicorn, a
process of its own on loopback), so "the server is gone" is a killed process and a closed WebSocket, not a mock. The
replicas are played by test_episodes.ScriptedReplicas, as in the other episode tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from grpolora.api.spec import EnvironmentSpec
from grpolora.testing.servers import free_port
from grpolora.workers.environments import Opening, Reply, load_environment
from grpolora.workers.environments.base import EnvironmentUnavailable, InvalidAction
from grpolora.workers.environments.openenv import openenv_environment  # openenv-core: `make test` installs it
from grpolora.workers.models import resolve_model
from grpolora.workers.tasks import Prompt, TaskError
from grpolora.workers.trainer.rollout import Sampling

READY = "Echo Env environment ready!"  # what the template's EchoEnvironment.reset says

# An MCP environment as OpenEnv's own are written (its repository's envs/echo_env: an MCPEnvironment whose FastMCP
# server holds the tools, served with CallToolAction as its action class), with openenv-core's helpers only.
ADDER = textwrap.dedent("""
    from fastmcp import FastMCP
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
    from openenv.core.env_server.types import Observation, State


    class AdderEnvironment(MCPEnvironment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            tools = FastMCP("adder")

            @tools.tool()
            def add(a: int, b: int) -> int:
                \"\"\"a + b\"\"\"
                return a + b

            super().__init__(tools)
            self._state = State()

        def reset(self, seed=None, episode_id=None, **kwargs):
            self._state = State(episode_id=episode_id)
            return Observation()

        def _step_impl(self, action, timeout_s=None, **kwargs):
            return Observation(done=True)

        @property
        def state(self):
            return self._state


    app = create_fastapi_app(AdderEnvironment, CallToolAction, CallToolObservation, max_concurrent_envs=4)
""")


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory):
    """The echo environment package `openenv init` writes, importable (its client, models and server)."""
    root = tmp_path_factory.mktemp("openenv")
    # An empty PATH: `init` would run `uv lock` where uv is found, which needs the network.
    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env", "--output-dir", str(root)], check=True,
                   env={**os.environ, "PATH": ""}, capture_output=True, timeout=120)  # fmt: skip
    (root / "echo_plugin.py").write_text(
        textwrap.dedent("""
        import os

        from echo_env import EchoEnv
        from echo_env.server.echo_env_environment import EchoEnvironment
        from grpolora.workers.environments.openenv import openenv_environment

        echo = openenv_environment(EchoEnv, os.environ["ECHO_URL"])  # a server elsewhere
        echo_here = openenv_environment(EchoEnvironment)  # the same environment in the plugin's process
        """)
    )
    (root / "adder_env.py").write_text(ADDER)
    (root / "bye_env.py").write_text(
        textwrap.dedent("""
        from echo_env.models import EchoAction, EchoObservation
        from echo_env.server.echo_env_environment import EchoEnvironment
        from openenv.core.env_server.http_server import create_fastapi_app


        class ByeEnvironment(EchoEnvironment):  # the template's echo, which ends at "bye"
            def step(self, action):
                observation = super().step(action)
                observation.done = action.message == "bye"
                return observation


        app = create_fastapi_app(ByeEnvironment, EchoAction, EchoObservation, max_concurrent_envs=1)
        """)
    )
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [n for n in sys.modules if n.split(".")[0] in ("echo_env", "echo_plugin")]:
        del sys.modules[name]


class OpenEnvServer:
    """The echo environment's server as OpenEnv runs it (`uvicorn echo_env.server.app:app`), one process."""

    def __init__(self, root, port: int):
        self.root, self.port, self.url = root, port, f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> OpenEnvServer:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "echo_env.server.app:app", "--host", "127.0.0.1", "--port",
             str(self.port), "--log-level", "warning"],
            cwd=self.root, env={**os.environ, "PYTHONPATH": str(self.root)}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:  # ready once its /health answers
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert self.process.poll() is None, "the OpenEnv server exited"
            assert time.monotonic() < deadline, "the OpenEnv server did not start in 60 s"
            time.sleep(0.1)

    def kill(self) -> None:
        """Gone at once (SIGKILL): its connections drop, nothing listens on its port."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()


@pytest.fixture(scope="module")
def server(echo_env):
    served = OpenEnvServer(echo_env, free_port()).start()
    yield served
    served.kill()


def reset_when_free(factory, prompt: Prompt, seconds: float = 10.0):
    """A new episode reset once the server has a session free (it ends a closed one's session after the client has
    gone: an observable state, waited for)."""
    deadline = time.monotonic() + seconds
    while True:
        episode = factory()
        try:
            return episode, episode.reset(prompt)
        except EnvironmentUnavailable:
            episode.close()
            if time.monotonic() > deadline:
                raise


def test_an_episode_through_the_client_is_the_one_the_environment_plays_in_process(echo_env, server):
    """reset, step and close through the server (one WebSocket, one server-side environment) give what the same
    environment class gives in this process: the observation's text as the user's turn, the step's reward
    (the template's: 0.1 per character) and done."""
    from echo_env import EchoEnv
    from echo_env.server.echo_env_environment import EchoEnvironment

    prompt = Prompt("What is 12 * 7?")
    hello = {"role": "assistant", "content": "hello"}
    played = []
    for factory in (openenv_environment(EchoEnv, server.url), openenv_environment(EchoEnvironment)):
        episode, opening = reset_when_free(factory, prompt)
        played.append((opening, episode.step(hello), episode.step({"role": "assistant", "content": "84"})))
        episode.close()
        factory.close()
    assert played[0] == played[1]
    assert played[0] == (
        Opening([{"role": "user", "content": READY}]),
        Reply([{"role": "user", "content": "hello"}], False, 0.5),
        Reply([{"role": "user", "content": "84"}], False, 0.2),
    )


def test_a_full_server_and_a_server_gone_are_unavailable_and_close_frees_the_session(server):
    """The template's server holds one session (max_concurrent_envs=1): a second episode is refused, the
    infrastructure's fault (played again, not scored); once the first closes, a new one opens. The server sends
    CAPACITY_REACHED and closes the connection at once (http_server.py, /ws), so the client's reset meets either
    that answer or the closed connection (websockets refuses a send after the close), whichever comes first. A
    server that died under an episode, or is not there, is EnvironmentUnavailable too."""
    from echo_env import EchoEnv

    factory = openenv_environment(EchoEnv, server.url)
    first, _ = reset_when_free(factory, Prompt("a"))
    second = factory()
    with pytest.raises(EnvironmentUnavailable, match=r"reset\(\): the OpenEnv server at .*(CAPACITY_REACHED|Closed)"):
        second.reset(Prompt("b"))
    second.close()
    first.close()
    third, _ = reset_when_free(factory, Prompt("c"))  # the first's session was ended by its close
    server.kill()
    try:
        with pytest.raises(EnvironmentUnavailable, match=r"step\(\): the OpenEnv server at "):
            third.step({"role": "assistant", "content": "anyone?"})
        third.close()  # best effort: nothing to close any more, and no hang
        with pytest.raises(EnvironmentUnavailable, match=r"reset\(\): the OpenEnv server at .*ConnectionError"):
            factory().reset(Prompt("d"))  # nothing listens there
    finally:
        server.start()
    factory.close()
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes connections (the kernel's backlog), says nothing
        mute = openenv_environment(EchoEnv, f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_seconds=0.5)
        with pytest.raises(EnvironmentUnavailable, match=r"reset\(\): .*ConnectionError: "):
            mute().reset(Prompt("e"))
        mute.close()


def test_the_mappings_a_plugin_may_give_instead_of_the_defaults(echo_env):
    """`action`, `observation` (a field or a function), `reset` and `role`, on the Environment class in-process;
    reset's keyword arguments reach it only where its signature names them (the template's reset takes none)."""
    from echo_env import EchoAction
    from echo_env.server.echo_env_environment import EchoEnvironment

    asked = []

    class Seeded(EchoEnvironment):
        def reset(self, seed=None):
            asked.append(seed)
            return super().reset()

    factory = openenv_environment(
        Seeded,
        action=lambda message: EchoAction(message=message["content"].upper()),
        observation=lambda obs: [{"role": "tool", "content": obs.echoed_message, "name": "echo"}],
        reset=lambda prompt: {"seed": prompt.meta["seed"], "difficulty": "ignored: not reset's"},
    )
    episode = factory()
    assert episode.reset(Prompt("a", meta={"seed": 7})).messages == [{"role": "tool", "content": READY, "name": "echo"}]
    assert episode.step({"role": "assistant", "content": "hi"}) == Reply([{"role": "tool", "content": "HI",
                                                                          "name": "echo"}], False, 0.2)  # fmt: skip
    assert asked == [7]
    by_field = openenv_environment(EchoEnvironment, observation="message_length", role="tool")()
    by_field.reset(Prompt("a"))
    assert by_field.step({"role": "assistant", "content": "four"}).messages == [{"role": "tool", "content": "4"}]
    with pytest.raises(ValueError, match="EchoAction has no field 'text'; its fields: metadata, message"):
        openenv_environment(EchoEnvironment, action="text")
    with pytest.raises(ValueError, match="base_url is for an OpenEnv client class"):
        openenv_environment(EchoEnvironment, "http://127.0.0.1:1")


def test_the_job_servers_command_serves_an_openenv_environment(echo_env, tmp_path, monkeypatch):
    """spec.environment.server with no command and `plugin`: what `grpolora run` starts for it (the pods' command,
    python -m grpolora.workers.environments.service --environment <plugin>, ready once its /health answers), here
    with the OpenEnv Environment class in the server's own process, played through the trainer's client of a job's
    server (its URLs and the job's token as the trainer gets them)."""
    from grpolora.api import contract
    from grpolora.workers.launcher.environment_servers import EnvironmentServers

    # The plugin's module is beside the test's data, as a job's is in the server's image.
    env = [{"name": "PYTHONPATH", "value": str(echo_env)}, {"name": "ECHO_URL", "value": "unused"}]
    spec = EnvironmentSpec.model_validate({"plugin": "echo_plugin:echo_here", "server": {"env": env}})
    servers = EnvironmentServers(spec, tmp_path, "job-token", ports=[free_port()])
    servers.start()
    try:
        monkeypatch.setenv(contract.ENVIRONMENT_URL, ",".join(servers.urls))
        monkeypatch.setenv(contract.TOKEN, "job-token")
        monkeypatch.delenv(contract.TOKEN_FILE, raising=False)
        client = load_environment(spec)
        episode = client()
        assert episode.reset(Prompt("a")).messages == [{"role": "user", "content": READY}]
        assert episode.step({"role": "assistant", "content": "hello"}) == Reply(
            [{"role": "user", "content": "hello"}], False, 0.5
        )
        episode.close()
        client.close()
    finally:
        servers.stop()


def call(name: str, arguments: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": name, "arguments": arguments}}]}  # fmt: skip


def test_an_mcp_environment_lists_its_tools_and_answers_each_call_in_process_and_through_its_server(echo_env):
    """An MCP environment (OpenEnv's MCPToolClient, or the MCPEnvironment class in-process): its tools reach the
    chat template at reset (ListToolsAction, in OpenAI's form), each tool call of the assistant's is a CallToolAction
    answered by a tool message with the call's id, a call it cannot make is answered with the error, and a message
    without calls ends the episode. Its reset says nothing (MCPToolClient keeps no field of a reset's observation):
    the episode opens with the task's prompt."""
    from adder_env import AdderEnvironment, app
    from openenv.core.mcp_client import MCPToolClient

    from tests.workers.rewardserver import AppServer

    served = AppServer(app).start()
    prompt = Prompt("What is 2 + 3?", system="Use the tools.")
    played = []
    try:
        for factory in (openenv_environment(MCPToolClient, served.url), openenv_environment(AdderEnvironment)):
            episode = factory()
            played.append((
                episode.reset(prompt),
                episode.step(call("add", '{"a": 2, "b": 3}')),
                episode.step(call("mul", '{"a": 2, "b": 3}')),
                episode.step(call("add", '{"a": 2,')),
                episode.step({"role": "assistant", "content": "Answer: 5"}),
            ))  # fmt: skip
            episode.close()
            factory.close()
    finally:
        served.stop()
    assert played[0] == played[1]
    opening, added, unknown, unreadable, answered = played[0]
    system, user = {"role": "system", "content": "Use the tools."}, {"role": "user", "content": prompt.text}
    assert opening.messages == [system, user]
    [tool] = opening.tools
    assert (tool["type"], tool["function"]["name"], tool["function"]["description"]) == ("function", "add", "a + b")
    assert tool["function"]["parameters"]["required"] == ["a", "b"]
    assert added == Reply([{"role": "tool", "content": "5", "name": "add", "tool_call_id": "call-1"}], False, None)
    assert unknown.messages == [{"role": "tool", "content": "error: Unknown tool: 'mul'", "name": "mul",
                                 "tool_call_id": "call-1"}]  # fmt: skip
    assert unreadable.messages[0]["content"].startswith("error: the arguments of 'add' are not JSON")
    assert answered == Reply([], True, None)  # the task's reward scores "Answer: 5"
    with pytest.raises(ValueError, match="an MCP environment's actions are the assistant's tool calls"):
        openenv_environment(AdderEnvironment, action="a")


def test_an_episode_that_ends_frees_its_server_session_before_the_runner_closes_it(echo_env):
    """The runner closes a step's environments once every episode of the step has ended; an OpenEnv server holds
    max_concurrent_envs sessions. An episode the environment ended gives its session back at once, so the next
    episode opens on a one-session server while the ended one is not yet closed."""
    from bye_env import app
    from echo_env import EchoEnv

    from tests.workers.rewardserver import AppServer

    served = AppServer(app).start()
    factory = openenv_environment(EchoEnv, served.url)
    try:
        ended, _ = reset_when_free(factory, Prompt("a"))
        assert ended.step({"role": "assistant", "content": "bye"}) == Reply([], True, pytest.approx(0.3))
        after, opening = reset_when_free(factory, Prompt("b"))  # refused until the ended one's session is gone
        assert opening.messages == [{"role": "user", "content": READY}]
        after.close()
        ended.close()  # the runner's close, later: nothing left to close
    finally:
        factory.close()
        served.stop()


def test_a_text_the_servers_action_refuses_is_the_models_mistake_and_a_missing_mapping_fails_the_load(
    echo_env, server, monkeypatch
):
    """GenericEnvClient sends a dict; the server validates it against EchoAction (extra fields forbidden) and
    answers VALIDATION_ERROR: InvalidAction, answered to the model as the tool's error. Without `action=` a generic
    client cannot know the action's field: the plugin fails to load, naming the field."""
    from openenv.core import GenericEnvClient

    factory = openenv_environment(GenericEnvClient, server.url, action="text")
    episode, opening = reset_when_free(factory, Prompt("a"))
    assert opening.messages == [{"role": "user", "content": READY}]
    with pytest.raises(InvalidAction, match="Invalid message"):
        episode.step({"role": "assistant", "content": "hello"})
    episode.close()
    factory.close()
    (echo_env / "generic_plugin.py").write_text(
        "from openenv.core import GenericEnvClient\n"
        "from grpolora.workers.environments.openenv import openenv_environment\n"
        "echo = openenv_environment(GenericEnvClient, 'http://127.0.0.1:1')\n"
    )
    monkeypatch.delitem(sys.modules, "generic_plugin", raising=False)
    with pytest.raises(TaskError, match=r"^spec.environment.plugin: .*Action class is not known.*pass action="):
        load_environment(EnvironmentSpec(plugin="generic_plugin:echo"))


def test_an_openenv_environment_served_by_the_projects_service_is_unavailable_when_its_server_is_gone(server):
    """spec.environment.server serving the plugin: the project's service (service.py) runs the adapter and the
    trainer reaches it over HTTP (remote.py). The OpenEnv server dying under an episode is the infrastructure's fault
    there too: the service answers 503 (retried, then EnvironmentUnavailable: played again), not 422, which the
    trainer scores as the model's fault with errorReward."""
    from echo_env import EchoEnv

    from grpolora.workers.environments.remote import EnvironmentService
    from grpolora.workers.environments.service import build_app
    from tests.workers.rewardserver import AppServer

    factory = openenv_environment(EchoEnv, server.url)
    service = AppServer(build_app(factory)).start()
    client = EnvironmentService(service.url, timeout_seconds=10.0, retries=1)
    try:
        episode, opening = reset_when_free(client, Prompt("a"))
        assert opening.messages == [{"role": "user", "content": READY}]
        server.kill()
        try:
            with pytest.raises(EnvironmentUnavailable, match=r"step\(\): .*HTTP 503: .*OpenEnv server at"):
                episode.step({"role": "assistant", "content": "hello"})
        finally:
            server.start()
        episode.close()
    finally:
        client.close()
        service.stop()
        factory.close()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("offline:smollm2-135m-instruct"))


class KillsTheServerOnce:
    """The replicas, except that while the first turn is generated the OpenEnv server dies and a new one starts on
    its port: the episode's WebSocket is gone before its first step."""

    def __init__(self, replicas, server: OpenEnvServer):
        self.replicas, self.server, self.killed = replicas, server, False

    def __call__(self, replica, prompts, sampling, seeds):
        if not self.killed:
            self.killed = True
            self.server.restart()
        return self.replicas(replica, prompts, sampling, seeds)


def test_an_episode_whose_openenv_server_died_is_played_again_from_an_environment_process(
    echo_env, server, tokenizer, monkeypatch
):
    """As a job runs a plugin: in an environment process beside the trainer (processes.py), its episodes driven by
    the runner. The server dies between the reset and the first step: the adapter's EnvironmentUnavailable must
    reach the runner as one, so the episode is played again on a fresh environment (the new server) and scored on
    its own merit; it crossed the process boundary as an ordinary exception ("the environment raised
    EnvironmentUnavailable"), which the runner scores as the model's fault with errorReward."""
    from grpolora.workers.environments.episode import ChatDelta
    from grpolora.workers.environments.processes import EnvironmentProcesses
    from grpolora.workers.environments.runner import EpisodeLimits, EpisodeRunner
    from tests.workers.test_episodes import PROMPT, ScriptedReplicas

    monkeypatch.setenv("ECHO_URL", server.url)
    spec = EnvironmentSpec(plugin="echo_plugin:echo", processes=1, max_turns=1, episode_retries=1, error_reward=-1.0)
    processes = EnvironmentProcesses(spec).start()
    runner = EpisodeRunner(processes, ChatDelta(tokenizer), EpisodeLimits.of(spec, 16, None))
    replicas = KillsTheServerOnce(ScriptedReplicas(tokenizer, {0: ["hello"]}), server)
    try:
        [[played]] = runner.run([PROMPT], [[1]], [0], Sampling(1, 1.0, 1.0, 8), replicas, replicas=[0], version=1)
    finally:
        runner.close()
    assert replicas.killed
    assert (played.episode.error, played.episode.fault) == (None, None)
    assert played.episode.reward == pytest.approx(0.5)  # the new server's echo of "hello", maxTurns 1
    assert played.episode.messages == [  # one play in the record: the second, on the new server
        {"role": "user", "content": READY},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "hello"},
    ]
