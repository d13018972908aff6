"""The first GPU job, from `helm install` to the adapter in hand, as the README and docs/operations.md walk it: the
example brings what it names, every command of the walk uses the example's namespace and its objects' names, and
the chart's NOTES, the chart README and the docs say what the code does (the RBAC's Secret verbs, the pool
PodMonitor and its label, what runs from a clone, what has run on GPUs)."""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
import yaml

from grpolora.api import constants as c
from grpolora.api.load import load_jobs
from grpolora.api.spec import GRPOLoraJob
from tests.chart.chart import CHART
from tests.helpers import ROOT

GPU_EXAMPLE = ROOT / "examples" / "qwen3-0.6b-gpu.yaml"
README = ROOT / "README.md"
OPERATIONS = ROOT / "docs" / "operations.md"
WALK_TITLE = "## A first GPU job, from `helm install` to the adapter"
OPERATOR_NAMESPACE = "grpo-lora-system"


def section(text: str, title: str) -> str:
    """From the heading `title` to the next heading of its level."""
    start = text.index(title)
    level = title.split(" ", 1)[0]
    end = text.find(f"\n{level} ", start + len(title))
    return text[start : end if end >= 0 else len(text)]


def walk_texts() -> dict[str, str]:
    return {
        "README.md, On a cluster": section(README.read_text(), "## On a cluster"),
        "docs/operations.md, the first GPU job": section(OPERATIONS.read_text(), WALK_TITLE),
    }


