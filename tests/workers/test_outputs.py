"""Outputs that survive the pod: the final adapter names its base model and revision (config and card), and is
pushed to an S3-compatible store (a moto server on loopback) and to the Hugging Face Hub (the emulator of
tests/workers/hubserver.py) with credentials from a mounted Secret; during training, every `everySteps` steps, in
the background with at most one push in flight."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from grpolora.api.load import parse_job
from grpolora.workers.trainer import outputs
from tests.helpers import job_doc
from tests.workers.hubserver import TOKEN, HubServer
from tests.workers.trackservers import s3_server

TENSORS = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(2, 4)}
CONFIG = {"peft_type": "LORA", "r": 2, "base_model_name_or_path": "/cache/models/local-copy", "revision": None}


@pytest.fixture(scope="module")
def s3():
    with s3_server() as endpoint:
        yield endpoint


def spec(**fields):
    return parse_job(job_doc(**fields)).spec


@pytest.fixture(scope="module")
def hub():
    server = HubServer().start()
    yield server
    server.stop()


@pytest.fixture
def secrets_dir(tmp_path, monkeypatch):
    """Mounted Secrets as the trainer sees them: s3-creds and hf-hub (and a Secret holding a wrong token)."""
    keys = {
        "s3-creds": {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
        "hf-hub": {"HF_TOKEN": TOKEN},
        "hf-wrong": {"HF_TOKEN": "hf_not_the_token"},
        "hf-misnamed": {"token": TOKEN},
        "hf-with-endpoint": {"HF_TOKEN": TOKEN},  # + HF_ENDPOINT, set by the test that needs it
    }
    for name, values in keys.items():
        (tmp_path / "secrets" / name).mkdir(parents=True)
        for key, value in values.items():
            (tmp_path / "secrets" / name / key).write_text(value)
    monkeypatch.setenv("GRPOLORA_SECRETS_DIR", str(tmp_path / "secrets"))
    # hf_xet would upload through the Xet protocol, which the emulator does not speak: use LFS, as the Hub allows.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_XET", True)
    return tmp_path / "secrets"


def hub_job(hub: HubServer, repo: str, secret: str = "hf-hub", every_steps: int | None = None, **fields) -> object:
    """A job pushing to `repo` on the emulator; `fields` go into spec.output.push.hub."""
    push = {"hub": {"repo": repo, "endpoint": hub.url, "secretName": secret, **fields}}
    if every_steps:
        push["everySteps"] = every_steps
    return spec(model={"name": "Qwen/Qwen3-0.6B", "revision": "c1899de"}, output={"push": push})


def local_files(folder) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in folder.iterdir()}


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
    for _ in range(2):  # the second push replaces the first one whole
        assert outputs.push(folder, job, step=3, final=True, job_name="demo") == [
            "s3://results/runs/demo/final-adapter"
        ]
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
        outputs.push(folder, job, step=1, final=True, job_name="demo")
    assert outputs.push(folder, spec(), step=1, final=True, job_name="demo") == []  # no push configured


def test_push_to_the_hub_creates_the_repo_and_commits_the_adapter_byte_for_byte(tmp_path, hub, secrets_dir):
    job = hub_job(hub, "org/adapter")
    folder = outputs.save_adapter(tmp_path / "final-adapter", TENSORS, CONFIG, job, step=12, job_name="demo")
    (where,) = outputs.push(folder, job, step=12, final=True, job_name="demo")
    repo = hub.state.repos["org/adapter"]
    head = repo.head("main")
    assert where == f"{hub.url}/org/adapter/commit/{head.oid}"
    stored = hub.files("org/adapter")
    assert {k: v for k, v in stored.items() if k != ".gitattributes"} == local_files(folder)  # byte for byte
    assert head.lfs == {"adapter_model.safetensors"}  # went through the LFS batch API and upload, as on the Hub
    assert hub.messages("org/adapter") == ["initial commit", "grpolora demo: final adapter after step 12"]
    assert not repo.private
    card = stored["README.md"].decode()
    assert "base_model: Qwen/Qwen3-0.6B" in card and "revision `c1899de`" in card
    # A second push to an existing repository is one more commit on the branch.
    tensors = {k: v * 2 for k, v in TENSORS.items()}
    folder = outputs.save_adapter(tmp_path / "again", tensors, CONFIG, job, step=13, job_name="demo")
    outputs.push(folder, job, step=13, final=True, job_name="demo")
    assert hub.messages("org/adapter")[-1] == "grpolora demo: final adapter after step 13"
    assert hub.files("org/adapter")["adapter_model.safetensors"] == (folder / "adapter_model.safetensors").read_bytes()


def test_hub_push_to_a_branch_of_a_private_repo(tmp_path, hub, secrets_dir):
    job = hub_job(hub, "org/private-adapter", branch="grpo-runs", private=True)
    folder = outputs.save_adapter(tmp_path / "a", TENSORS, CONFIG, job, step=4, job_name="demo")
    outputs.push(folder, job, step=4, final=False, job_name="demo")
    repo = hub.state.repos["org/private-adapter"]
    assert repo.private and set(repo.branches) == {"main", "grpo-runs"}
    assert hub.messages("org/private-adapter", "grpo-runs")[-1] == "grpolora demo: adapter at step 4"
    assert hub.files("org/private-adapter", "main") == {".gitattributes": hub.files("org/private-adapter")[
        ".gitattributes"]}  # fmt: skip


def test_a_model_card_names_a_local_base_model_only_in_its_text(tmp_path):
    """The Hub rejects card metadata whose base_model is no model id (a path, an offline name)."""
    job = spec(model={"name": "/models/my-base"})
    folder = outputs.save_adapter(tmp_path / "a", TENSORS, CONFIG, job, step=1, job_name="demo")
    card = (folder / "README.md").read_text()
    assert "base_model:" not in card and "base model: `/models/my-base`" in card
    for hub_id in ("gpt2", "Qwen/Qwen3-0.6B"):  # a model id, with or without its owner, is metadata
        card = outputs.model_card(spec(model={"name": hub_id}), 1, "demo")
        assert f"base_model: {hub_id}\n" in card


@pytest.mark.parametrize(
    ("secret", "error"),
    [
        ("hf-wrong", r"^spec.output.push.hub.secretName: the Hub at http://127.0.0.1:\d+ refused the token in Secret "
                     r"'hf-wrong', key HF_TOKEN \(401 Unauthorized\); it needs write access to org/refused$"),
        ("absent", r"^spec.output.push.hub.secretName: Secret 'absent' not found at "),
        ("hf-misnamed", r"^spec.output.push.hub.secretName: Secret .hf-misnamed. has no key HF_TOKEN \(it has: token"),
    ],
)  # fmt: skip
def test_a_bad_hub_token_is_a_clear_error_naming_the_field(tmp_path, hub, secrets_dir, secret, error):
    job = hub_job(hub, "org/refused", secret=secret)
    folder = outputs.save_adapter(tmp_path / "a", TENSORS, CONFIG, job, step=1, job_name="demo")
    with pytest.raises(outputs.PushError, match=error):
        outputs.push(folder, job, step=1, final=True, job_name="demo")
    assert "org/refused" not in hub.state.repos and (folder / "adapter_model.safetensors").exists()


def make_bucket(s3: str, name: str) -> object:
    import boto3

    client = boto3.client("s3", endpoint_url=s3, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")  # fmt: skip
    client.create_bucket(Bucket=name)
    return client


def test_pushes_every_n_steps_go_to_step_folders_on_s3(tmp_path, s3, secrets_dir, monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = make_bucket(s3, "periodic")
    target = {"url": "s3://periodic/run", "endpointUrl": s3, "secretName": "s3-creds"}
    job = spec(grpo={"steps": 6}, output={"push": {"s3": target, "everySteps": 2}})
    pusher = outputs.Pusher(job, tmp_path, job_name="demo")
    assert [s for s in range(1, 7) if pusher.due(s)] == [2, 4]  # the last step's adapter is the final push
    sent = {}
    for step in (2, 4):
        sent[step] = {k: v + step for k, v in TENSORS.items()}
        pusher.submit(step, sent[step], CONFIG)
        pusher.wait()
    final = outputs.save_adapter(tmp_path / "final-adapter", TENSORS, CONFIG, job, step=6, job_name="demo")
    assert pusher.finish(final, step=6) == ["s3://periodic/run/final-adapter"]
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="periodic")["Contents"])
    names = ("README.md", "adapter_config.json", "adapter_model.safetensors")
    assert keys == sorted(f"run/{d}/{n}" for d in ("step-000002", "step-000004", "final-adapter") for n in names)
    from safetensors.torch import load

    for step, tensors in sent.items():
        body = client.get_object(Bucket="periodic", Key=f"run/step-{step:06d}/adapter_model.safetensors")["Body"]
        assert all(torch.equal(load(body.read())[k], v) for k, v in tensors.items())
        card = client.get_object(Bucket="periodic", Key=f"run/step-{step:06d}/README.md")["Body"].read().decode()
        assert f"steps: {step}," in card
    status = pusher.status()
    assert status == {"last_push": "s3://periodic/run/final-adapter", "last_push_step": 6, "push_error": None}
    assert not list(tmp_path.glob(".push-*"))  # the staged step folders are gone


def test_one_push_in_flight_and_a_newer_one_replaces_the_queued_one(tmp_path, hub, secrets_dir):
    job = hub_job(hub, "org/periodic", every_steps=1)
    pusher = outputs.Pusher(job, tmp_path, job_name="demo")
    hub.state.hold = threading.Event()  # the emulator answers no commit until the test says so
    try:
        pusher.submit(1, TENSORS, CONFIG)  # returns at once: the push runs in the background
        assert hub.state.holding.wait(30)  # step 1's commit reached the Hub and waits there
        pusher.submit(2, {k: v * 2 for k, v in TENSORS.items()}, CONFIG)  # queued behind it
        pusher.submit(3, {k: v * 3 for k, v in TENSORS.items()}, CONFIG)  # replaces step 2 (skipped)
        assert pusher.in_flight == 1 and hub.messages("org/periodic") == ["initial commit"]
    finally:
        hub.state.hold.set()
    pusher.wait()
    assert hub.messages("org/periodic") == ["initial commit", "grpolora demo: adapter at step 1",
                                            "grpolora demo: adapter at step 3"]  # fmt: skip
    report = pusher.report()
    assert report["push"]["skipped"] == 1 and report["push"]["step"] == 3 and report["push"]["failed"] == 0
    assert pusher.report() == {}  # each finished push is reported once


def test_a_failing_background_push_is_reported_and_training_goes_on(tmp_path, hub, secrets_dir):
    job = hub_job(hub, "org/denied", secret="hf-wrong", every_steps=1)
    pusher = outputs.Pusher(job, tmp_path, job_name="demo")
    pusher.submit(1, TENSORS, CONFIG)  # never raises: the error is reported
    pusher.wait()
    report = pusher.report()
    assert report["push"]["failed"] == 1
    assert report["push_error"].startswith("spec.output.push.hub.secretName: the Hub at ")
    status = pusher.status()
    assert status["push_error"] == report["push_error"] and status["last_push"] is None
    # The final push fails loudly (the job fails) but the adapter stays in the output folder.
    final = outputs.save_adapter(tmp_path / "final-adapter", TENSORS, CONFIG, job, step=2, job_name="demo")
    with pytest.raises(
        outputs.PushError, match=r"secretName: .*\(401 Unauthorized\).*; the adapter is in .*final-adapter$"
    ):
        pusher.finish(final, step=2)
    assert (final / "adapter_model.safetensors").exists()
    assert "401" in pusher.status()["push_error"]


def test_the_hub_endpoint_may_come_from_the_secret(tmp_path, hub, secrets_dir):
    (secrets_dir / "hf-with-endpoint" / "HF_ENDPOINT").write_text(hub.url)
    job = spec(output={"push": {"hub": {"repo": "org/from-secret", "secretName": "hf-with-endpoint"}}})
    folder = outputs.save_adapter(tmp_path / "a", TENSORS, CONFIG, job, step=2, job_name="demo")
    assert outputs.push(folder, job, step=2, final=True, job_name="demo")[0].startswith(f"{hub.url}/org/from-secret/")
    assert hub.messages("org/from-secret")[-1] == "grpolora demo: final adapter after step 2"
