"""`grpolora validate` asks the hub about the model before any GPU is booked (issue 47 item 3): does the model
exist, does its revision, and can the token the pods will have read it when it is gated. The pods' token is
spec.model.tokenFrom's Secret (read from the cluster with --cluster); without --cluster the user's own token stands in
for it, and what that cannot tell is said as not checked. Offline, or without huggingface_hub, it says it could not
check. Asked with huggingface_hub's own calls (model_info, auth_check) of the installed client, against the test hub
(tests/workers/hubserver.py, which answers as the Hugging Face Hub does), through the CLI as a user runs it."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from grpolora.api import constants as c
from grpolora.cli import main
from grpolora.testing.servers import free_port
from tests.helpers import ROOT

pytest.importorskip("huggingface_hub")
pytest.importorskip("fastapi")
from safetensors.numpy import save_file

from tests.unit.test_cli_cluster import namespaces_routed  # noqa: F401 (a fixture, for the emulator's namespaces)
from tests.workers.hubserver import HubServer

READER = "hf_reader_granted"
STRANGER = "hf_reader_not_granted"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(folder / "model.safetensors"))
    server = HubServer(read_tokens=frozenset({READER, STRANGER})).start()
    server.add_model("org/open", folder)
    server.add_model("org/gated", folder, gated=True, granted=frozenset({READER}))
    yield server
    server.stop()


def job(model: str, *, revision: str | None = None, token_from: str | None = None) -> str:
    """model.name on line 6, then revision or tokenFrom on line 7."""
    lines = [f"apiVersion: {c.API_VERSION}", "kind: GRPOLoraJob", "metadata: {name: first, namespace: team-a}", "spec:",
             "  model:", f"    name: {model}"]  # fmt: skip
    lines += [f"    revision: {revision}"] if revision else []
    lines += [f"    tokenFrom: {{secretName: {token_from}}}"] if token_from else []
    lines += ["  task: {name: arithmetic}", "  trainer: {gpusPerReplica: 0}", "  inference: {gpusPerReplica: 0}"]
    return "\n".join(lines) + "\n"


def validate(tmp_path, hub_url: str, text: str, *args: str, token: str | None = None, **env: str):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environ |= {"HF_ENDPOINT": hub_url, "HF_HOME": str(tmp_path / "hf-home"), **env}
    if token is not None:
        environ["HF_TOKEN"] = token  # the user's own login, as huggingface_hub reads it
    run = subprocess.run([sys.executable, "-P", "-m", "grpolora.cli", "validate", *args, str(path)], env=environ,
                         capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    return run.returncode, run.stdout, run.stderr


def test_a_model_that_exists_passes_and_the_hub_was_asked(tmp_path, hub):
    code, out, err = validate(tmp_path, hub.url, job("org/open"))
    assert code == 0, err
    assert "GRPOLoraJob team-a/first is valid" in out
    assert "spec.model" not in err, err
    assert "GET /api/models/org/open" in hub.state.calls


@pytest.mark.parametrize(
    ("model", "revision", "line", "words"),
    [
        ("org/opne", None, 6, "spec.model.name: model 'org/opne' was not found on {hub} (check the name"),
        ("org/open", "v9", 7, "spec.model.revision: 'v9' was not found in model 'org/open' on {hub}"),
        ("org/gated", None, 6, "spec.model.tokenFrom: model 'org/gated' is gated on {hub} and no token was given: "
         "name a Secret holding the token of an account that has been granted access"),
    ],
)  # fmt: skip
def test_a_typo_a_missing_revision_and_a_gated_model_without_a_token_are_errors(
    tmp_path, hub, model, revision, line, words
):
    code, out, err = validate(tmp_path, hub.url, job(model, revision=revision), token=READER)
    assert code == 1 and "is valid" not in out, err
    assert f"GRPOLoraJob team-a/first: line {line}: " + words.format(hub=hub.url) in err, err


def test_without_the_cluster_the_users_own_token_stands_in_for_the_secrets(tmp_path, hub):
    gated = job("org/gated", token_from="hf-token")
    code, out, err = validate(tmp_path, hub.url, gated, token=READER)
    assert code == 0, err
    assert "GRPOLoraJob team-a/first is valid" in out
    assert "not checked here: line 7: spec.model.tokenFrom: whether Secret team-a/hf-token's token can read model " \
        "'org/gated' (gated; your own hub token can; --cluster reads the Secret)" in err  # fmt: skip
    code, _, err = validate(tmp_path, hub.url, gated, token=STRANGER)
    assert code == 0, err  # the pods' token may well be granted: not an error
    assert "(gated; your own hub token cannot read it either; --cluster reads the Secret)" in err
    # Not found with the user's token: a typo, or a private model only the Secret's token reads. Warned, not refused.
    code, _, err = validate(tmp_path, hub.url, job("org/opne", token_from="hf-token"), token=READER)
    assert code == 0, err
    assert f"warning: line 6: spec.model.name: model 'org/opne' was not found on {hub.url}" in err
    assert "asked with your own hub token, the pods use Secret team-a/hf-token's (--cluster reads it)" in err


def test_offline_or_unreachable_it_says_it_could_not_check(tmp_path, hub):
    code, _, err = validate(tmp_path, hub.url, job("org/opne"), HF_HUB_OFFLINE="1")
    assert code == 0, err
    assert "not checked here: line 6: spec.model.name: model 'org/opne' on the hub (could not check: HF_HUB_OFFLINE" \
        in err  # fmt: skip
    down = f"http://127.0.0.1:{free_port()}"
    code, _, err = validate(tmp_path, down, job("org/opne"))
    assert code == 0, err
    assert f"not checked here: line 6: spec.model.name: model 'org/opne' on the hub (could not check: {down} could " \
        "not be reached" in err  # fmt: skip


def test_a_hub_that_answers_the_model_and_stalls_the_access_check_is_waited_for_no_longer_than_the_timeout(tmp_path):
    """A gated model: model_info answers, then the access check (auth-check) never does. huggingface_hub >= 1.0 shares
    an httpx client whose timeout can be set; 0.x (pyproject allows >= 0.30) shares a requests.Session, which has no
    timeout of its own, and HfApi.auth_check passes none: validate hung there. Run this file with an 0.x client
    first on the path (pip install --target DIR --no-deps huggingface_hub==0.30.2; PYTHONPATH=DIR) to check that
    line too."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    stalling = HubServer(read_tokens=frozenset({READER}))

    @stalling.app.middleware("http")
    async def stall_the_access_check(request, call_next):
        if request.url.path.endswith("/auth-check"):
            stalling.state.calls.append(f"stalled {request.url.path}")
            await asyncio.sleep(3600)  # until stop() cancels it
        return await call_next(request)

    stalling.start()
    stalling.add_model("org/gated", folder, gated=True, granted=frozenset({READER}))
    try:
        code, _, err = validate(tmp_path, stalling.url, job("org/gated"), "--request-timeout", "2", token=READER)
    finally:
        stalling.stop()
    assert "stalled /api/models/org/gated/auth-check" in stalling.state.calls  # model_info answered, then the stall
    assert code == 0, err
    assert f"spec.model.name: model 'org/gated' on the hub (could not check: {stalling.url} could not be reached " \
        "(ReadTimeout" in err, err  # fmt: skip


