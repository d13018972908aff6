"""spec.environment (issue 39): a multi-turn environment beside spec.task, each rule's error naming its field and
what would be valid, in `grpolora validate` and in the CRD."""

from __future__ import annotations

import pytest

from grpolora.api import constants as c
from grpolora.api.crd import crd
from grpolora.api.load import InvalidJob, parse_job
from grpolora.api.spec import GRPOLoraJobSpec
from tests.helpers import job_doc


def problems_of(doc) -> list[str]:
    with pytest.raises(InvalidJob) as info:
        parse_job(doc)
    return [str(p) for p in info.value.problems]


def test_no_environment_by_default_and_the_builtin_defaults():
    assert parse_job(job_doc()).spec.environment is None
    env = parse_job(job_doc(environment={"builtin": "calculator"})).spec.environment
    assert (env.builtin, env.plugin, env.max_turns, env.max_episode_tokens, env.step_timeout_seconds) == (
        "calculator", None, 4, 1024, 30.0,
    )  # fmt: skip
    # What reaches the workers (defaults written) parses to the same environment.
    wire = parse_job(job_doc(environment={"builtin": "calculator"})).spec.to_wire()
    assert GRPOLoraJobSpec.model_validate(wire).environment == env


def test_a_plugin_environment():
    env = parse_job(job_doc(environment={"plugin": "my_envs.guess:make", "maxTurns": 8})).spec.environment
    assert (env.plugin, env.max_turns) == ("my_envs.guess:make", 8)


def test_a_remote_environment_service():
    env = parse_job(job_doc(environment={"url": "http://env.rl.svc:8000", "retries": 3,
                                         "headersFrom": {"secretName": "env-auth"}})).spec  # fmt: skip
    assert (env.environment.url, env.environment.retries, env.environment.headers_from.secret_name) == (
        "http://env.rl.svc:8000", 3, "env-auth",
    )  # fmt: skip
    # The Secret is one the job names: the operator mounts it in the trainer, where the runner reads it.
    assert ("environment.headersFrom.secretName", "env-auth") in env.secret_references()
    assert parse_job(job_doc(environment={"url": "https://envs.example.com/calc"})).spec.environment.retries == 2


@pytest.mark.parametrize(
    ("environment", "path", "says"),
    [
        ({}, "spec.environment", "exactly one of `builtin`"),
        ({"builtin": "calculator", "url": "http://e"}, "spec.environment", "exactly one of `builtin`"),
        ({"url": "env.svc:8000"}, "spec.environment.url", "should match pattern"),
        ({"builtin": "calculator", "retries": 3}, "spec.environment.retries", "applies to an environment service only"),
        ({"plugin": "a:b", "headersFrom": {"secretName": "s"}}, "spec.environment.headersFrom", "service only"),
        ({"url": "http://e", "retries": c.MAX_RETRIES + 1}, "spec.environment.retries", "less than or equal"),
        ({"builtin": "calculator", "plugin": "a:b"}, "spec.environment", "exactly one of `builtin`"),
        ({"builtin": "chess"}, "spec.environment.builtin", "valid: calculator"),
        ({"plugin": "not a ref"}, "spec.environment.plugin", "package.module:factory"),
        ({"builtin": "calculator", "maxTurns": 0}, "spec.environment.maxTurns", "greater than 0"),
        ({"builtin": "calculator", "maxTurns": c.MAX_EPISODE_TURNS + 1}, "spec.environment.maxTurns", "less than"),
        ({"builtin": "calculator", "maxEpisodeTokens": 0}, "spec.environment.maxEpisodeTokens", "greater than 0"),
        ({"builtin": "calculator", "stepTimeoutSeconds": 0}, "spec.environment.stepTimeoutSeconds", "greater"),
        ({"builtin": "calculator", "turns": 3}, "spec.environment.turns", "did you mean `maxTurns`"),
        ({"agent": "not a ref"}, "spec.environment.agent", "package.module:function"),
        ({"agent": "a:b", "plugin": "a:c"}, "spec.environment", "exactly one of `builtin`"),
        ({"server": {"replicas": 2}}, "spec.environment.server.command", "serves the job's `builtin` or `plugin`"),
        ({"url": "http://e", "server": {"command": ["s"]}}, "spec.environment.server", "set one of them"),
        ({"plugin": "a:b", "server": {}, "processes": 8}, "spec.environment.processes", "beside the trainer only"),
        ({"plugin": "a:b", "server": {"runtimeClassName": "Kata!"}}, "spec.environment.server.runtimeClassName",
         "should match pattern"),
        ({"plugin": "a:b", "server": {"egress": [{"ports": "all"}]}}, "spec.environment.server.egress[0].ports", ""),
        ({"plugin": "a:b", "server": {"env": [{"name": "GRPOLORA_JOB_NAME", "value": "x"}]}},
         "spec.environment.server.env[0].name", "set by the operator"),
    ],
)
def test_bad_environments_name_the_field(environment, path, says):
    problems = problems_of(job_doc(environment=environment))
    assert any(p.startswith(f"{path}:") and says in p for p in problems), problems


