"""The base model from a hub, as a pod gets it: the token is a file named by HF_TOKEN_PATH (which huggingface_hub
reads; the operator mounts spec.model.tokenFrom there), and a model that does not exist, or that the token cannot
read, is a spec error: the trainer exits EXIT_INVALID_SPEC with a message naming the model (the trainer Job's
podFailurePolicy then fails the job at once, and the operator with the trainer's message), while a hub that cannot
be reached stays a failure worth a restart. The hub is tests/workers/hubserver.py, answering as the Hugging Face
Hub does.

Every download runs in a child process with the pod's environment (HF_ENDPOINT, HF_TOKEN_PATH and HF_HOME are read
once, when huggingface_hub is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from safetensors.numpy import save_file

from grpolora.api import contract
from grpolora.api.load import parse_job
from grpolora.api.plan import plan
from grpolora.operator.builders import build_children
from grpolora.operator.reconcile import Observed, decide
from grpolora.testing.servers import free_port
from grpolora.workers.models import fingerprint
from tests.helpers import job_doc
from tests.unit.test_failure_policy import policy_failed, trainer_pod
from tests.unit.test_operator_reconcile import NOW, applied_view, running, statefulset
from tests.workers.hubserver import HubServer

READER = "hf_reader_granted"
STRANGER = "hf_reader_not_granted"

RESOLVE = """
import json, sys
from grpolora.workers.models import ModelError, fingerprint, resolve_model
try:
    path = resolve_model(sys.argv[1], sys.argv[2] or None)
except ModelError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
else:
    print(json.dumps({"fingerprint": fingerprint(path)}))
"""


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    save_file({"w": np.arange(64, dtype=np.float32).reshape(8, 8)}, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def hub(model_folder):
    server = HubServer(read_tokens=frozenset({READER, STRANGER})).start()
    server.add_model("org/open", model_folder)
    server.add_model("org/gated", model_folder, gated=True, granted=frozenset({READER}))
    server.add_model("org/private", model_folder, private=True, granted=frozenset({READER}))
    yield server
    server.stop()


def pod_env(tmp_path: Path, hub_url: str, token: str | None) -> dict[str, str]:
    """What a pod's environment says about the hub: where it is, where its cache is, the token file if any."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environ |= {"HF_ENDPOINT": hub_url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1"}
    if token is not None:
        token_file = tmp_path / "hub-token" / "token"
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.write_text(token + "\n")  # a Secret's value, as often written with a trailing newline
        environ[contract.HUB_TOKEN_PATH] = str(token_file)
    return environ


