"""The GPU probes (bench/gpu_probe_*.py) where they mean something on CPUs: the formation bound and the epochs walk
over gloo, as `--backend gloo` runs them, so that the scripts a device run relies on do not rot unseen. What only a GPU
can say (NCCL's blocking init, an abort's wait, empty_cache) waits for one: docs/design.md, the GPU risks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from grpolora.testing.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


def load_probe(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_formation_probe_over_gloo_gives_up_within_the_join_timeout_and_forms_the_next_epoch():
    probe = load_probe("gpu_probe_formation")
    port = free_port()
    peer = probe.start_peer(port)
    try:
        line = probe.project("gloo", port, join_timeout=1.0)
    finally:
        peer.kill()
        peer.wait()
    assert line.startswith("project/gloo: PASS: TransportError after 1."), line
    assert "the next epoch formed in" in line


def test_the_epochs_probe_over_gloo_finds_no_leak_and_no_c10d_thread():
    line = load_probe("gpu_probe_epochs").walk("gloo", epochs=4, payload_bytes=1 << 20)
    assert line.startswith("epochs/gloo: PASS:"), line
    assert "c10d threads seen: none" in line and "threads +0, descriptors +0" in line
