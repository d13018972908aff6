"""The torch-free install as a user gets it: `pip install grpo-lora-operator` (and `[operator]`, what the operator
image installs) in a fresh venv, without the workers extra. pyproject.toml and `grpolora --help` promise that
`validate`, `render` and `crd` work there; `run` and `eval` must say which extra to install, never a traceback.

The venv is real (its packages come from the package index, as CI's do), so this is the one place where a heavy
import slipping into a light command path shows: the full test venv has every module."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.helpers import ROOT

EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.yaml"))


@pytest.fixture(scope="module")
def light(tmp_path_factory) -> Path:
    """A venv with the base install only: the project's wheel (built here from the source tree) and its declared
    base dependencies, nothing else."""
    root = tmp_path_factory.mktemp("light")
    # Built from a copy of what the wheel is made of: setuptools writes build/ and *.egg-info into the source tree.
    source = root / "source"
    for folder in ("grpolora", "operator", "workers"):  # pyproject.toml's package-dir
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # With build isolation, as a user's `pip install` builds it: the build backend pyproject.toml asks for comes from
    # the package index, whatever setuptools this venv happens to carry.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", root / "wheel", source], check=True, cwd=root
    )
    (wheel,) = (root / "wheel").glob("*.whl")
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    pip = [root / "venv" / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, wheel], check=True, cwd=root)
    return root / "venv"


def grpolora(venv_dir: Path, *args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [venv_dir / "bin" / "grpolora", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=environ
    )


def test_the_base_install_has_no_ml_stack(light):
    probe = "import importlib.util as u; print([m for m in ('numpy', 'torch', 'httpx', 'kopf') if u.find_spec(m)])"
    out = subprocess.run([light / "bin" / "python", "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def check_light_commands(venv_dir: Path) -> None:
    # Every example in one invocation per command (they are read as one set, as `kubectl apply -f a -f b` reads
    # them): each process start costs more than the checks, and one process meets every import a light command
    # path makes, whatever example leads there.
    validated = grpolora(venv_dir, "validate", *EXAMPLES)
    assert validated.returncode == 0 and "Traceback" not in validated.stderr, validated.stderr
    for example in EXAMPLES:
        assert f"{example}: " in validated.stdout, (example, validated.stdout)
    assert validated.stdout.count(" is valid") == len(validated.stdout.splitlines()) >= len(EXAMPLES)
    rendered = grpolora(venv_dir, "render", *EXAMPLES)
    assert rendered.returncode == 0 and "Traceback" not in rendered.stderr, rendered.stderr
    assert "kind: StatefulSet" in rendered.stdout and "kind: Job" in rendered.stdout
    for kind in ("GRPOLoraJob", "RolloutPool", "GRPOLoraRuntime", "ClusterGRPOLoraRuntime"):
        crd = grpolora(venv_dir, "crd", "--kind", kind)
        assert crd.returncode == 0 and "CustomResourceDefinition" in crd.stdout, crd.stderr


def test_validate_render_and_crd_work_on_every_example_without_the_workers_extra(light):
    check_light_commands(light)
    # A reward plugin and a local dataset need the workers extra to be checked: said as "not checked here", as
    # for a file that cannot be reached, and the job is still valid.
    validated = grpolora(light, "validate", ROOT / "examples" / "gsm8k-data.yaml")
    assert "not checked here: spec.task.reward" in validated.stderr, validated.stderr
    assert "pip install 'grpo-lora-operator[workers]'" in validated.stderr


def test_run_and_eval_name_the_extra_to_install(light, tmp_path):
    for args in (("run", "examples/quickstart.yaml"), ("eval", "examples/quickstart.yaml", "--adapter", tmp_path)):
        result = grpolora(light, *args)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        assert "pip install 'grpo-lora-operator[workers]'" in result.stderr, result.stderr


def test_a_file_that_is_not_utf8_is_refused_with_its_name_and_the_byte(light, tmp_path):
    job = (ROOT / "examples" / "quickstart.yaml").read_text(encoding="utf-8")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(("# Café au lait\n" + job).encode("latin-1"))
    for command in ("validate", "render"):
        result = grpolora(light, command, latin1)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert f"{latin1}: line 1: not UTF-8 text: byte 0xe9 at position 5" in result.stderr, result.stderr


def test_the_operator_extra_runs_the_same_commands(light):
    """What the operator image installs ([operator]): the same light commands, now with Kopf and aiohttp there."""
    pip = [light / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    config = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    import tomllib

    subprocess.run([*pip, *tomllib.loads(config)["project"]["optional-dependencies"]["operator"]], check=True)
    check_light_commands(light)
