"""Which adapter versions an inference engine keeps loaded under grpo.maxStaleness = k: the newest k + 1 (live
included), which buffered and in-flight work may still ask for, plus any version a request is still running on;
the rest go as soon as their last request ends. Version 0 is the base model: nothing to unload."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from grpolora.api.spec import min_lora_slots
from grpolora.workers.inference.adapter_book import OwnEngineBook, versions_to_unload
from grpolora.workers.inference.vllm_engine import EngineConfig, config_for
from grpolora.workers.inference.vllm_worker import AdapterExtension
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


def test_cpu_engines_prefill_whole_prompts_in_a_budget_that_holds_the_longest():
    """(test_inference_sync.py shows the engine death this avoids, on a real engine.)"""
    from grpolora.api.load import parse_job
    from grpolora.workers.inference.vllm_engine import whole_prefill_budget

    cpu = config_for(parse_job(job_doc(inference={"gpusPerReplica": 0, "maxModelLen": 4096})).spec, "model")
    gpu = config_for(parse_job(job_doc()).spec, "model")
    assert cpu.whole_prefills and not gpu.whole_prefills
    assert whole_prefill_budget(cpu) == 4096
    assert whole_prefill_budget(replace(cpu, max_model_len=256)) == 2048


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
    """OwnEngineBook's own leasing and unloading (vLLM's remove_lora recorded: the real engine's side of loading
    is in tests/workers/test_inference_sync.py)."""
    import asyncio

    from grpolora.workers.inference.adapter_book import OwnEngineBook, VersionUnavailable

    class RemoveRecorder:
        def __init__(self) -> None:
            self.removed: list[int] = []

        async def remove_lora(self, lora_id: int) -> None:
            self.removed.append(lora_id)

    async def scenario() -> list[int]:
        config = EngineConfig(model_dir="m", dtype="float32", max_lora_rank=8, max_loras=3, kept_versions=3)
        engine = OwnEngineBook(config)
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


class SlowRemover:
    """vLLM's remove_lora, held inside until the gate opens; each call announced as it enters."""

    def __init__(self) -> None:
        self.entered: asyncio.Queue[int] = asyncio.Queue()
        self.gate = asyncio.Event()
        self.removed: list[int] = []
        self.last_lora_id = 3  # the books below have ids 1 to 3 loaded

    def new_lora_id(self) -> int:
        self.last_lora_id += 1
        return self.last_lora_id

    async def remove_lora(self, lora_id: int) -> None:
        await self.entered.put(lora_id)
        await self.gate.wait()
        self.removed.append(lora_id)


def book_unloading_through(vllm: SlowRemover, tmp_path) -> OwnEngineBook:
    """A book of one job with versions 1, 2 and 3 loaded (LoRA id = version) and 3 live; its window keeps one
    version, so 1 and 2 are to go; vLLM's side is `vllm`. Made inside the event loop that runs the scenario."""
    config = EngineConfig(model_dir="m", dtype="float32", max_lora_rank=8, max_loras=2, kept_versions=1)
    engine = OwnEngineBook(config)
    engine._engine = vllm
    engine._version_changed = asyncio.Condition()
    engine._loaded, engine._live_version = {1: 1, 2: 2, 3: 3}, 3
    return engine


def test_versions_leaving_at_once_are_each_unloaded_once_and_nothing_raises(tmp_path):
    """Two unloads overlap while vLLM's remove_lora is still running for the first: an activation's (versions 1 and
    2 out of the window) and a request's lease exit (which finds 2 still loaded). Each version must be removed once,
    and neither caller may raise: a KeyError there was a 500 at a lease exit, or ACTIVATION_FAILED for a version
    that went live."""

    async def scenario() -> None:
        vllm = SlowRemover()
        engine = book_unloading_through(vllm, tmp_path)
        leased, done = asyncio.Event(), asyncio.Event()

        async def request() -> None:  # a request on the live version, ending while the activation unloads
            async with engine.lease(3, wait_seconds=1):
                leased.set()
                await done.wait()

        running = asyncio.create_task(request())
        await leased.wait()
        activation = asyncio.create_task(engine._unload_unneeded())  # how _activate ends
        assert await vllm.entered.get() == 1  # the activation is inside remove_lora(1), version 2 next on its list
        done.set()
        assert await vllm.entered.get() == 2  # the lease exit found 2 loaded and is removing it
        vllm.gate.set()
        await asyncio.wait_for(asyncio.gather(activation, running), 10)
        assert sorted(vllm.removed) == [1, 2] and engine.loaded_versions() == [3]

    asyncio.run(scenario())


