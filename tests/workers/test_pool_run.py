"""`grpolora run pool.yaml job-a.yaml job-b.yaml`: one RolloutPool's server and two jobs' trainers on one Ray
cluster, each job in its own folder under --run-dir.

Without engines: what the command refuses before anything starts (every message names the file, the field and
both values). End to end (vllm): both jobs train to the end on one shared vLLM CPU replica."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from grpolora.cli import main
from grpolora.workers.launcher.local import read_run_files

MODEL = {"name": "offline:tiny-llama", "dtype": "float32"}
POOL = {
    "apiVersion": "grpolora.dev/v1alpha1",
    "kind": "RolloutPool",
    "metadata": {"name": "shared"},
    "spec": {"model": MODEL, "replicas": 1, "gpusPerReplica": 0, "kvCacheGiB": 1, "maxModelLen": 256, "maxJobs": 2},
}


def job(name: str, **grpo) -> dict:
    return {
        "apiVersion": "grpolora.dev/v1alpha1",
        "kind": "GRPOLoraJob",
        "metadata": {"name": name},
        "spec": {
            "model": MODEL,
            "lora": {"rank": 8, "alpha": 16},
            "grpo": {"steps": 3, "promptsPerStep": 2, "generationsPerPrompt": 4, "maxNewTokens": 16} | grpo,
            "task": {"name": "keyword"},
            "trainer": {"gpusPerReplica": 0},
            "inference": {"poolRef": {"name": "shared"}},
            "sync": {"backend": "gloo", "timeoutSeconds": 60},
        },
    }


def write(folder: Path, name: str, *documents: dict) -> str:
    path = folder / name
    path.write_text(yaml.safe_dump_all(documents))
    return str(path)


def grpolora_run(capsys, *files: str, run_dir: Path) -> tuple[int, str]:
    code = main(["run", *files, "--run-dir", str(run_dir)])
    return code, capsys.readouterr().err


# --- refused before anything starts ---


def test_a_job_that_does_not_fit_the_pool_is_refused_naming_file_field_and_both_values(tmp_path, capsys):
    pool = write(tmp_path, "pool.yaml", POOL)
    a = write(tmp_path, "job-a.yaml", job("a"))
    other = job("b")
    other["spec"]["model"] = {"name": "offline:tiny-llama", "dtype": "bfloat16"}
    other["spec"]["lora"]["rank"] = 32
    b = write(tmp_path, "job-b.yaml", other)
    code, err = grpolora_run(capsys, pool, a, b, run_dir=tmp_path / "run")
    assert code == 1
    assert f"{b}: spec.model.dtype: is 'bfloat16' but RolloutPool shared serves 'float32' ({pool})" in err
    assert f"{b}: spec.lora.rank: 32 is above RolloutPool shared's maxLoraRank (16)" in err
    assert "job-a.yaml" not in err  # the job that fits is not named
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.parametrize(
    ("documents", "words"),
    [
        ([job("a"), job("b")], "all.yaml: holds 2 jobs; `grpolora run` runs one"),
        ([job("a")], "spec.inference.poolRef.name: a runs on RolloutPool shared; give that pool's file too"),
        ([POOL, {**job("a"), "spec": {**job("a")["spec"], "inference": {"replicas": 1}}}],
         "spec.inference.poolRef: not set, but this run serves its jobs from RolloutPool shared"),
        ([POOL, {**job("a"), "spec": {**job("a")["spec"], "inference": {"poolRef": {"name": "other"}}}}],
         "spec.inference.poolRef.name: names RolloutPool default/other, but the pool given is default/shared"),
        ([POOL, job("a"), job("a")], "metadata.name: a is also the name of a job in"),
        ([POOL, {**POOL, "metadata": {"name": "second"}}, job("a")], "a run has one RolloutPool"),
        ([POOL], "no GRPOLoraJob in the files given"),
    ],
)  # fmt: skip
def test_files_that_cannot_run_together_are_refused(tmp_path, capsys, documents, words):
    path = write(tmp_path, "all.yaml", *documents)
    code, err = grpolora_run(capsys, path, run_dir=tmp_path / "run")
    assert code == 1 and words in err, err
    assert not (tmp_path / "run").exists()


def test_a_bad_pool_document_names_its_field(tmp_path, capsys):
    bad = copy.deepcopy(POOL)
    bad["spec"]["maxLoraRank"] = 12
    code, err = grpolora_run(capsys, write(tmp_path, "all.yaml", bad, job("a")), run_dir=tmp_path / "run")
    assert code == 1 and "document 1: " in err and "spec.maxLoraRank" in err and "not a vLLM LoRA slot size" in err


def test_jobs_in_several_files_without_a_pool_are_refused(tmp_path, capsys):
    files = [write(tmp_path, f"job-{name}.yaml", job(name)) for name in "ab"]
    code, err = grpolora_run(capsys, *files, run_dir=tmp_path / "run")
    assert code == 1 and "2 jobs but no RolloutPool: jobs run together on a shared pool" in err


def test_one_file_may_hold_the_pool_and_its_jobs(tmp_path):
    given = read_run_files([write(tmp_path, "all.yaml", job("a"), POOL, job("b"))])
    assert [p.name for _, p in given.pools] == ["shared"]
    assert [j.name for _, j in given.jobs] == ["a", "b"]
