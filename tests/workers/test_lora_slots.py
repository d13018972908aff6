"""Which adapter versions an inference engine keeps loaded under grpo.maxStaleness = k: the newest k + 1 (live
included), which buffered and in-flight work may still ask for, plus any version a request is still running on;
the rest go as soon as their last request ends. Version 0 is the base model: nothing to unload."""

from __future__ import annotations

import pytest

from grpolora.api.spec import min_lora_slots
from grpolora.workers.inference.engine import EngineConfig, config_for, versions_to_unload
from tests.helpers import job_doc


@pytest.mark.parametrize(
    ("loaded", "live", "leases", "kept", "unload"),
    [
        # k = 0 (keep 1): the previous version goes once idle, stays while a request runs on it.
        ({4, 5}, 5, {}, 1, [4]),
        ({4, 5}, 5, {4: 2}, 1, []),
        # k = 2 (keep 3): live 7 keeps 5, 6, 7; 4 goes, 3 stays for its running request.
        ({3, 4, 5, 6, 7}, 7, {3: 1}, 3, [4]),
        ({5, 6, 7}, 7, {}, 3, []),
        # A late request's lease on the live version or inside the window changes nothing.
        ({2, 3}, 3, {3: 1, 2: 1}, 2, []),
        # The base model (0) is never unloaded; an empty engine has nothing to unload.
        ({0, 1}, 1, {}, 1, []),
        (set(), 0, {}, 1, []),
    ],
)
def test_versions_to_unload(loaded, live, leases, kept, unload):
    assert versions_to_unload(loaded, live=live, leases=leases, kept=kept) == unload


def test_engine_keeps_k_plus_one_versions_in_its_slots():
    spec = job_doc(grpo={"maxStaleness": 2}, inference={"maxLoras": 3, "gpusPerReplica": 0})
    from grpolora.api.load import parse_job

    config = config_for(parse_job(spec).spec, "model")
    assert isinstance(config, EngineConfig)
    assert (config.kept_versions, config.max_loras) == (3, 3)
    assert min_lora_slots(0) == min_lora_slots(1) == 2 and min_lora_slots(2) == 3


def test_render_shows_the_slots_in_the_inference_args():
    from grpolora.api.load import parse_job
    from grpolora.api.plan import plan
    from grpolora.operator.builders import build_children

    job = parse_job(job_doc(grpo={"maxStaleness": 3}, inference={"maxLoras": 4}))
    args = {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["args"]
        for o in build_children(plan(job), owner_uid="1", token="t")
        if o["kind"] in ("StatefulSet", "Job")
    }
    assert ["worker", "inference", "--lora-slots=4"] in args.values()
    assert ["worker", "trainer"] in args.values()


def test_an_inference_worker_refuses_slots_that_disagree_with_its_spec():
    import os
    import subprocess
    import sys

    from grpolora.api.load import parse_job
    from grpolora.api.plan import plan

    job = parse_job(job_doc(inference={"maxLoras": 3}))
    env = {**os.environ, **plan(job).env_for("inference", 0, token="t")}
    command = [sys.executable, "-P", "-m", "grpolora.cli", "worker", "inference", "--lora-slots=5"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--lora-slots=5 but the spec's inference.maxLoras is 3" in result.stderr


def test_an_engine_serves_versions_in_its_window_and_unloads_an_old_one_when_its_request_ends(tmp_path):
    """AdapterEngine's own leasing and unloading (vLLM's remove_lora recorded: the real engine's side of loading
    is in tests/workers/test_inference_sync.py)."""
    import asyncio

    from grpolora.workers.inference.engine import AdapterEngine, VersionUnavailable

    class RemoveRecorder:
        def __init__(self) -> None:
            self.removed: list[int] = []

        async def remove_lora(self, lora_id: int) -> None:
            self.removed.append(lora_id)

    async def scenario() -> list[int]:
        config = EngineConfig(model_dir="m", dtype="float32", max_lora_rank=8, max_loras=3, kept_versions=3)
        engine = AdapterEngine(config, adapter_root=tmp_path)
        engine._engine = vllm = RemoveRecorder()
        engine._version_changed = asyncio.Condition()
        engine._loaded, engine._live_version = {v: v for v in (1, 2, 3, 4)}, 4  # k = 2: 2, 3, 4 kept (id = version)
        async with engine.lease(1, wait_seconds=1):  # a request still running on version 1 ...
            async with engine.lease(2, wait_seconds=1):  # ... and one for a version in the window: served
                pass
            engine._live_version = 5
            await engine._unload_unneeded()
            assert vllm.removed == [2]  # 2 fell out of the window (3, 4, 5); 1 is still in use
        assert vllm.removed == [2, 1]  # ... and goes when its request ends
        try:
            async with engine.lease(2, wait_seconds=1):
                pass
        except VersionUnavailable:
            return engine.loaded_versions()
        raise AssertionError("a version out of the window was served")

    assert asyncio.run(scenario()) == [3, 4, 5]