def test_a_name_that_is_no_hub_id_is_not_checked_and_the_hub_is_still_asked_for_the_next_job(tmp_path, hub):
    """A name with three parts is no hub id (huggingface_hub refuses it before sending anything) and may be a path
    in the pod (resolve_model): not checked, saying why. It was taken for an unreachable hub, so the next job in the
    same run was not checked either ('could not be reached (HFValidationError ...)') and its typo passed."""
    second = job("org/opne").replace("name: first", "name: second")
    code, _, err = validate(tmp_path, hub.url, job("models/qwen3/v1") + "---\n" + second)
    assert code == 1, err
    assert "not checked here: line 6: spec.model.name: model 'models/qwen3/v1' on the hub (could not check: not a " \
        "hub model id (Repo id must be" in err  # fmt: skip
    assert "could not be reached" not in err, err
    assert f"GRPOLoraJob team-a/second: line 16: spec.model.name: model 'org/opne' was not found on {hub.url}" in err
    assert "GET /api/models/org/opne" in hub.state.calls


def test_without_huggingface_hub_it_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import huggingface_hub raises ModuleNotFoundError
    path = tmp_path / "job.yaml"
    path.write_text(job("org/opne"))
    code = main(["validate", str(path)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "spec.model.name: model 'org/opne' on the hub (could not check: huggingface_hub not installed)" in err


def test_the_suite_asks_no_real_hub(tmp_path, capsys):
    """validate asks the hub by default: run in-process, as many tests do, it asks the endpoint tests/conftest.py
    sets for the whole session (a loopback port nothing answers on), never huggingface.co, so a test's output is the
    same with internet or without."""
    path = tmp_path / "job.yaml"
    path.write_text(job("org/opne"))
    code = main(["validate", str(path)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert re.search(r"model 'org/opne' on the hub \(could not check: http://127\.0\.0\.1:\d+ could not be reached",
                     err), err  # fmt: skip


async def test_with_the_cluster_the_secrets_token_is_the_one_asked(tmp_path, hub):
    from grpolora.testing.kube_emulator import running_cluster
    from tests.unit.test_cli_cluster import create, kubeconfig, ready_cluster

    found = {}
    async with running_cluster(authorize=None) as cluster:
        await ready_cluster(cluster)
        for name, token in (("hf-stranger", STRANGER), ("hf-reader", READER)):
            data = {"token": base64.b64encode(token.encode()).decode()}
            await create(cluster, {"apiVersion": "v1", "kind": "Secret", "data": data,
                                   "metadata": {"name": name, "namespace": "team-a"}})  # fmt: skip
            found[name] = await asyncio.to_thread(
                validate, tmp_path, hub.url, job("org/gated", token_from=name), "--cluster", "--kubeconfig",
                kubeconfig(tmp_path, cluster), token=READER,  # the user's own token could: the Secret's is asked
            )  # fmt: skip
        # A Secret the same file creates is not in the cluster yet: the user's own token stands in for it.
        secret = "apiVersion: v1\nkind: Secret\nmetadata: {name: hf-new, namespace: team-a}\ndata: {token: eA==}\n---\n"
        found["hf-new"] = await asyncio.to_thread(
            validate, tmp_path, hub.url, secret + job("org/gated", token_from="hf-new"), "--cluster", "--kubeconfig",
            kubeconfig(tmp_path, cluster), token=READER,
        )  # fmt: skip
    code, _, err = found["hf-new"]
    assert code == 0, err
    assert "whether Secret team-a/hf-new's token can read model 'org/gated' (gated; your own hub token can" in err
    code, _, err = found["hf-stranger"]
    assert code == 1, err
    assert f"line 7: spec.model.tokenFrom: the token cannot read model 'org/gated' (gated on {hub.url}): its " \
        "account has not been granted access" in err  # fmt: skip
    code, out, err = found["hf-reader"]
    assert code == 0, err
    assert "GRPOLoraJob team-a/first is valid" in out
