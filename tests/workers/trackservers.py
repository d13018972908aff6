"""Real services on loopback for the tracking and output tests: an `mlflow server` process (sqlite store, proxied
artifacts in a folder) and a moto S3 server. Each starts with a bounded wait and is stopped, whole process group
included, at the end."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from grpolora.testing.servers import free_port

MLFLOW_START_SECONDS = 120.0  # importing mlflow and migrating a fresh sqlite store takes ~30 s on 2 busy cores


@contextlib.contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """An MLflow tracking server; yields its URI."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
        "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination", str(folder / "art"),
        "--workers", "1",
    ]  # fmt: skip
    env = dict(os.environ) | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with (folder / "server.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + MLFLOW_START_SECONDS
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                tail = (folder / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mlflow server did not start within {MLFLOW_START_SECONDS} s:\n{tail}")
            time.sleep(0.5)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """A moto S3 server (the real S3 HTTP API, in memory); yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
