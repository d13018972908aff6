"""`grpolora validate | render | crd` as a user runs them (in a subprocess, through the installed entry point)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import yaml

from tests.helpers import EXAMPLES, ROOT, not_checked_lines


def grpolora(*args: str, cwd=ROOT) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("grpolora") or sys.executable
    # -P: from the repo root, `-m` would otherwise put the repo's operator/ before the stdlib's `operator`.
    cmd = [exe, *args] if exe != sys.executable else [exe, "-P", "-m", "grpolora.cli", *args]
    # No hub: validate's model check says it could not ask, the same with or without internet (a test's model `m`
    # exists nowhere).
    environ = os.environ | {"HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=120, env=environ)


def test_validate_accepts_the_examples():
    result = grpolora("validate", *map(str, EXAMPLES))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("is valid") == len(EXAMPLES)


def test_validate_reports_every_error_with_path_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: grpolora.dev/v1alpha1\n"
        "kind: GRPOLoraJob\n"
        "metadata: {name: bad}\n"
        "spec:\n"
        "  model: {name: m}\n"
        "  lora:\n"
        "    rnk: 8\n"
        "  grpo:\n"
        "    generationsPerPrompt: 1\n"
    )
    result = grpolora("validate", str(bad), str(EXAMPLES[0]))
    assert result.returncode == 1
    assert f"{bad}: line 7: spec.lora.rnk: unknown field `rnk` (did you mean `rank`?)" in result.stderr
    assert f"{bad}: line 9: spec.grpo.generationsPerPrompt: Input should be greater than or equal to 2" in (
        result.stderr
    )
    assert "is valid" in result.stdout  # the good file is still checked


def test_validate_reports_yaml_syntax_and_missing_files(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec:\n  model: {name: [x}\n")
    result = grpolora("validate", str(broken), str(tmp_path / "missing.yaml"))
    assert result.returncode == 1
    assert f"{broken}: line 2: YAML syntax error" in result.stderr
    assert "missing.yaml: cannot read file" in result.stderr


def test_render_prints_every_child_object():
    result = grpolora("render", "examples/qwen3-0.6b-gpu.yaml")
    assert result.returncode == 0, result.stderr
    kinds = [o["kind"] for o in yaml.safe_load_all(result.stdout)]
    assert kinds == ["Secret", "Service", "Service", "NetworkPolicy", "PodDisruptionBudget", "Job", "StatefulSet"]


def test_render_refuses_an_invalid_job(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: grpolora.dev/v1alpha1\nkind: GRPOLoraJob\nmetadata: {name: x}\nspec: {}\n")
    result = grpolora("render", str(bad))
    assert result.returncode == 1 and "spec.model: required field is missing" in result.stderr
    assert result.stdout == ""


def test_crd_command_prints_the_shipped_file():
    result = grpolora("crd")
    assert result.returncode == 0
    assert result.stdout == (ROOT / "crds" / "grpolorajobs.grpolora.dev.yaml").read_text()


def test_crd_command_prints_the_rollout_pool_crd_with_kind():
    result = grpolora("crd", "--kind", "RolloutPool")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (ROOT / "crds" / "rolloutpools.grpolora.dev.yaml").read_text()


def _task_job(tmp_path, task: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: grpolora.dev/v1alpha1\nkind: GRPOLoraJob\nmetadata: {name: t}\n"
        f"spec:\n  model: {{name: m}}\n  task: {task}\n"
    )
    return str(path)


def test_validate_checks_reward_plugins_and_datasets_it_can_reach(tmp_path):
    (tmp_path / "rewards.py").write_text("def score(prompt, completion):\n    return 1.0\n")
    (tmp_path / "data.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n{"prompt": ""}\n')
    job = _task_job(tmp_path, "{dataset: {path: data.jsonl}, reward: 'rewards:score'}")
    result = grpolora("validate", job, cwd=tmp_path)
    assert result.returncode == 1 and "is valid" not in result.stdout
    assert "spec.task.reward: 'rewards:score' cannot be called as score(prompt, completion, answer)" in result.stderr
    (tmp_path / "rewards.py").write_text("def score(prompt, completion, answer):\n    return 1.0\n")
    result = grpolora("validate", job, cwd=tmp_path)
    assert result.returncode == 1
    assert "spec.task.dataset.path: line 2: field 'prompt' must be a non-empty string" in result.stderr
    (tmp_path / "data.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n')
    result = grpolora("validate", job, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout and not not_checked_lines(result.stderr)


def test_validate_says_what_it_could_not_check_from_here(tmp_path):
    job = _task_job(tmp_path, "{dataset: {path: /data/train.jsonl}, reward: 'team_rewards.math:score'}")
    result = grpolora("validate", job, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout
    assert "not checked here: spec.task.dataset.path: file not found: /data/train.jsonl" in result.stderr
    assert "not checked here: spec.task.reward: cannot import module 'team_rewards.math'" in result.stderr


def test_a_worker_without_its_env_contract_exits_with_the_invalid_spec_code():
    """The trainer Job's podFailurePolicy fails the job at once on this code (grpolora.api.contract)."""
    from grpolora.api.contract import EXIT_INVALID_SPEC

    result = grpolora("worker", "trainer")
    assert result.returncode == EXIT_INVALID_SPEC and "grpolora worker:" in result.stderr