def resolve(tmp_path: Path, hub_url: str, name: str, *, token: str | None = None, revision: str = "") -> dict:
    run = subprocess.run(
        [sys.executable, "-P", "-c", RESOLVE, name, revision],
        env=pod_env(tmp_path, hub_url, token),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_public_model_downloads_without_a_token(tmp_path, hub, model_folder):
    assert resolve(tmp_path, hub.url, "org/open") == {"fingerprint": fingerprint(model_folder)}


def test_a_gated_model_downloads_with_the_token_file_named_by_hf_token_path(tmp_path, hub, model_folder):
    assert resolve(tmp_path, hub.url, "org/gated", token=READER) == {"fingerprint": fingerprint(model_folder)}
    assert resolve(tmp_path / "p", hub.url, "org/private", token=READER) == {"fingerprint": fingerprint(model_folder)}


@pytest.mark.parametrize(
    ("name", "token", "revision", "expected"),
    [
        ("org/opne", None, "", "spec.model.name: model 'org/opne' was not found on {hub}"),
        ("org/opne", READER, "", "spec.model.name: model 'org/opne' was not found on {hub}"),
        ("org/private", None, "", "spec.model.name: model 'org/private' was not found on {hub}"),
        ("org/gated", None, "", "spec.model.tokenFrom: model 'org/gated' is gated on {hub} and no token was given"),
        ("org/gated", STRANGER, "", "spec.model.tokenFrom: the token cannot read model 'org/gated' (gated on {hub})"),
        ("org/open", "hf_typo", "", "spec.model.tokenFrom: {hub} refused the token as invalid"),
        ("org/open", None, "v9", "spec.model.revision: 'v9' was not found in model 'org/open' on {hub}"),
    ],
    ids=[
        "misspelt",
        "misspelt-with-token",
        "private-no-token",
        "gated-no-token",
        "gated-not-granted",
        "bad-token",
        "no-such-revision",
    ],
)
def test_a_model_that_does_not_exist_or_that_the_token_cannot_read_is_a_spec_error(
    tmp_path, hub, name, token, revision, expected
):
    result = resolve(tmp_path, hub.url, name, token=token, revision=revision)
    assert result["error"] == "ModelUnavailable", result
    assert result["message"].startswith(expected.format(hub=hub.url)), result["message"]


def test_a_hub_that_cannot_be_reached_is_not_a_spec_error(tmp_path):
    result = resolve(tmp_path, f"http://127.0.0.1:{free_port()}", "org/open")
    assert result["error"] == "ModelError" and "org/open" in result["message"], result


def worker(tmp_path: Path, hub_url: str, role: str, model: str, token: str | None = None):
    job = parse_job(
        job_doc(
            model={"name": model, "dtype": "float32"},
            trainer={"gpusPerReplica": 0, "statusPort": free_port()},
            inference={"gpusPerReplica": 0, "port": free_port()},
            checkpoint={"path": str(tmp_path / "ckpt")},
        )
    )
    environ = pod_env(tmp_path, hub_url, token) | plan(job).env_for(role, 0, token="t")
    environ[contract.BIND_ADDR] = "127.0.0.1"
    args = ["worker", role, *([f"--lora-slots={job.spec.inference.max_loras}"] if role == "inference" else [])]
    # `grpolora worker <role>`, its termination message written where this test reads it (the kubelet's file is
    # /dev/termination-log, contract.TERMINATION_LOG).
    command = [sys.executable, "-P", "-c", WORKER, str(tmp_path / "termination-log"), *args]
    return subprocess.run(command, env=environ, capture_output=True, text=True, timeout=300)


WORKER = """
import sys
from grpolora.api import contract
contract.TERMINATION_LOG = sys.argv[1]
from grpolora.cli import main
sys.exit(main(sys.argv[2:]))
"""


def termination_message(tmp_path: Path) -> str:
    return (tmp_path / "termination-log").read_text()


class TrainerStart(NamedTuple):
    run: subprocess.CompletedProcess[str]
    termination_message: str


@pytest.fixture(scope="module")
def trainer_start(tmp_path_factory, hub):
    """`grpolora worker trainer` started on a model it cannot have, once per (model, token) in the module: several
    tests read the same exit (each start is ~4 s of imports), whichever of them asks first."""
    starts: dict[tuple[str, str | None], TrainerStart] = {}

    def start(model: str, token: str | None = None) -> TrainerStart:
        if (model, token) not in starts:
            tmp = tmp_path_factory.mktemp("trainer-start")
            run = worker(tmp, hub.url, "trainer", model, token)
            starts[model, token] = TrainerStart(run, termination_message(tmp))
        return starts[model, token]

    return start


@pytest.mark.parametrize(("model", "token"), [("org/opne", None), ("org/gated", None), ("org/gated", STRANGER)])
def test_the_trainer_exits_with_the_invalid_spec_code_naming_the_model(trainer_start, model, token):
    run, message = trainer_start(model, token)
    assert run.returncode == contract.EXIT_INVALID_SPEC, run.stderr[-3000:]
    assert f"model '{model}'" in run.stderr
    assert message.startswith("spec.model.") and f"model '{model}'" in message


def test_the_trainer_restarts_when_the_hub_cannot_be_reached(tmp_path):
    run = worker(tmp_path, f"http://127.0.0.1:{free_port()}", "trainer", "org/open")
    assert run.returncode == 1, run.stderr[-3000:]
    assert "model 'org/open'" in run.stderr


def test_the_inference_server_exits_with_the_invalid_spec_code_naming_the_model(tmp_path, hub):
    """Its StatefulSet restarts it (restartPolicy Always), but each restart says why, in the log and in the
    container's termination message, instead of a generic exit 1."""
    run = worker(tmp_path, hub.url, "inference", "org/opne")
    assert run.returncode == contract.EXIT_INVALID_SPEC, run.stderr[-3000:]
    assert "model 'org/opne' was not found" in run.stderr
    assert termination_message(tmp_path).startswith("spec.model.name: model 'org/opne' was not found")


def test_the_job_fails_once_on_that_exit_with_the_trainers_message(trainer_start):
    """What the operator does with it: the trainer Job's podFailurePolicy, as rendered, fails the Job on that exit
    code (no pod is retried), and the operator fails the GRPOLoraJob with the trainer's message naming the model,
    spending none of spec.trainer.maxRestarts (the Job controller's wording: tests/unit/test_failure_policy.py)."""
    run, message = trainer_start("org/opne")
    rendered = build_children(plan(parse_job(job_doc(model={"name": "org/opne"}))), owner_uid="u", token="t")
    trainer = next(o for o in rendered if o["kind"] == "Job")
    rules = trainer["spec"]["podFailurePolicy"]["rules"]
    (index,) = [i for i, r in enumerate(rules) if run.returncode in (r.get("onExitCodes") or {}).get("values", [])]
    assert rules[index]["action"] == "FailJob" and rules[index]["onExitCodes"]["containerName"] == "trainer"
    assert trainer["spec"]["backoffLimit"] == 0
    failed = policy_failed(
        f"Container trainer for pod team-a/demo-trainer-0-x7k2p failed with exit code {run.returncode} matching "
        f"FailJob rule at index {index}"
    )
    pod = trainer_pod(run.returncode, message)
    decision = decide(
        applied_view(trainer={"maxRestarts": 3}), running(), Observed(failed, statefulset(1), pods=(pod,)), NOW
    )
    assert decision.status.phase == "Failed" and decision.status.trainer_restarts == 0
    assert "spec.model.name: model 'org/opne' was not found" in decision.status.message
