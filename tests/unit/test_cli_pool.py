"""`grpolora validate | render` on RolloutPools, on jobs that run on one, and on files that mix both."""

from __future__ import annotations

import yaml

from grpolora.api.load import InvalidJob, load_documents_from_text
from grpolora.api.spec import GRPOLoraJob, RolloutPool
from tests.helpers import ROOT, not_checked_lines
from tests.unit.test_cli import grpolora

POOL = ROOT / "examples" / "pool" / "qwen3-shared-pool.yaml"
JOB = ROOT / "examples" / "pool" / "sweep-job.yaml"


def kinds_and_names(text: str) -> list[tuple[str, str]]:
    return [(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(text)]


def test_validate_accepts_a_pool_and_a_job_on_it_given_together():
    result = grpolora("validate", str(POOL), str(JOB))
    assert result.returncode == 0, result.stderr
    assert f"{POOL}: RolloutPool rl/qwen3-shared is valid" in result.stdout
    assert f"{JOB}: GRPOLoraJob rl/sweep-lr-1e-5 is valid" in result.stdout
    assert not not_checked_lines(result.stderr)


def test_validate_of_a_job_alone_says_its_fit_to_the_pool_was_not_checked():
    result = grpolora("validate", str(JOB))
    assert result.returncode == 0, result.stderr
    assert "not checked here: spec.inference.poolRef: its fit to RolloutPool rl/qwen3-shared (give" in result.stderr


def test_validate_refuses_a_job_that_does_not_fit_its_pool_naming_the_field_and_both_values(tmp_path):
    mixed = tmp_path / "mixed.yaml"
    job = yaml.safe_load(JOB.read_text())
    job["spec"]["model"]["name"] = "Qwen/Qwen3-1.7B"
    job["spec"]["lora"]["rank"] = 64
    mixed.write_text(POOL.read_text() + "---\n" + yaml.safe_dump(job))
    result = grpolora("validate", str(mixed))
    assert result.returncode == 1
    assert (
        f"{mixed}: GRPOLoraJob rl/sweep-lr-1e-5: spec.model.name: is 'Qwen/Qwen3-1.7B' but RolloutPool qwen3-shared "
        "serves 'Qwen/Qwen3-0.6B'" in result.stderr
    )
    assert "spec.lora.rank: 64 is above RolloutPool qwen3-shared's maxLoraRank (32)" in result.stderr
    assert "RolloutPool rl/qwen3-shared is valid" in result.stdout


def test_pool_errors_name_the_field_and_line_with_the_pool_fields_as_hints(tmp_path):
    bad = tmp_path / "pool.yaml"
    bad.write_text(
        "apiVersion: grpolora.dev/v1alpha1\n"
        "kind: RolloutPool\n"
        "metadata: {name: p}\n"
        "spec:\n"
        "  model: {name: m}\n"
        "  maxJob: 3\n"
        "  maxLoraRank: 12\n"
    )
    result = grpolora("validate", str(bad))
    assert result.returncode == 1
    assert f"{bad}: line 6: spec.maxJob: unknown field `maxJob` (did you mean `maxJobs`?)" in result.stderr
    assert f"{bad}: line 7: spec.maxLoraRank: 12 is not a vLLM LoRA slot size" in result.stderr


def test_load_documents_reads_both_kinds_in_order_and_names_a_bad_document():
    docs = load_documents_from_text(POOL.read_text() + "---\n" + JOB.read_text())
    assert [type(d) for d in docs] == [RolloutPool, GRPOLoraJob]
    try:
        load_documents_from_text(POOL.read_text().replace("replicas: 2", "replicas: 0") + "---\n" + JOB.read_text())
    except InvalidJob as exc:
        assert [p.path for p in exc.problems] == ["spec.replicas"]
        assert str(exc.problems[0]).startswith("line 12: spec.replicas: document 1: ")
    else:
        raise AssertionError("replicas: 0 was accepted")


def test_render_a_pool_prints_its_children():
    result = grpolora("render", str(POOL))
    assert result.returncode == 0, result.stderr
    assert kinds_and_names(result.stdout) == [
        ("Secret", "qwen3-shared-pool-jobs"),
        ("Service", "qwen3-shared-pool"),
        ("NetworkPolicy", "qwen3-shared-pool"),
        ("PodDisruptionBudget", "qwen3-shared-pool"),
        ("StatefulSet", "qwen3-shared-pool"),
    ]


def test_render_a_job_on_a_pool_takes_the_pool_from_another_file():
    result = grpolora("render", str(JOB), str(POOL))
    assert result.returncode == 0, result.stderr
    objects = kinds_and_names(result.stdout)
    assert objects[:4] == [
        ("Secret", "sweep-lr-1e-5-grpolora-token"),
        ("Service", "sweep-lr-1e-5-trainer"),
        ("NetworkPolicy", "sweep-lr-1e-5"),
        ("Job", "sweep-lr-1e-5-trainer"),
    ]
    assert objects[-1] == ("StatefulSet", "qwen3-shared-pool")
    trainer = list(yaml.safe_load_all(result.stdout))[3]["spec"]["template"]["spec"]["containers"][0]
    endpoints = next(e["value"] for e in trainer["env"] if e["name"] == "GRPOLORA_INFERENCE_ENDPOINTS")
    assert endpoints.startswith("http://qwen3-shared-pool-0.qwen3-shared-pool.rl.svc:8000,")


def test_render_a_job_on_a_pool_without_the_pool_says_what_is_missing():
    result = grpolora("render", str(JOB))
    assert result.returncode == 1 and result.stdout == ""
    assert (
        f"{JOB}: GRPOLoraJob rl/sweep-lr-1e-5: spec.inference.poolRef.name: names RolloutPool rl/qwen3-shared, "
        "which none of the files given holds; give its file too (grpolora render JOB_FILE POOL_FILE)"
    ) in result.stderr


def test_render_refuses_a_job_that_does_not_fit_naming_the_field(tmp_path):
    job = yaml.safe_load(JOB.read_text())
    job["spec"]["model"]["dtype"] = "float32"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    result = grpolora("render", str(path), str(POOL))
    assert result.returncode == 1 and result.stdout == ""
    assert "spec.model.dtype: is 'float32' but RolloutPool qwen3-shared serves 'bfloat16'" in result.stderr


def test_eval_of_a_job_on_a_pool_needs_the_pool_for_its_serving_fields(tmp_path):
    """`grpolora eval` starts an engine like the pool's (its GPUs, lengths, slots): without the pool's file it would
    have started one from the defaults a job on a pool leaves unset."""
    result = grpolora("eval", str(JOB), "--adapter", str(tmp_path))
    assert result.returncode == 1
    assert (
        f"{JOB}: GRPOLoraJob rl/sweep-lr-1e-5: spec.inference.poolRef.name: names RolloutPool rl/qwen3-shared, which "
        "none of the files given holds; give its file too (grpolora eval JOB_FILE POOL_FILE)"
    ) in result.stderr
    job = yaml.safe_load(JOB.read_text())
    job["spec"]["lora"]["rank"] = 64
    mismatched = tmp_path / "job.yaml"
    mismatched.write_text(yaml.safe_dump(job))
    result = grpolora("eval", str(mismatched), str(POOL), "--adapter", str(tmp_path))
    assert result.returncode == 1
    assert "spec.lora.rank: 64 is above RolloutPool qwen3-shared's maxLoraRank (32)" in result.stderr
