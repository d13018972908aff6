"""`grpolora validate` checks a job file as the API server will at `kubectl apply`: a string where the CRD says
integer or number is refused at its field, an error under a dotted key (`nvidia.com/gpu.product`) points at its own
line, documents of other kinds in the same file (the job's PersistentVolumeClaim) are skipped with a note, and
`--strict` never says "is valid" of a file it fails.

The files are written as people write them (tests/unit/test_cli_conventions.py runs the command in process)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from grpolora.api import constants as c
from grpolora.api.crd import crd
from grpolora.api.load import InvalidJob, load_documents_from_text
from tests.unit.test_cli_conventions import run

JOB = """\
apiVersion: grpolora.dev/v1alpha1
kind: GRPOLoraJob
metadata:
  name: qwen3-first
  namespace: rl
spec:
  model:
    name: Qwen/Qwen3-0.6B
  task:
    name: arithmetic
  grpo:
    steps: {steps}
  trainer:
    gpusPerReplica: {gpus}
    nodeSelector:
      grpolora.dev/pool: trainer
      nvidia.com/gpu.product: {product}
    resources:
      requests: {{cpu: "8", memory: 64Gi}}
  inference:
    resources:
      requests: {{cpu: "8", memory: 48Gi}}
  checkpoint:
    pvc: {{claimName: qwen3-first-checkpoints}}
"""

PVC = """\
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: qwen3-first-checkpoints
  namespace: rl
spec:
  accessModes: [ReadWriteOnce]
  resources:
    requests: {storage: 50Gi}