def two_jobs(tmp_path):
    """A file with two valid jobs (`---`)."""
    text = EXAMPLES[0].read_text()
    second = yaml.safe_load(text)
    second["metadata"]["name"] += "-2"
    path = tmp_path / "two.yaml"
    path.write_text(text + "\n---\n" + yaml.safe_dump(second))
    return path


def test_load_one_job_returns_the_one_job_and_refuses_a_file_with_several(tmp_path):
    from grpolora.api.load import InvalidJob, load_one_job

    assert load_one_job(EXAMPLES[0], "`grpolora run` runs one").metadata.name
    path = two_jobs(tmp_path)
    try:
        load_one_job(path, "`grpolora run` runs one")
    except InvalidJob as exc:
        assert str(exc) == f"{path}: holds 2 jobs; `grpolora run` runs one"
    else:
        raise AssertionError("a file with two jobs was accepted")


def test_eval_and_run_refuse_a_file_with_several_jobs_naming_it(tmp_path):
    path = two_jobs(tmp_path)
    result = grpolora("eval", str(path), "--adapter", str(tmp_path))
    assert result.returncode == 1 and result.stderr.strip() == f"{path}: holds 2 jobs; `grpolora eval` evaluates one"
    result = grpolora("run", str(path))
    assert result.returncode == 1 and result.stderr.strip() == f"{path}: holds 2 jobs; `grpolora run` runs one"


def test_validate_refuses_quantities_the_api_server_refuses_at_their_lines(tmp_path):
    """A negative quantity, a request above its limit: the API server refuses the trainer Job or StatefulSet
    (ValidateResourceRequirements); validate says so before, at the field and its line, errors in line order."""
    job = tmp_path / "job.yaml"
    job.write_text(
        "apiVersion: grpolora.dev/v1alpha1\n"
        "kind: GRPOLoraJob\n"
        "metadata: {name: sized}\n"
        "spec:\n"
        "  model: {name: m}\n"
        "  trainer:\n"
        "    resources:\n"
        "      requests: {memory: 64Gi}\n"
        "      limits: {memory: 32Gi}\n"
        "  inference:\n"
        "    resources:\n"
        "      limits:\n"
        "        memory: -1Gi\n"
    )
    result = grpolora("validate", str(job))
    assert result.returncode == 1 and "is valid" not in result.stdout
    lines = result.stderr.splitlines()
    request = f"{job}: line 8: spec.trainer.resources.requests.memory: Invalid value: " \
        '"64Gi": must be less than or equal to memory limit of 32Gi'  # fmt: skip
    negative = f"{job}: line 13: spec.inference.resources.limits.memory: Invalid value: " \
        '"-1Gi": must be greater than or equal to 0'  # fmt: skip
    assert request in lines and negative in lines, result.stderr
    assert lines.index(request) < lines.index(negative)
