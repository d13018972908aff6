"""Adapters built from memory in vLLM's workers (workers/inference/vllm_worker.py): the payload format, and a real
vLLM CPU engine whose LRU cache holds a single LoRA, so that adding a second adapter evicts the first and asking
for the first again makes vLLM build it once more from the same held payload. (Every sync test, in
test_inference_sync.py and test_pool_server.py, activates through this same path; parity there too.)"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from peft import set_peft_model_state_dict

from grpolora.workers.adapter import lora_config, lora_tensors
from grpolora.workers.inference.payload import ALIGN, SharedPayload, pack_payload, shared_payload, unpack_payload
from grpolora.workers.inference.vllm_engine import EngineConfig, SamplingRequest, VllmEngine, cpu_engine_defaults
from grpolora.workers.inference.vllm_worker import lora_request
from grpolora.workers.models import resolve_model
from tests.workers.episode_parity import multi_turn_episode, trainer_episode_delta
from tests.workers.parity import hf_logprobs, peft_policy, randomize_adapter, tokens

log = logging.getLogger(__name__)


def test_a_payload_unpacks_to_the_same_tensors_each_in_memory_of_its_own():
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),  # 14 bytes: the next tensor still starts aligned
        "c": torch.randn(2, 3).to(torch.float16),
        "empty": torch.empty(0, 4),
    }
    payload, layout = pack_payload(tensors)
    assert all(offset % ALIGN == 0 for _, _, _, offset, _ in layout)
    held = bytes(payload)  # what a worker keeps
    first, second = unpack_payload(held, layout), unpack_payload(held, layout)
    for name, tensor in tensors.items():
        assert first[name].dtype == tensor.dtype and torch.equal(first[name], tensor)
    # vLLM scales lora_B in place: one build's tensors must never be another's.
    first["a"] *= 2
    assert torch.equal(second["a"], tensors["a"])


def test_a_shared_payload_outlives_its_name_in_the_workers_mapping():
    from multiprocessing import shared_memory

    tensors = {"a": torch.randn(4, 8), "b": torch.randn(3).to(torch.bfloat16)}
    with shared_payload(tensors) as (segment, size, layout):
        held = SharedPayload(segment, size)  # what a worker maps before the call returns
    with pytest.raises(FileNotFoundError):  # the name is gone as the call ends ...
        shared_memory.SharedMemory(name=segment)
    for _ in range(2):  # ... and the worker's mapping still holds the bytes, for every build
        assert all(torch.equal(t, tensors[k]) for k, t in unpack_payload(held, layout).items())
    held.close()


def mapped_file(address: int) -> str | None:
    """The file mapped at `address` in this process (/proc/self/maps), if any."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def test_a_build_maps_its_payload_copy_on_write_so_only_what_vllm_scales_is_copied():
    """A build used to copy the whole payload out of the worker's mapping first (two copies of 19.5 MB, with a
    page fault per page each: 19 ms of the quickstart's ~38 ms activation in a profile), although vLLM writes to
    lora_B alone. Each build now maps the segment privately (MAP_PRIVATE): the tensors read the segment's pages,
    and a page is copied only when vLLM scales something in it, never into the segment or another build."""
    tensors = {"lora_A": torch.randn(16, 64), "lora_B": torch.randn(64, 16)}
    with shared_payload(tensors) as (segment, size, layout):
        held = SharedPayload(segment, size)
    first, second = unpack_payload(held, layout), unpack_payload(held, layout)
    assert mapped_file(first["lora_A"].data_ptr()) == f"/dev/shm/{segment} (deleted)"
    first["lora_B"] *= 2  # as vLLM's LoRALayerWeights.optimize folds the scaling in
    assert torch.equal(second["lora_B"], tensors["lora_B"])
    assert torch.equal(unpack_payload(held, layout)["lora_B"], tensors["lora_B"])
    held.close()  # the builds' tensors keep their own mappings
    assert torch.equal(first["lora_B"], tensors["lora_B"] * 2) and torch.equal(first["lora_A"], tensors["lora_A"])


WORKER_SHARES_THE_TRACKER = """
import multiprocessing as mp
import torch
from grpolora.workers.inference.payload import SharedPayload, shared_payload

def worker(name, size, done):
    SharedPayload(name, size).close()
    done.put(True)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")  # as vLLM starts its workers: they share this process's resource tracker
    with shared_payload({"a": torch.arange(8, dtype=torch.float32)}) as (name, size, _):
        done = ctx.Queue()
        child = ctx.Process(target=worker, args=(name, size, done))
        child.start()
        assert done.get(timeout=60)
        child.join()
    print("activated")
"""


