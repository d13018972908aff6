"""examples/model-cache/qwen3-from-a-volume.yaml: the model downloaded once into a volume that every pod reads. Its
objects are valid Kubernetes objects, its download Job's own command, run here against the test hub
(tests/workers/hubserver.py) with the token file it mounts, leaves a model folder that the workers load from where
the job's pods see it (spec.model.source.pvc at /models), and the claims line up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

from grpolora.api.load import parse_job
from grpolora.api.plan import MODEL_MOUNT, plan
from grpolora.operator.builders import build_children
from grpolora.workers.models import fingerprint
from tests.helpers import ROOT
from tests.unit.test_render import K8S_VERSION
from tests.workers.hubserver import HubServer
from tests.workers.test_model_access import READER, model_folder  # noqa: F401 (a fixture)

EXAMPLE = ROOT / "examples" / "model-cache" / "qwen3-from-a-volume.yaml"


def documents() -> dict[str, dict]:
    return {doc["kind"] + "/" + doc["metadata"]["name"]: doc for doc in yaml.safe_load_all(EXAMPLE.read_text())}


def test_the_objects_are_valid_and_the_claims_line_up():
    docs = documents()
    for key, doc in docs.items():
        if not key.startswith("GRPOLoraJob/"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    job = parse_job(docs["GRPOLoraJob/qwen3-from-a-volume"])
    download = docs["Job/download-qwen3-0.6b"]["spec"]["template"]["spec"]
    (container,) = download["containers"]
    filled = next(v for v in download["volumes"] if "persistentVolumeClaim" in v)
    assert job.spec.model.source is not None
    assert filled["persistentVolumeClaim"]["claimName"] == job.spec.model.source.pvc.claim_name
    # The Job writes where the job's pods read: the same path under the same mount.
    local_dir = container["command"][container["command"].index("--local-dir") + 1]
    assert local_dir == plan(job).model == f"{MODEL_MOUNT}/{job.spec.model.name}"
    mount = next(m for m in container["volumeMounts"] if m["name"] == filled["name"])
    assert mount["mountPath"] == MODEL_MOUNT
    # And the job's pods mount that claim there, read-only.
    for obj in build_children(plan(job), owner_uid="u", token="t"):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_download_commands_folder_is_what_the_workers_load(tmp_path, model_folder):  # noqa: F811
    docs = documents()
    container = docs["Job/download-qwen3-0.6b"]["spec"]["template"]["spec"]["containers"][0]
    command = list(container["command"])
    model = docs["GRPOLoraJob/qwen3-from-a-volume"]["spec"]["model"]["name"]
    hub = HubServer(read_tokens=frozenset({READER})).start()
    try:
        hub.add_model(model, model_folder, gated=True, granted=frozenset({READER}))
        volume = tmp_path / "volume"
        token = tmp_path / "hub-token" / "token"
        token.parent.mkdir()
        token.write_text(READER + "\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env |= {e["name"]: e["value"] for e in container["env"]}
        env |= {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1"}
        env["HF_TOKEN_PATH"] = str(token)  # where the Job mounts the Secret, here
        # The command as written, with the volume's mount path where this machine has it.
        command = [str(volume) + part.removeprefix(MODEL_MOUNT) if part.startswith(MODEL_MOUNT) else part
                   for part in command]  # fmt: skip
        command[0] = shutil.which(command[0], path=str(Path(sys.executable).parent))
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        hub.stop()
    downloaded = volume / model
    assert fingerprint(downloaded) == fingerprint(model_folder)
    resolve = "import sys; from grpolora.workers.models import resolve_model; print(resolve_model(sys.argv[1]))"
    loaded = subprocess.run(
        [sys.executable, "-P", "-c", resolve, str(downloaded)], capture_output=True, text=True, timeout=60
    )
    assert loaded.returncode == 0 and loaded.stdout.strip() == str(downloaded), loaded.stderr