"""


def job_file(tmp_path, *, steps: str = "200", gpus: str = "1", product: str = "NVIDIA-H100-80GB-HBM3", extra=""):
    path = tmp_path / "job.yaml"
    path.write_text(JOB.format(steps=steps, gpus=gpus, product=product) + extra)
    return path


def line_of(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_the_files_as_written_are_valid(tmp_path, capsys):
    code, out, err = run(capsys, "validate", str(job_file(tmp_path)))
    assert code == 0, err
    assert out == f"{tmp_path / 'job.yaml'}: GRPOLoraJob rl/qwen3-first is valid\n"


def test_a_quoted_integer_is_refused_where_the_crd_says_integer(tmp_path, capsys):
    path = job_file(tmp_path, steps='"200"', gpus='"1"')
    code, out, err = run(capsys, "validate", str(path))
    assert code == 1 and "is valid" not in out
    assert (
        f"{path}: line {line_of(path, 'steps:')}: spec.grpo.steps: expected an integer, got the string '200' "
        "(the CRD says integer; the API server refuses a string): write 200 without quotes"
    ) in err
    assert f"{path}: line {line_of(path, 'gpusPerReplica:')}: spec.trainer.gpusPerReplica: expected an integer" in err


def test_a_quoted_number_is_refused_where_the_crd_says_number(tmp_path, capsys):
    path = job_file(tmp_path, extra="  tracking: {}\n")
    path.write_text(path.read_text().replace("    steps: 200\n", '    steps: 200\n    learningRate: "5e-5"\n'))
    code, _, err = run(capsys, "validate", str(path))
    assert code == 1
    assert "spec.grpo.learningRate: expected a number, got the string '5e-5'" in err


def _scalar_paths(schema: dict[str, Any], path: str) -> Iterator[tuple[str, str]]:
    """(dotted path, type) of every integer or number field of a CRD schema, outside lists and free-form objects."""
    for name, prop in (schema.get("properties") or {}).items():
        at = f"{path}.{name}"
        if prop.get("type") in ("integer", "number"):
            yield at, prop["type"]
        elif prop.get("type") == "object":
            yield from _scalar_paths(prop, at)


CRD_SCALARS = sorted(_scalar_paths(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"],
                                   "spec"))  # fmt: skip


def test_the_crd_has_integer_and_number_fields_to_check():
    paths = dict(CRD_SCALARS)
    assert paths["spec.grpo.steps"] == "integer" and paths["spec.trainer.gpusPerReplica"] == "integer"
    assert paths["spec.grpo.learningRate"] == "number"


@pytest.mark.parametrize(("path", "kind"), CRD_SCALARS)
def test_every_integer_and_number_of_the_crd_refuses_a_string(path, kind):
    """One source: the CRD generated from grpolora.api.spec says which fields are numbers; each refuses "1"."""
    doc = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "j"}, "spec": {"model": {"name": "m"}}}
    node = doc
    for part in path.split(".")[:-1]:
        node = node.setdefault(part, {})
    node[path.rsplit(".", 1)[1]] = "1"
    with pytest.raises(InvalidJob) as info:
        load_documents_from_text(json.dumps(doc))
    wanted = "an integer" if kind == "integer" else "a number"
    assert f"{path}: expected {wanted}, got the string '1'" in str(info.value)


def test_an_error_under_a_dotted_key_is_reported_at_its_own_line(tmp_path, capsys):
    path = job_file(tmp_path, product="5")
    code, _, err = run(capsys, "validate", str(path))
    assert code == 1
    line = line_of(path, "nvidia.com/gpu.product")
    assert line == line_of(path, "nodeSelector:") + 2  # the mapping starts a line earlier, at its first label
    assert f"line {line}: spec.trainer.nodeSelector.nvidia.com/gpu.product: Input should be a valid string" in err


def test_a_file_with_the_job_and_its_claim_checks_the_job_and_skips_the_claim_with_a_note(tmp_path, capsys):
    path = job_file(tmp_path, extra="---\n" + PVC)
    code, out, err = run(capsys, "validate", str(path))
    assert code == 0, err
    assert out == f"{path}: GRPOLoraJob rl/qwen3-first is valid\n"
    line = line_of(path, "kind: PersistentVolumeClaim") - 1  # the document starts at its apiVersion
    hubless = [line for line in err.splitlines() if "on the hub (could not check:" not in line]
    assert hubless == [
        f"{path}: note: line {line}: PersistentVolumeClaim rl/qwen3-first-checkpoints (document 2): not a "
        f"{c.GROUP} kind, not checked here (kubectl apply checks it)"
    ]
    code, out, _ = run(capsys, "validate", "-o", "json", str(path))
    report = json.loads(out)
    assert code == 0 and report["valid"] is True
    assert report["skipped"] == [
        {"file": str(path), "line": line, "kind": "PersistentVolumeClaim", "namespace": "rl",
         "name": "qwen3-first-checkpoints"}
    ]  # fmt: skip


def test_render_of_the_job_and_its_claim_renders_the_job(tmp_path, capsys):
    path = job_file(tmp_path, extra="---\n" + PVC)
    code, out, err = run(capsys, "render", str(path))
    assert code == 0, err
    assert "kind: StatefulSet" in out and "PersistentVolumeClaim rl/qwen3-first-checkpoints" in err


def test_a_document_of_our_group_with_an_unknown_kind_is_still_an_error(tmp_path, capsys):
    path = job_file(tmp_path)
    path.write_text(path.read_text().replace("kind: GRPOLoraJob", "kind: GRPOLoraJobs"))
    code, _, err = run(capsys, "validate", str(path))
    assert code == 1 and "kind: Input should be 'GRPOLoraJob'" in err


def test_strict_does_not_say_valid_of_a_file_it_fails(tmp_path, capsys):
    path = job_file(tmp_path)
    path.write_text(path.read_text().replace("  task:\n    name: arithmetic\n", ""))  # warned: no task
    code, out, err = run(capsys, "validate", str(path))
    assert code == 0 and "is valid" in out and ": spec.task: not set" in err
    code, out, err = run(capsys, "validate", "--strict", str(path))
    assert code == 1
    assert "is valid" not in out
    assert "warning: line 7: spec.task: not set" in err  # the job's line for the task nobody wrote
    assert f"{path}: GRPOLoraJob rl/qwen3-first: fails --strict: 1 warning" in err
    code, out, _ = run(capsys, "validate", "--strict", "-o", "json", str(path))
    report = json.loads(out)
    assert code == 1 and report["valid"] is False and report["items"][0]["valid"] is False


def test_a_plain_exponent_number_outside_a_number_field_is_a_number_as_kubectl_reads_it(tmp_path, capsys):
    """`1e5` is a number to kubectl (YAML 1.2), a string to PyYAML: in an env var's value the API server refuses it,
    and so does validate; quoted, it is a string to both, and render prints it."""
    path = job_file(tmp_path)
    text = path.read_text().replace(
        "    gpusPerReplica: 1\n", "    gpusPerReplica: 1\n    env: [{name: X, value: 1e5}]\n"
    )
    path.write_text(text)
    code, _, err = run(capsys, "validate", str(path))
    assert code == 1
    assert (
        f"line {line_of(path, 'name: X')}: spec.trainer.env[0].value: Invalid value: 100000.0: expected string" in err
    )
    path.write_text(text.replace("value: 1e5", 'value: "1e5"'))
    code, out, err = run(capsys, "render", str(path))
    assert code == 0, err
    assert "value: '1e5'" in out  # quoted: kubectl (YAML 1.2) would read a plain 1e5 as a number


@pytest.mark.parametrize("value", ["0o17", "0O17", "0X1F", "0B101", "-0o7"])
def test_render_quotes_the_strings_kubectl_would_read_as_go_integers(tmp_path, capsys, value):
    """kubectl's YAML reader (sigs.k8s.io/yaml, a go-yaml v2 fork) resolves a plain scalar that Go's
    strconv.ParseInt(s, 0, 64) accepts as an integer, and that takes the 0o, 0O, 0X and 0B prefixes; PyYAML (YAML
    1.1) reads these as strings and would write them plain. Quoted in the job, they must reach the API server as
    strings."""
    path = job_file(tmp_path)
    path.write_text(
        path.read_text().replace(
            "    gpusPerReplica: 1\n", f'    gpusPerReplica: 1\n    env: [{{name: X, value: "{value}"}}]\n'
        )
    )
    code, out, err = run(capsys, "render", str(path))
    assert code == 0, err
    assert f"value: '{value}'" in out
