"""Outputs that survive the pod: the final adapter names its base model and revision (config and card), and is
pushed to an S3-compatible store (a moto server on loopback) with credentials from a mounted Secret."""

from __future__ import annotations

import json

import pytest
import torch

from grpolora.api.load import parse_job
from grpolora.workers.trainer import outputs
from tests.helpers import job_doc
from tests.workers.trackservers import s3_server

TENSORS = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(2, 4)}
CONFIG = {"peft_type": "LORA", "r": 2, "base_model_name_or_path": "/cache/models/local-copy", "revision": None}


@pytest.fixture(scope="module")
def s3():
    with s3_server() as endpoint:
        yield endpoint


def spec(**fields):
    return parse_job(job_doc(**fields)).spec


def test_final_adapter_names_its_base_model_and_revision(tmp_path):
    job = spec(model={"name": "Qwen/Qwen3-0.6B", "revision": "c1899de"})
    folder = outputs.save_adapter(tmp_path / "final-adapter", TENSORS, CONFIG, job, step=12, job_name="demo")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "Qwen/Qwen3-0.6B" and config["revision"] == "c1899de"
    card = (folder / "README.md").read_text()
    assert "base_model: Qwen/Qwen3-0.6B" in card and "revision `c1899de`" in card and "steps: 12" in card
    assert (folder / "adapter_model.safetensors").exists()


def test_push_to_s3_with_credentials_from_a_secret(tmp_path, s3, monkeypatch):
    import boto3

    secret = tmp_path / "secrets" / "s3-creds"
    secret.mkdir(parents=True)
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        (secret / key).write_text(value)
    monkeypatch.setenv("GRPOLORA_SECRETS_DIR", str(tmp_path / "secrets"))
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3", endpoint_url=s3, aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket="results")
    job = spec(output={"push": {"s3": {"url": "s3://results/runs/demo", "endpointUrl": s3, "secretName": "s3-creds"}}})
    folder = outputs.save_adapter(tmp_path / "final-adapter", TENSORS, CONFIG, job, step=3, job_name="demo")
    assert outputs.push(folder, job, "final-adapter") == "s3://results/runs/demo/final-adapter"
    assert outputs.push(folder, job, "final-adapter") == "s3://results/runs/demo/final-adapter"  # replaced whole
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="results")["Contents"])
    assert keys == [f"runs/demo/final-adapter/{n}" for n in ("README.md", "adapter_config.json",
                                                              "adapter_model.safetensors")]  # fmt: skip
    body = client.get_object(Bucket="results", Key="runs/demo/final-adapter/adapter_config.json")["Body"].read()
    assert json.loads(body)["base_model_name_or_path"] == job.model.name


def test_a_failed_push_names_the_destination(tmp_path, s3, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    job = spec(output={"push": {"s3": {"url": "s3://no-such-bucket/x", "endpointUrl": s3}}})
    folder = outputs.save_adapter(tmp_path / "a", TENSORS, CONFIG, job, step=1, job_name="demo")
    with pytest.raises(
        outputs.PushError,
        match=r"^spec.output.push.s3: cannot copy the adapter to s3://no-such-b.*'no-such-bucket' does not exist",
    ):
        outputs.push(folder, job, "final-adapter")
    assert outputs.push(folder, spec(), "final-adapter") is None  # no push configured