def test_a_detach_during_an_unload_removes_each_version_once(tmp_path):
    """A job detached (close) while a lease exit is still unloading versions the window left: close must not
    remove a version the other is about to remove, nor the other one close has removed (vLLM would be asked twice)."""

    async def scenario() -> None:
        vllm = SlowRemover()
        engine = book_unloading_through(vllm, tmp_path)
        leased, done = asyncio.Event(), asyncio.Event()

        async def request() -> None:
            async with engine.lease(3, wait_seconds=1):
                leased.set()
                await done.wait()

        running = asyncio.create_task(request())
        await leased.wait()
        done.set()
        assert await vllm.entered.get() == 1  # the lease exit is removing 1, with 2 next on its list
        detaching = asyncio.create_task(engine.close())
        assert await vllm.entered.get() == 2  # the detach removes what is left: 2 first
        vllm.gate.set()
        await asyncio.wait_for(asyncio.gather(running, detaching), 10)
        assert sorted(vllm.removed) == [1, 2, 3] and engine.lora_ids() == []

    asyncio.run(scenario())


def test_an_activation_is_acknowledged_without_waiting_for_the_old_versions_unload(tmp_path):
    """The sync member acknowledges a round once `_activate` returns, and the trainer's send() waits for that: the
    version that left the window is vLLM's housekeeping, not the round's (a remove_lora was ~5 ms of a ~100 ms round
    on CPUs). Activation returns while vLLM is still inside remove_lora, and the unload still completes."""

    async def scenario() -> None:
        vllm = SlowRemover()
        engine = book_unloading_through(vllm, tmp_path)  # window of one version: 1 and 2 are to go

        async def add(request) -> None:
            pass

        await asyncio.wait_for(engine._activate(4, 0, add), 10)  # returns though remove_lora(1) cannot finish yet
        assert engine.live_version == 4
        assert await vllm.entered.get() == 1  # the unload is under way all the same
        vllm.gate.set()
        await asyncio.wait_for(engine.close(), 10)  # detaching waits for nothing more than it did
        assert sorted(vllm.removed) == [1, 2, 3, 4] and engine.lora_ids() == []

    asyncio.run(scenario())


def test_an_activation_of_a_version_not_newer_than_the_live_one_loads_nothing(tmp_path):
    """Versions only grow on a replica. An activation of the live version (or an older one) made it live a second
    time under a new LoRA id and dropped the older id from the book: loaded in vLLM for good, never unloaded."""

    async def scenario() -> None:
        vllm = SlowRemover()
        vllm.gate.set()
        engine = book_unloading_through(vllm, tmp_path)  # 1, 2, 3 loaded (id = version), 3 live
        added: list[int] = []

        async def add(request) -> None:
            added.append(request.lora_int_id)

        for version in (3, 2):
            with pytest.raises(RuntimeError, match=f"version {version} is not newer than the live version 3"):
                await engine._activate(version, 0, add)
        assert added == [] and engine.live_version == 3 and engine._loaded == {1: 1, 2: 2, 3: 3}

    asyncio.run(scenario())


def test_a_failed_or_stuck_activation_leaves_no_lora_id_behind(tmp_path, monkeypatch):
    """An activation is one collective_rpc into every TP worker: one failing (CUDA OOM on rank 1) left the LoRA
    loaded on the others under an id the book never recorded; one never answering held the sync member for good.
    Both now fail the activation (the member reports it, the older version keeps serving) and remove the id."""
    from grpolora.workers.inference import adapter_book

    monkeypatch.setattr(adapter_book, "ACTIVATION_TIMEOUT_SECONDS", 0.2)

    async def scenario() -> None:
        vllm = SlowRemover()
        vllm.gate.set()
        engine = book_unloading_through(vllm, tmp_path)

        async def fails_on_one_worker(request) -> None:
            raise RuntimeError("worker 1: CUDA out of memory")

        async def never_answers(request) -> None:
            await asyncio.Event().wait()

        with pytest.raises(RuntimeError, match="CUDA out of memory"):
            await engine._activate(4, 0, fails_on_one_worker)
        with pytest.raises(TimeoutError, match=r"version 5 not loaded by vLLM's workers within 0\.2s"):
            await engine._activate(5, 0, never_answers)
        assert vllm.removed == [4, 5]  # the ids each may have left on some workers
        assert engine.live_version == 3 and 4 not in engine._loaded and 5 not in engine._loaded

    asyncio.run(scenario())