def test_episode_budget_must_fit_the_model_length_and_hold_a_turn():
    problems = problems_of(
        job_doc(environment={"builtin": "calculator", "maxEpisodeTokens": 4096}, inference={"maxModelLen": 2048})
    )
    assert any(p.startswith("spec.environment.maxEpisodeTokens:") and "2048" in p for p in problems), problems
    problems = problems_of(job_doc(environment={"builtin": "calculator", "maxEpisodeTokens": 100}))
    assert any(p.startswith("spec.environment.maxEpisodeTokens:") and "maxNewTokens" in p for p in problems), problems


def test_an_environment_job_evaluates_its_episodes():
    # Evaluation plays one episode per held-out prompt (test_episodes.py checks how it is scored).
    spec = parse_job(job_doc(environment={"builtin": "calculator"}, eval={"everySteps": 5})).spec
    assert spec.eval.every_steps == 5 and spec.environment.builtin == "calculator"


def test_the_crd_carries_the_environment_and_its_bounds():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    env = schema["environment"]["properties"]
    assert env["maxTurns"]["maximum"] == c.MAX_EPISODE_TURNS and env["maxTurns"].get("exclusiveMinimum", True)
    assert env["maxEpisodeTokens"]["maximum"] == c.MAX_MODEL_LEN
    assert env["builtin"]["enum"] == list(c.BUILTIN_ENVIRONMENTS)
    assert env["plugin"]["pattern"]


def _environment_job(tmp_path, environment: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: grpolora.dev/v1alpha1\nkind: GRPOLoraJob\nmetadata: {name: t}\n"
        f"spec:\n  model: {{name: m}}\n  environment: {environment}\n"
    )
    return str(path)


def test_validate_loads_the_environment_plugin_it_can_reach(tmp_path):
    from tests.unit.test_cli import grpolora

    (tmp_path / "games.py").write_text("class Guess:\n    def reset(self, prompt):\n        return []\n")
    job = _environment_job(tmp_path, "{plugin: 'games:Guess'}")
    result = grpolora("validate", job, cwd=tmp_path)
    assert result.returncode == 1 and "is valid" not in result.stdout
    assert "spec.environment.plugin: games:Guess() made a Guess without step" in result.stderr
    step = "    def step(self, message):\n        return []\n"
    (tmp_path / "games.py").write_text("class Guess:\n    def reset(self, prompt):\n        return []\n" + step)
    result = grpolora("validate", job, cwd=tmp_path)
    assert result.returncode == 0 and "is valid" in result.stdout, result.stderr
    result = grpolora("validate", _environment_job(tmp_path, "{plugin: 'team_envs.sandbox:make'}"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "not checked here: spec.environment.plugin: cannot import module 'team_envs.sandbox'" in result.stderr
