"""`grpolora operator` as a user (or the Helm chart) starts it: a process that logs in with a kubeconfig, serves
/metrics and /healthz, reconciles jobs, and exits cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys

import aiohttp
import yaml

from grpolora.testing.kube_emulator import NAMESPACE, running_cluster
from tests.helpers import ROOT, job_doc
from tests.operator.harness import wait_for


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(*args: str) -> list[str]:
    exe = shutil.which("grpolora")
    return [exe, *args] if exe else [sys.executable, "-P", "-m", "grpolora.cli", *args]


async def get(url: str) -> tuple[int, str]:
    try:
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            return response.status, await response.text()
    except aiohttp.ClientError:
        return 0, ""


async def test_the_operator_command_runs_as_the_chart_starts_it(tmp_path):
    metrics_port, health_port = free_port(), free_port()
    async with running_cluster() as cluster:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "emulator", "cluster": {"server": cluster.url}}],
                    "users": [{"name": "tester", "user": {}}],
                    "contexts": [{"name": "test", "context": {"cluster": "emulator", "user": "tester"}}],
                    "current-context": "test",
                }
            )
        )
        process = await asyncio.create_subprocess_exec(
            *command(
                "operator",
                "--namespace",
                NAMESPACE,
                "--metrics-port",
                str(metrics_port),
                "--health-port",
                str(health_port),
                "--standalone",
                "--log-level",
                "info",
            ),
            cwd=ROOT,
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:

            async def healthy() -> bool:
                status, body = await get(f"http://127.0.0.1:{health_port}/healthz")
                return status == 200 and "monitoredJobs" in body

            await wait_for(healthy, "/healthz to answer 200", timeout=30)

            await cluster.apply(job_doc())
            await wait_for(lambda: cluster.get("apps/v1/statefulsets", "demo-inference"), "children", timeout=20)
            await wait_for(lambda: cluster.status("demo").get("phase") == "Pending", "status", timeout=20)
            status, body = await get(f"http://127.0.0.1:{metrics_port}/metrics")
            assert status == 200 and 'grpolora_jobs{phase="Pending"} 1.0' in body
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            output, _ = await asyncio.wait_for(process.communicate(), timeout=30)
        log = output.decode()
        assert process.returncode == 0, log
        assert "created StatefulSet demo-inference" in log


async def test_the_operator_command_needs_a_scope():
    process = await asyncio.create_subprocess_exec(
        *command("operator", "--standalone"), cwd=ROOT, stderr=asyncio.subprocess.PIPE
    )
    _, error = await process.communicate()
    assert process.returncode == 2
    assert "one of the arguments --namespace --all-namespaces is required" in error.decode()


def test_the_operator_learns_its_namespace_from_the_pod(monkeypatch):
    from grpolora.operator.main import OperatorOptions

    monkeypatch.setenv("POD_NAMESPACE", "ops")
    assert OperatorOptions(all_namespaces=True).operator_namespace == "ops"
    monkeypatch.delenv("POD_NAMESPACE")
    assert OperatorOptions(all_namespaces=True).operator_namespace == "grpo-lora-system"


async def test_a_peered_operator_creates_its_kopf_peering_in_each_namespace():
    from tests.operator.harness import OperatorThread, operator_options

    async with running_cluster(peering=True) as cluster:
        operator = await OperatorThread(cluster.url, operator_options(namespaces=("a", "b"), peering="rl")).start()
        await operator.stop()
        for namespace in ("a", "b"):
            assert cluster.get("kopf.dev/v1/kopfpeerings", "rl", namespace) is not None, namespace