def test_the_cleanup_of_a_stuck_activation_on_a_wedged_engine_is_bounded_too(tmp_path, monkeypatch):
    """A wedged engine (alive, not stepping: watch_engine never fires) answers neither the activation nor the removal
    that cleans it up. The removal had no bound: the book's call, the member's receiver thread waiting for the answer,
    and with it the tenant's every later round, hung for good. Both are bounded: the member hears of the failure
    within ACTIVATION_TIMEOUT_SECONDS + REMOVAL_TIMEOUT_SECONDS, twice in a row."""
    from grpolora.workers.inference import adapter_book

    monkeypatch.setattr(adapter_book, "ACTIVATION_TIMEOUT_SECONDS", 0.2)
    monkeypatch.setattr(adapter_book, "REMOVAL_TIMEOUT_SECONDS", 0.2)

    async def scenario() -> None:
        vllm = SlowRemover()  # its gate stays shut: removals never finish
        engine = book_unloading_through(vllm, tmp_path)

        async def never_answers(request) -> None:
            await asyncio.Event().wait()

        for version in (4, 5):
            with pytest.raises(TimeoutError, match=f"version {version} not loaded"):
                await asyncio.wait_for(engine._activate(version, 0, never_answers), 5)
        assert engine.live_version == 3 and 4 not in engine._loaded and 5 not in engine._loaded
        vllm.gate.set()

    asyncio.run(scenario())


class TPWorker(AdapterExtension):
    """One TP rank's vLLM worker as the extension uses it: vLLM's Worker.add_lora/remove_lora (each answers a
    bool), the LoRA ids loaded on this rank, and the extension's held payloads (real shared-memory mappings)."""

    def __init__(self, rank: int, fails: bool = False):
        self.rank, self.fails = rank, fails
        self.loras: set[int] = set()
        self._grpolora_adapters: dict = {}  # made here: no vLLM loader to hook

    def add_lora(self, request) -> bool:
        if self.fails:
            raise RuntimeError(f"worker {self.rank}: CUDA out of memory")
        self.loras.add(request.lora_int_id)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        present = lora_id in self.loras
        self.loras.discard(lora_id)
        return present


class TensorParallelExecutor:
    """AsyncLLM.collective_rpc over vLLM's MultiprocExecutor (vllm/v1/executor/multiproc_executor.py,
    collective_rpc): the call is broadcast to every worker through one queue, so each runs it whatever the others
    do; the responses are then read in rank order and the first that is not a success raises
    RuntimeError("Worker failed with error ...") -- with the other ranks' work already done."""

    def __init__(self, workers: list[TPWorker]):
        self.workers = workers

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        outcomes = []
        for worker in self.workers:
            try:
                outcomes.append((True, getattr(worker, method)(*args)))
            except Exception as exc:
                outcomes.append((False, exc))
        for ok, result in outcomes:
            if not ok:
                raise RuntimeError(f"Worker failed with error '{result}', please check the stack trace above")
        return [result for _, result in outcomes]


def test_an_activation_failing_on_one_of_two_tp_workers_leaves_the_lora_on_neither():
    """Issue 36: with tensor parallelism an activation is one collective_rpc into every worker. Rank 1 running out
    of memory while rank 0 loads the LoRA (and maps its payload) left rank 0 holding both under an id the book never
    recorded, for the engine's life. The book removes the id on every worker; a later version loads on both."""
    workers = [TPWorker(0), TPWorker(1, fails=True)]
    config = EngineConfig(model_dir="m", dtype="float32", max_lora_rank=8, max_loras=2, kept_versions=1)
    tensors = {"layers.0.q_proj.lora_A.weight": torch.ones(8, 4), "layers.0.q_proj.lora_B.weight": torch.ones(4, 8)}

    async def scenario() -> None:
        book = OwnEngineBook(config)
        book._engine._engine = TensorParallelExecutor(workers)
        book._loop, book._version_changed = asyncio.get_running_loop(), asyncio.Condition()
        with pytest.raises(RuntimeError, match="worker 1: CUDA out of memory"):
            await asyncio.to_thread(book.activate, 1, tensors, {"r": 8})
        assert [w.loras for w in workers] == [set(), set()]
        assert [w._grpolora_adapters for w in workers] == [{}, {}]  # rank 0's payload mapping closed too
        assert book.live_version == 0 and book.lora_ids() == []
        workers[1].fails = False
        await asyncio.to_thread(book.activate, 1, tensors, {"r": 8})
        lora_id = book.lora_ids()
        assert [sorted(w.loras) for w in workers] == [lora_id, lora_id] and book.live_version == 1
        for worker in workers:
            for held in worker._grpolora_adapters.values():
                held.payload.close()

    asyncio.run(scenario())
