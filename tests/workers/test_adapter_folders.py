"""Adapter folders on tmpfs: those of servers that no longer run are removed, live ones are left alone."""

from __future__ import annotations

import os
import subprocess

from grpolora.workers.inference.adapter_folders import ADAPTER_ROOT_PREFIX, remove_stale_adapter_roots


def test_folders_of_dead_server_processes_are_removed(tmp_path):
    finished = subprocess.Popen(["true"])
    finished.wait()  # its PID names no process now
    dead = tmp_path / f"{ADAPTER_ROOT_PREFIX}job-a-{finished.pid}"
    live = tmp_path / f"{ADAPTER_ROOT_PREFIX}job-b-{os.getpid()}"
    other = tmp_path / f"{ADAPTER_ROOT_PREFIX}not-a-pid"
    for folder in (dead, live, other):
        (folder / "v1").mkdir(parents=True)
        (folder / "v1" / "adapter_model.safetensors").write_bytes(b"x" * 1024)
    assert remove_stale_adapter_roots(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and other.exists()