def test_a_worker_mapping_a_shared_payload_leaves_the_servers_resource_tracker_alone(tmp_path):
    """vLLM's workers are the server's multiprocessing children and share its resource tracker. A worker that
    opened the segment with shared_memory.SharedMemory registered the name there and unregistered it again, taking
    the server's own registration with it: the server's unlink then made the tracker print a KeyError traceback
    (seen in every `grpolora eval`), and a tracker that saw the worker's registration last warned of a leak."""
    import subprocess
    import sys

    script = tmp_path / "activation.py"
    script.write_text(WORKER_SHARES_THE_TRACKER, encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "activated", result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "leaked" not in result.stderr, result.stderr[-3000:]


def test_a_layout_reaching_past_the_payload_is_refused():
    payload, layout = pack_payload({"a": torch.zeros(4)})
    name, dtype, shape, offset, nbytes = layout[0]
    with pytest.raises(ValueError, match="outside the payload"):
        unpack_payload(payload, [(name, dtype, shape, offset + len(payload) - 8, nbytes)])


@pytest.mark.vllm
def test_an_adapter_evicted_by_vllms_lru_is_rebuilt_with_the_same_logprobs(monkeypatch, tmp_path):
    """max_loras = max_cpu_loras = 1: adding B makes vLLM's LRU drop A's LoRA model, and a request for A makes
    vLLM build it again from the payload its workers hold. vLLM folds alpha / r into lora_B in place when it
    adds a model: built twice from one tensor, A would be scaled twice and serve other logprobs."""
    import torch._inductor.config

    model_dir = resolve_model("offline:tiny-llama")
    serving = cpu_engine_defaults(kv_cache_gib=1) | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    for name, value in serving.items():  # what cpu_engine_env sets in a server, undone after this test
        monkeypatch.setenv(name, value)
    # vLLM's processes fork from this one, whose inductor read TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS long ago
    # (cpu_engine_env says why it is off); its kernels are compiled afresh in a cache of this test's own.
    monkeypatch.setattr(torch._inductor.config, "cpp_cache_precompile_headers", False)
    config = EngineConfig(
        model_dir=str(model_dir),
        dtype="float32",
        max_lora_rank=8,
        max_loras=1,
        max_cpu_loras=1,
        max_model_len=256,
        gpu_memory_utilization=0.05,
        enforce_eager=True,
        whole_prefills=True,
    )
    policy = peft_policy(model_dir)
    prompt = tokens(model_dir)
    adapters = {}
    for name, seed in (("a", 1), ("b", 2)):
        randomize_adapter(policy, seed=seed)
        adapters[name] = ({k: v.clone() for k, v in lora_tensors(policy).items()}, lora_config(policy))
    greedy = SamplingRequest(n=1, temperature=0.0, top_p=1.0, max_tokens=8)

    async def scenario():
        engine = VllmEngine(config)
        await engine.start()
        try:
            ids = {"a": engine.new_lora_id(), "b": engine.new_lora_id()}

            async def served(name: str):
                [sample] = await engine.generate(prompt, greedy, lora_request(name, ids[name]))
                return sample

            await engine.add_lora(lora_request("a", ids["a"]), *adapters["a"])
            first = await served("a")
            await engine.add_lora(lora_request("b", ids["b"]), *adapters["b"])
            evicted = await engine.list_loras()
            other = await served("b")
            episode = await multi_turn_episode(engine, lora_request("b", ids["b"]), model_dir)  # issue 39's parity
            again = await served("a")  # rebuilt from the held payload
            rebuilt = await engine.list_loras()
            held = await engine.held_adapters()
            await engine.remove_lora(ids["a"])
            return first, other, again, evicted, rebuilt, held, await engine.held_adapters(), ids, episode
        finally:
            engine.shutdown()

    first, other, again, evicted, rebuilt, held, held_after, ids, episode = asyncio.run(scenario())
    assert evicted == [ids["b"]] and rebuilt == [ids["a"]]  # A left vLLM's cache, then came back
    assert held == [[ids["a"], ids["b"]]] and held_after == [[ids["b"]]]  # payloads held until removed
    assert again.token_ids == first.token_ids
    assert max(abs(x - y) for x, y in zip(again.logprobs, first.logprobs, strict=True)) <= 1e-5
    for name, sample in (("a", first), ("b", other)):
        set_peft_model_state_dict(policy, adapters[name][0])
        delta = (hf_logprobs(policy, prompt, sample.token_ids) - torch.tensor(sample.logprobs)).abs().max().item()
        log.warning("from memory: adapter %s, max |dlogprob| against float32 peft = %.2e", name, delta)
        assert delta <= 1e-3
    # A multi-turn episode (environment tokens between two assistant turns): the trainer's logprobs of every
    # assistant token match vLLM's (tests/workers/episode_parity.py).
    delta = trainer_episode_delta(model_dir, adapters["b"][0], episode)
    log.warning("multi-turn episode: max |dlogprob| over %d assistant tokens = %.2e", sum(episode.mask), delta)
    assert delta <= 1e-3
