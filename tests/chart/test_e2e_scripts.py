"""The kind end-to-end scripts: shellcheck-clean, their jobs valid, and their flow right (run against stand-ins).

The stand-ins are small bash scripts named docker, kind, kubectl and helm first on PATH: they log each call and
play back a sequence of job states, so the order of the steps, the images, the chart values and the wait loop are
checked here; the real run needs Docker and a cluster (tests/e2e/kind/README.md).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from grpolora.api.load import load_jobs
from tests.chart.tools import SHELLCHECK_PACKAGE, linter_or_skip
from tests.helpers import ROOT

E2E = ROOT / "tests" / "e2e" / "kind"
SCRIPTS = sorted(E2E.glob("*.sh"))

STAND_IN = r"""#!/bin/bash
echo "$(basename "$0") $*" >> "$SHIM_LOG"
case "$(basename "$0") $*" in
  "docker info"*) [[ "${SHIM_NO_DAEMON:-}" != 1 ]] ;;
  "kind get clusters"*) [[ -z "${SHIM_EXISTING_CLUSTER:-}" ]] || echo "$SHIM_EXISTING_CLUSTER" ;;
  "kubectl create namespace"*) printf 'apiVersion: v1\nkind: Namespace\nmetadata:\n  name: %s\n' "$3" ;;
  "kubectl apply"*"-f -"*) cat >> "$SHIM_APPLIED"; echo "---" >> "$SHIM_APPLIED" ;;
  "kubectl get nodes"*) printf '%s' "${SHIM_GPUS:-}" ;;
  "kubectl get deployment"*) echo "deployment.apps/grpo-lora-grpo-lora-operator" ;;
  "kubectl get glj "*rewardMean*) printf '%s' "${SHIM_REWARD-0.42}" ;;
  "kubectl get glj "*syncPort*) printf '29600' ;;
  "kubectl run "*probe-member*) exit "${SHIM_MEMBER_RC:-0}" ;;
  "kubectl run "*probe-outsider*) exit "${SHIM_OUTSIDER_RC:-1}" ;;
  "kubectl run "*adapter-check*) exit "${SHIM_ADAPTER_RC:-0}" ;;
  "kubectl get glj "*jsonpath*)
    count=$(( $(cat "$SHIM_COUNT" 2>/dev/null || echo 0) + 1 ))
    echo "$count" > "$SHIM_COUNT"
    read -ra states <<< "$SHIM_STATES"
    index=$(( count <= ${#states[@]} ? count - 1 : ${#states[@]} - 1 ))
    printf '%s' "${states[$index]/:/ }" ;;
  "kubectl get glj"*) printf 'NAME PHASE STEP SYNCROUND\nposition %s\n' "$(cat "$SHIM_COUNT" 2>/dev/null)" ;;
esac
"""


@pytest.fixture
def stand_ins(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("docker", "kind", "kubectl", "helm"):
        (bin_dir / tool).write_text(STAND_IN)
        (bin_dir / tool).chmod(0o755)
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SHIM_LOG": str(tmp_path / "calls.log"),
        "SHIM_COUNT": str(tmp_path / "count"),
        "SHIM_APPLIED": str(tmp_path / "applied.yaml"),
        "POLL_SECONDS": "0",
    }


def run(script: str, env: dict[str, str], **extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    result = subprocess.run(
        ["/bin/bash", str(E2E / script)],
        env={**env, **extra},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    log = Path(env["SHIM_LOG"])
    return result, (log.read_text().splitlines() if log.exists() else [])


def index_of(calls: list[str], prefix: str) -> int:
    for i, call in enumerate(calls):
        if call.startswith(prefix):
            return i
    raise AssertionError(f"no call starting with {prefix!r} in:\n" + "\n".join(calls))


# --- lint and jobs ------------------------------------------------------------------------------------------------


def test_scripts_are_shellcheck_clean():
    shellcheck = linter_or_skip(SHELLCHECK_PACKAGE, "shellcheck")
    result = subprocess.run(
        [str(shellcheck), "--external-sources", "--severity=style", *map(str, SCRIPTS)],
        capture_output=True,
        text=True,
        cwd=E2E,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_scripts_are_executable_and_strict():
    for script in SCRIPTS:
        text = script.read_text()
        if script.name != "lib.sh":
            assert os.access(script, os.X_OK), f"chmod +x {script.name}"
            assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text, script.name


def test_cpu_job_is_valid_small_and_placed_on_the_kind_node_pools():
    (job,) = load_jobs(E2E / "job-cpu.yaml")
    spec = job.spec
    assert spec.model.name.startswith("offline:")
    assert spec.trainer.gpus_per_replica == 0 and spec.inference.gpus_per_replica == 0
    assert spec.sync.backend == "gloo"
    assert spec.grpo.steps // spec.grpo.sync_every_steps >= 3, "the e2e waits for syncRound >= 3"
    assert spec.grpo.steps <= 10, "keep the e2e small"
    pools = [n.get("labels", {}) for n in yaml.safe_load((E2E / "kind-config.yaml").read_text())["nodes"]]
    assert spec.trainer.node_selector in pools and spec.inference.node_selector in pools
    assert spec.trainer.node_selector != spec.inference.node_selector
    for role in (spec.trainer, spec.inference):
        assert role.image == "grpolora.local/worker-cpu:e2e" and role.image_pull_policy == "Never"


def test_gpu_job_is_valid_and_tolerates_gpu_nodes():
    (job,) = load_jobs(E2E / "job-gpu.yaml")
    spec = job.spec
    assert spec.sync.backend == "nccl" and spec.model.name.startswith("offline:")
    assert spec.grpo.steps // spec.grpo.sync_every_steps >= 3
    for role, pool in ((spec.trainer, "trainer"), (spec.inference, "inference")):
        assert role.gpus_per_replica >= 1
        assert role.node_selector == {"grpolora.dev/pool": pool}
        assert any(t.get("key") == "nvidia.com/gpu" for t in role.tolerations)


# --- run.sh -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", ["run.sh", "gpu.sh"])
def test_skips_with_a_clear_message_without_its_tools(tmp_path, script):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run(
        ["/bin/bash", str(E2E / script)], env={"PATH": str(empty)}, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0
    assert result.stdout.startswith("skipped: ") and "not found" in result.stdout
    assert "kubectl" in result.stdout and "helm" in result.stdout


@pytest.mark.parametrize("script", ["run.sh", "gpu.sh"])
@pytest.mark.parametrize(("variable", "value"), [("CI", "true"), ("CI", "1"), ("E2E_REQUIRED", "1")])
def test_a_skipped_run_is_not_green_in_ci_or_when_required(tmp_path, script, variable, value):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"PATH": str(empty), variable: value}
    result = subprocess.run(["/bin/bash", str(E2E / script)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert result.stdout.startswith("skipped: ") and "FAIL: the end-to-end test was required" in result.stdout


def test_run_skips_when_the_docker_daemon_is_down(stand_ins):
    result, calls = run("run.sh", stand_ins, SHIM_NO_DAEMON="1")
    assert result.returncode == 0 and result.stdout.startswith("skipped: docker is installed but its daemon")
    assert calls == ["docker info"]


def test_run_creates_the_cluster_builds_loads_installs_applies_and_waits(stand_ins):
    result, calls = run("run.sh", stand_ins, SHIM_STATES="Pending: Running:1 Running:2 Succeeded:3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout and "Succeeded after 3 sync rounds" in result.stdout
    steps = [
        "kind create cluster --name grpolora-e2e --config " + str(E2E / "kind-config.yaml"),
        "kubectl config use-context kind-grpolora-e2e",
        f"docker build --target operator --tag grpolora.local/operator:e2e {ROOT}",
        f"docker build --target worker-cpu --tag grpolora.local/worker-cpu:e2e {ROOT}",
        "kind load docker-image --name grpolora-e2e grpolora.local/operator:e2e grpolora.local/worker-cpu:e2e",
        f"helm upgrade --install grpo-lora {ROOT / 'charts' / 'grpo-lora-operator'} --namespace grpo-lora-system",
        # A re-run under the same tag must test the rebuilt operator image: helm alone would keep the old pod.
        "kubectl rollout restart --namespace grpo-lora-system deployment.apps/grpo-lora-grpo-lora-operator",
        "kubectl rollout status --namespace grpo-lora-system deployment.apps/grpo-lora-grpo-lora-operator",
        "kubectl apply -f -",  # the job namespace
        # A fresh job (and claim) each run, even on a reused cluster.
        "kubectl delete glj e2e-cpu --namespace grpolora-e2e --ignore-not-found --wait=true",
        "kubectl delete pvc e2e-cpu-checkpoints --namespace grpolora-e2e --ignore-not-found --wait=true",
        "kubectl apply --namespace grpolora-e2e -f -",  # the claim
        f"kubectl apply --namespace grpolora-e2e -f {E2E / 'job-cpu.yaml'}",
        "kubectl get glj e2e-cpu --namespace grpolora-e2e -o jsonpath",
        "kubectl run e2e-cpu-probe-member --namespace grpolora-e2e",
        "kubectl run e2e-cpu-probe-outsider --namespace grpolora-e2e",
        "kubectl get glj e2e-cpu --namespace grpolora-e2e -o jsonpath={.status.rewardMean}",
        "kubectl run e2e-cpu-adapter-check --namespace grpolora-e2e",
        "kind delete cluster --name grpolora-e2e",
    ]
    positions = [index_of(calls, step) for step in steps]
    assert positions == sorted(positions), "\n".join(calls)
    helm = calls[index_of(calls, "helm upgrade")]
    for flag in ("image.repository=grpolora.local/operator", "image.tag=e2e", "image.pullPolicy=Never", "--wait"):
        assert flag in helm
    polls = [c for c in calls if c == "kubectl get glj --namespace grpolora-e2e"]
    assert len(polls) == 4, "kubectl get glj is printed on every poll"
    applied = Path(stand_ins["SHIM_APPLIED"]).read_text()
    assert "name: grpolora-e2e" in applied and "name: e2e-cpu-checkpoints" in applied
    assert "--labels grpolora.dev/job=e2e-cpu" in calls[index_of(calls, "kubectl run e2e-cpu-probe-member")]
    assert "--labels" not in calls[index_of(calls, "kubectl run e2e-cpu-probe-outsider")]
    assert "NetworkPolicy in force" in result.stdout and "final adapter present" in result.stdout
    (job,) = load_jobs(E2E / "job-cpu.yaml")
    assert job.spec.checkpoint.pvc is not None and job.spec.checkpoint.pvc.claim_name == "e2e-cpu-checkpoints"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"SHIM_REWARD": ""}, "Succeeded without a reward"),
        ({"SHIM_ADAPTER_RC": "1"}, "no final adapter"),
        ({"SHIM_OUTSIDER_RC": "0", "REQUIRE_NETWORK_POLICY": "1"}, "the NetworkPolicy is not in force"),
    ],
)
def test_run_fails_when_the_job_succeeds_without_what_it_must_show(stand_ins, extra, words):
    result, _ = run("run.sh", stand_ins, SHIM_STATES="Running:1 Succeeded:3", **extra)
    assert result.returncode != 0 and "FAIL: " in result.stdout and words in result.stdout


def test_a_cni_without_network_policies_is_a_warning_unless_required(stand_ins):
    result, _ = run("run.sh", stand_ins, SHIM_STATES="Running:1 Succeeded:3", SHIM_OUTSIDER_RC="0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "does not enforce NetworkPolicies" in result.stdout


def test_run_fails_with_diagnostics_when_the_job_fails_and_still_cleans_up(stand_ins):
    result, calls = run("run.sh", stand_ins, SHIM_STATES="Running:1 Failed:1")
    assert result.returncode != 0
    assert "FAIL: grpolora-e2e/e2e-cpu Failed" in result.stdout
    index_of(calls, "kubectl describe glj e2e-cpu --namespace grpolora-e2e")
    index_of(calls, "kubectl logs --namespace grpo-lora-system")
    assert calls[-1] == "kind delete cluster --name grpolora-e2e"


def test_run_fails_when_the_job_succeeds_with_too_few_sync_rounds(stand_ins):
    result, _ = run("run.sh", stand_ins, SHIM_STATES="Running:1 Succeeded:2")
    assert result.returncode != 0 and "only 2 sync rounds" in result.stdout


def test_run_times_out(stand_ins):
    result, _ = run("run.sh", stand_ins, SHIM_STATES="Running:1", TIMEOUT_SECONDS="1", POLL_SECONDS="1")
    assert result.returncode != 0 and "did not succeed within 1s" in result.stdout


def test_run_reuses_and_keeps_an_existing_cluster(stand_ins):
    result, calls = run("run.sh", stand_ins, SHIM_STATES="Succeeded:5", SHIM_EXISTING_CLUSTER="grpolora-e2e")
    assert result.returncode == 0, result.stdout + result.stderr
    assert not [c for c in calls if c.startswith(("kind create", "kind delete"))]


def test_run_keeps_a_created_cluster_when_asked(stand_ins):
    result, calls = run("run.sh", stand_ins, SHIM_STATES="Succeeded:3", KEEP_CLUSTER="1")
    assert result.returncode == 0
    index_of(calls, "kind create cluster")
    assert not [c for c in calls if c.startswith("kind delete")]


# --- gpu.sh -------------------------------------------------------------------------------------------------------


def test_gpu_skips_without_gpu_nodes_in_the_pools(stand_ins):
    result, calls = run("gpu.sh", stand_ins, SHIM_GPUS=" ")
    assert result.returncode == 0 and "skipped: no node labelled grpolora.dev/pool=trainer" in result.stdout
    assert "nvkind-config.yaml.tmpl" in result.stdout
    assert not [c for c in calls if c.startswith("helm")]
    result, _ = run("gpu.sh", stand_ins, SHIM_GPUS=" ", CI="true")
    assert result.returncode != 0, "a skipped GPU e2e must not be green in CI"


def test_gpu_needs_images_named_it_assumes_no_published_ones(stand_ins):
    result, calls = run("gpu.sh", stand_ins, SHIM_GPUS="1 ")
    assert result.returncode != 0 and "set OPERATOR_IMAGE and WORKER_IMAGE" in result.stdout
    assert not [c for c in calls if c.startswith("helm")]


def nvkind_nodes() -> list[dict]:
    text = (E2E / "nvkind-config.yaml.tmpl").read_text()
    plain = "\n".join(line for line in text.splitlines() if "{{" not in line)  # the Go template lines
    return yaml.safe_load(plain)["nodes"]


def test_the_nvkind_template_makes_one_gpu_worker_per_pool_of_the_gpu_job():
    workers = [n for n in nvkind_nodes() if n["role"] == "worker"]
    assert len(workers) == 2
    gpus = [m["containerPath"] for w in workers for m in w["extraMounts"]]
    assert (
        len(gpus) == 2 and len(set(gpus)) == 2 and all(p.startswith("/var/run/nvidia-container-devices/") for p in gpus)
    )
    (job,) = load_jobs(E2E / "job-gpu.yaml")
    pools = [{k: v for k, v in w["labels"].items() if k == "grpolora.dev/pool"} for w in workers]
    assert sorted(map(str, pools)) == sorted(
        map(str, [job.spec.trainer.node_selector, job.spec.inference.node_selector])
    )


def test_the_gpu_readme_and_script_agree_on_two_gpu_workers():
    readme = (E2E / "README.md").read_text()
    assert (
        "nvkind cluster create --name grpolora-gpu --config-template tests/e2e/kind/nvkind-config.yaml.tmpl" in readme
    )
    assert "two GPU workers" in readme and "two GPU workers" in (E2E / "gpu.sh").read_text()
    assert "kubectl label node" not in readme, "the template labels the pools; no manual step may be needed"
    assert "CI" in readme and "E2E_REQUIRED" in readme


def test_gpu_installs_with_the_given_images_and_waits(stand_ins):
    result, calls = run(
        "gpu.sh",
        stand_ins,
        SHIM_GPUS="1 ",
        SHIM_STATES="Running:2 Succeeded:6",
        OPERATOR_IMAGE="registry.example.com:5000/grpo/operator:1.2",
        WORKER_IMAGE="registry.example.com:5000/grpo/worker-gpu:1.2",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    helm = calls[index_of(calls, "helm upgrade --install grpo-lora")]
    assert "image.repository=registry.example.com:5000/grpo/operator" in helm and "image.tag=1.2" in helm
    applied = [d for d in yaml.safe_load_all(Path(stand_ins["SHIM_APPLIED"]).read_text()) if d]
    (job,) = [d for d in applied if d["kind"] == "GRPOLoraJob"]
    worker = "registry.example.com:5000/grpo/worker-gpu:1.2"
    assert job["spec"]["trainer"]["image"] == job["spec"]["inference"]["image"] == worker
    assert index_of(calls, "kubectl apply --namespace grpolora-e2e-gpu -f -") < index_of(calls, "kubectl get glj")
    index_of(calls, "kubectl rollout restart --namespace grpo-lora-system")
    index_of(calls, "kubectl delete glj e2e-gpu --namespace grpolora-e2e-gpu --ignore-not-found")
    index_of(calls, "kubectl run e2e-gpu-adapter-check --namespace grpolora-e2e-gpu --image " + worker)