def shell_commands(text: str) -> list[list[str]]:
    """The commands of the text's bash blocks and of its inline `kubectl ...` and `grpolora ...` code, as argv
    lists (continuation lines joined, comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [line for block in blocks for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    lines += re.findall(r"`((?:kubectl|grpolora|helm) [^`]+)`", re.sub(r"\s*\n\s*", " ", text))
    found = []
    for line in lines:
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|\|", line):
            try:
                found.append(shlex.split(part))
            except ValueError:
                continue
    return [argv for argv in found if argv and argv[0] in ("kubectl", "grpolora", "helm")]


def namespaces_named(argv: list[str]) -> list[str]:
    named = []
    for i, arg in enumerate(argv):
        if arg in ("-n", "--namespace") and i + 1 < len(argv):
            named.append(argv[i + 1])
        elif arg.startswith(("-n=", "--namespace=")):
            named.append(arg.split("=", 1)[1])
    if argv[:3] == ["kubectl", "create", "namespace"]:
        named.append(argv[3])
    return named


def gpu_documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(GPU_EXAMPLE.read_text()) if d]


def gpu_job() -> GRPOLoraJob:
    (job,) = load_jobs(GPU_EXAMPLE)
    return job


# ---- the example brings what it names -------------------------------------------------------------------------


def test_the_gpu_example_brings_every_claim_it_names_in_its_namespace():
    """`kubectl apply -f examples/qwen3-0.6b-gpu.yaml` alone must leave nothing missing: the review found the
    checkpoint claim shipped nowhere (validate --cluster: "does not exist")."""
    job = gpu_job()
    spec = job.spec
    named = {ref.claim_name for ref in (spec.checkpoint.pvc, spec.output and spec.output.pvc) if ref is not None}
    assert named, "the GPU example keeps its checkpoints and outputs on a claim"
    claims = {
        d["metadata"]["name"]: d for d in gpu_documents() if d["kind"] == "PersistentVolumeClaim"
    }
    assert named <= set(claims)
    for name in named:
        assert claims[name]["metadata"]["namespace"] == job.namespace
        assert claims[name]["spec"]["resources"]["requests"]["storage"]
        # One trainer pod mounts it: ReadWriteOnce, which every storage class offers.
        assert claims[name]["spec"]["accessModes"] == ["ReadWriteOnce"] and spec.trainer.replicas == 1


def test_the_gpu_example_pushes_its_adapter_and_the_walk_creates_the_secret_it_names():
    push = gpu_job().spec.output.push if gpu_job().spec.output else None
    assert push is not None and push.hub is not None and push.hub.secret_name
    creates = [argv for text in walk_texts().values() for argv in shell_commands(text)
               if argv[:4] == ["kubectl", "-n", gpu_job().namespace, "create"]]  # fmt: skip
    secret = next((a for a in creates if a[4:7] == ["secret", "generic", push.hub.secret_name]), None)
    assert secret is not None, f"no walk command creates Secret {push.hub.secret_name}"
    assert any(a.startswith("--from-literal=HF_TOKEN=") for a in secret), "the key the push reads (HubPushSpec)"


# ---- every command of the walk uses the example's namespace and names ---------------------------------------


@pytest.mark.parametrize("where", ["README.md, On a cluster", "docs/operations.md, the first GPU job"])
def test_every_command_of_the_first_job_walk_uses_the_examples_namespace(where):
    """kubectl refuses `apply -n team-a` on a file whose objects say `namespace: rl`; a `get -n team-a` finds
    nothing. The review found the walk in team-a and the example in rl."""
    namespace = gpu_job().namespace
    commands = shell_commands(walk_texts()[where])
    named = {ns for argv in commands for ns in namespaces_named(argv)} - {OPERATOR_NAMESPACE}
    assert named == {namespace}, f"{where}: {sorted(named)}"
    for argv in commands:
        files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-f"] + [a for a in argv if a.endswith(".yaml")]
        for file in {f for f in files if f.startswith("examples/")}:
            for doc in yaml.safe_load_all((ROOT / file).read_text()):
                if doc and "namespace" in doc.get("metadata", {}):
                    assert doc["metadata"]["namespace"] == namespace, f"{where}: {file}"
    # A confined operator must watch that namespace, or the job is silently ignored.
    for argv in commands:
        for arg in argv:
            if arg.startswith("watch.namespaces="):
                assert namespace in arg.split("=", 1)[1].strip("{}").split(","), f"{where}: {arg}"


def test_the_walk_names_the_jobs_own_objects():
    """The logs, /status, TensorBoard and adapter commands name what the operator really creates for the example:
    the trainer Job `<job>-trainer`, its status port, the claim, and the folder the outputs go to (next to the
    checkpoints when spec.output names no folder of its own: GRPOLORA_OUTPUT_DIR unset, workers/trainer/main.py)."""
    job = gpu_job()
    spec = job.spec
    text = re.sub(r"\s+", " ", walk_texts()["docs/operations.md, the first GPU job"])
    name, namespace = job.name, job.namespace
    assert f"kubectl logs -n {namespace} job/{name}-trainer -f" in text
    assert f"kubectl port-forward -n {namespace} job/{name}-trainer {spec.trainer.status_port}" in text
    assert f"curl -s localhost:{spec.trainer.status_port}/status" in text
    outputs = (spec.output.folder if spec.output else None) or spec.checkpoint.path  # OutputSpec.folder
    assert f"--logdir {outputs}/tensorboard" in text
    assert f"{outputs}/final-adapter" in text
    claim = (spec.output.pvc if spec.output and spec.output.pvc else spec.checkpoint.pvc).claim_name
    assert f"claimName: {claim}" in text
    assert f"kubectl cp {namespace}/adapter-copy:/data/final-adapter ./final-adapter" in text
    # The phases a healthy job goes through, by the Reason column (item 5), in order.
    reasons = ["WaitingForPods", "WaitingForTrainer", "Training", "TrainingComplete"]
    positions = [text.find(f"`{r}`") for r in reasons]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), positions


# ---- the chart: NOTES and its README ------------------------------------------------------------------------


def test_notes_name_validate_cluster_and_warn_when_the_worker_images_are_left_unset(chart):
    """Unset, the jobs pull ghcr.io/grpo-lora-operator/worker-*, which no release has published yet."""
    notes = chart.notes()
    assert "grpolora validate --cluster job.yaml" in notes
    assert "WARNING" in notes and "workers.images.gpu" in notes and "workers.images.cpu" in notes
    assert c.DEFAULT_WORKER_IMAGE_GPU in notes
    both = chart.notes({"workers": {"images": {"gpu": "r/worker-gpu:1", "cpu": "r/worker-cpu:1"}}})
    assert "WARNING" not in both
    one = chart.notes({"workers": {"images": {"gpu": "r/worker-gpu:1"}}})
    assert "WARNING" in one and "workers.images.cpu" in one and "workers.images.gpu" not in one


def test_notes_commands_name_the_namespace_where_they_need_one(chart):
    for values, namespace in (({}, "<namespace>"), ({"watch": {"namespaces": ["rl"]}}, "rl")):
        notes = chart.notes(values)
        for line in notes.splitlines():
            if re.search(r"kubectl (describe|logs|apply)\b", line):
                assert f"-n {namespace}" in line, line


def test_the_chart_readme_states_the_operators_secret_verbs_as_the_rbac_grants_them():
    from grpolora.operator.rbac import RULES

    (verbs,) = [rule.verbs for rule in RULES if "secrets" in rule.resources]
    text = re.sub(r"\s+", " ", (CHART / "README.md").read_text())
    said = re.search(r"Secrets only ((?:`\w+`(?:, | and )?)+)", text)
    assert said is not None
    assert re.findall(r"`(\w+)`", said.group(1)) == list(verbs)


# ---- the docs say what the code does ----------------------------------------------------------------------------


def test_the_dashboard_section_names_the_charts_pool_podmonitor_and_the_pool_servers_label():
    """The review: it said a pool's servers are not scraped and to point a PodMonitor of one's own at
    `grpolora.dev/pool` (the examples' node label), while the chart ships `<release>-pools` on
    `grpolora.dev/rollout-pool`."""
    text = re.sub(r"\s+", " ", section(OPERATIONS.read_text(), "## Metrics and the dashboard"))
    assert "are not its targets" not in text and "PodMonitor of your own" not in text
    template = (CHART / "templates" / "podmonitor-pools.yaml").read_text()
    assert f"key: {c.LABEL_POOL}" in template
    assert "`<release>-pools`" in text and f"`{c.LABEL_POOL}`" in text
    for mention in re.findall(r"`grpolora\.dev/pool`[^.]*", text):
        assert "node label" in mention, mention


DOCS = [README, OPERATIONS, ROOT / "docs" / "operator.md", ROOT / "docs" / "tasks.md", CHART / "README.md",
        CHART / "templates" / "NOTES.txt"]  # fmt: skip


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_installs_the_package_from_pypi_where_it_is_not_published(path):
    """release.yaml publishes the images and the chart, never the Python package: outside a clone
    `pip install grpo-lora-operator` fails. What works today is an install from the clone."""
    text = path.read_text()
    assert not re.search(r"pip install ['\"]?grpo-lora-operator", text), path.name
    workflow = (ROOT / ".github" / "workflows" / "release.yaml").read_text()
    assert "pypi" not in workflow.lower(), "published now: let the docs say `pip install grpo-lora-operator`"


def test_the_readme_says_how_to_install_the_cli_from_a_clone():
    text = re.sub(r"\s+", " ", README.read_text())
    assert "pip install -e '.[cluster]'" in text and "not on PyPI" in text


def test_the_readme_says_plainly_what_has_and_has_not_run_on_gpus():
    text = re.sub(r"\s+", " ", section(README.read_text(), "## On a cluster"))
    assert "has run on one H200" in text
    assert "vLLM on a GPU and NCCL between pods have not yet run end to end" in text
    assert text.index("has run on one H200") < text.index("# 0. The images")


@pytest.mark.parametrize("path", [ROOT / "docs" / "operator.md", OPERATIONS], ids=lambda p: p.name)
def test_amd_gpu_is_said_to_be_a_resource_name_only_with_a_rocm_image_of_your_own(path):
    text = re.sub(r"\s+", " ", path.read_text())
    for mention in re.finditer(r"`amd\.com/gpu`", text):
        around = text[mention.start() : mention.start() + 400]
        assert "ROCm" in around and "spec.trainer.image" in around, around



def test_the_operations_metrics_table_lists_every_series_the_operator_guide_lists():
    """docs/operator.md's Metrics table is the operator's series; docs/operations.md's operator row must hold each
    (it lacked grpolora_trainer_status_refused_total)."""
    listed = re.findall(r"^\| `(grpolora_\w+)` \|", section((ROOT / "docs" / "operator.md").read_text(), "## Metrics"),
                        re.M)  # fmt: skip
    assert len(listed) >= 8
    row = next(line for line in OPERATIONS.read_text().splitlines() if line.startswith("| operator |"))
    assert [name for name in listed if name not in row] == []
