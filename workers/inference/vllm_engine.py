"""The vLLM engine of an inference server: one AsyncLLM with LoRA slots, shared by every job the server serves.

It knows nothing of jobs or adapter versions (workers/inference/adapter_book.py keeps those): it starts vLLM from
an EngineConfig (read from the job's or the pool's spec by `config_for`, with the environment a CPU engine needs
from `cpu_engine_env`), checks requests against the model's limits, generates under a LoRA id or the base model,
scores samples under the base model (the KL reference), and adds and removes LoRAs by id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpolora.api.spec import GRPOLoraJobSpec, RolloutPoolSpec, ServingSpec
from grpolora.workers.inference.member_link import MemberLink
from grpolora.workers.inference.payload import Layout, shared_payload

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

WORKER_EXTENSION = "grpolora.workers.inference.vllm_worker.AdapterExtension"


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    dtype: str
    max_lora_rank: int
    max_loras: int
    max_cpu_loras: int | None = None  # None: max_loras + 1 (room for a version arriving while two are in use)
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.85
    seed: int = 0
    enforce_eager: bool = False
    kept_versions: int = 1
    """The newest versions kept loaded while idle (grpo.maxStaleness + 1); older ones go when their requests end."""
    whole_prefills: bool = False
    """Prefill every prompt in one engine step (no chunked prefill). CPU engines need it: vLLM 0.32 rewinds a seeded
    request's generator for the token a partial prefill discards, and a CPU generator cannot be rewound ("CPU
    Generator does not use offset"), which kills the engine as soon as a round of seeded prompts (the trainer seeds
    each) is more than one step's token budget, e.g. 8 prompts x 8 of ~60 tokens."""


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token under the sampling distribution (temperature applied)
    text: str
    finish_reason: str | None
    reference_logprobs: list[float] | None = None  # the same tokens under the base model, untempered: the KL reference


@dataclass(frozen=True)
class SamplingRequest:
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    reference_logprobs: bool = False  # also score each sample under the base model (VllmEngine.reference_logprobs)
    top_k: int = 0  # 0: off (vLLM's own meaning)
    stop: Sequence[str] = ()


class InvalidRequest(ValueError):
    """A request this engine cannot serve as asked (the client's error, answered with `status`, never a 500)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class EngineLimits:
    """What a request must fit in, read from the engine once it has started."""

    max_model_len: int  # prompt and completion tokens together
    vocab_size: int  # token ids run from 0 to vocab_size - 1

    def check(self, prompts: Sequence[Sequence[int]], request: SamplingRequest) -> None:
        """Raise InvalidRequest for what vLLM would refuse only with a bare error (or not at all): ids out of
        the vocabulary (negative or huge ones overflow inside the engine) and lengths beyond the model's."""
        if request.max_tokens > self.max_model_len:
            raise InvalidRequest(f"max_tokens {request.max_tokens} exceeds the model length {self.max_model_len}")
        for index, prompt in enumerate(prompts):
            if len(prompt) >= self.max_model_len:
                raise InvalidRequest(
                    f"prompt {index} has {len(prompt)} tokens; with at least one generated token it does not fit in "
                    f"the model length {self.max_model_len}"
                )
            if request.reference_logprobs and len(prompt) + request.max_tokens >= self.max_model_len:
                raise InvalidRequest(
                    f"prompt {index} has {len(prompt)} tokens: with max_tokens {request.max_tokens} and "
                    f"reference_logprobs, prompt + completion must stay below the model length {self.max_model_len} "
                    "(vLLM scores a sequence only when one more token fits)"
                )
            self._in_vocabulary(prompt, f"prompt {index}")
        self._in_vocabulary(request.stop_token_ids, "stop_token_ids")

    def _in_vocabulary(self, ids: Sequence[int], where: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{where}: token id {bad} is out of vocabulary (valid: 0 to {self.vocab_size - 1})")


def config_for(spec: GRPOLoraJobSpec | RolloutPoolSpec, model_dir: str) -> EngineConfig:
    """The engine of a job's own inference replicas (the servers, and `grpolora eval`) or of a RolloutPool's
    servers: the serving fields (ServingSpec) decide it alike; only the LoRA slots and rank differ. A job's
    engine holds its k + 1 versions (inference.maxLoras); a pool's holds every attached job's (maxJobs x
    adaptersPerJob), each job keeping the versions its attachment says."""
    if isinstance(spec, RolloutPoolSpec):
        serving, rank, slots, seed, kept = spec, spec.max_lora_rank, spec.lora_slots, 0, 1
        # Each job may hold one version more for a moment (the new one loaded before the oldest goes).
        cpu_slots = slots + spec.max_jobs
    else:
        serving, rank, slots = spec.inference, spec.lora.vllm_max_lora_rank, spec.inference.max_loras
        seed, kept, cpu_slots = spec.grpo.seed, spec.grpo.staleness + 1, slots + 1
    gpus = serving.gpus_per_replica
    return EngineConfig(
        model_dir=model_dir,
        dtype=spec.model.dtype,
        max_lora_rank=rank,
        max_loras=slots,
        max_cpu_loras=cpu_slots,
        tensor_parallel_size=serving.tensor_parallel_size,
        max_model_len=serving.max_model_len,
        # On CPUs the KV cache is sized by VLLM_CPU_KVCACHE_SPACE; a low fraction keeps vLLM's memory check from
        # failing when the trainer shares the machine.
        gpu_memory_utilization=serving.gpu_memory_utilization if gpus else 0.05,
        seed=seed,
        enforce_eager=not gpus,  # compiling on CPUs costs minutes at start-up and gains little
        kept_versions=kept,
        whole_prefills=not gpus,
    )


# vLLM's default token budget of one engine step (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS).
DEFAULT_STEP_TOKENS = 2048


def whole_prefill_budget(config: EngineConfig) -> int:
    """Tokens one engine step may take when prompts are prefilled whole: at least the longest prompt (the context
    length; vLLM refuses less) and vLLM's default budget."""
    length = config.max_model_len
    if length is None:
        from transformers import AutoConfig

        length = getattr(AutoConfig.from_pretrained(config.model_dir), "max_position_embeddings", None) or 0
    return max(length, DEFAULT_STEP_TOKENS)


def serving_of(spec: GRPOLoraJobSpec | RolloutPoolSpec) -> ServingSpec:
    """The serving fields of a job's own servers or of a pool's."""
    return spec if isinstance(spec, RolloutPoolSpec) else spec.inference


def cpu_engine_env(spec: GRPOLoraJobSpec | RolloutPoolSpec) -> None:
    """Environment a CPU engine needs, set before vLLM starts (values already set by the user win)."""
    serving = serving_of(spec)
    if serving.gpus_per_replica:
        return
    for name, value in cpu_engine_defaults(serving.kv_cache_gib).items():
        os.environ.setdefault(name, value)


def cpu_engine_defaults(kv_cache_gib: int) -> dict[str, str]:
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        # vLLM's CPU sampler compiles small kernels with inductor; its shared precompiled headers were seen to go
        # stale between processes ("'at::vec' has not been declared"), which kills the engine. Compile without.
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
        # vLLM keeps a core for its front end by default: on a small machine that halves generation. Our front end
        # is light, and sequential GRPO leaves the trainer idle while it generates.
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        # vLLM's "auto" binds the worker's OpenMP threads one per core from the first core of the NUMA node, as if
        # the engine had the node to itself: every replica on a machine (a local run, CI, pods of a node without
        # Kubernetes' static CPU manager) then ran its worker's main thread, and the threads started from it, on
        # core 0, and a sync round of two replicas waited on one core while another idled (BENCHMARKS.md). The
        # OS places unbound threads; who dedicates cores to a replica sets the variable (an overlay's env).
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


class VllmEngine:
    """One vLLM AsyncLLM with LoRA enabled, shared by every job a server serves (one on a job's own server, the
    attached ones on a pool's). It knows nothing of versions or jobs: adapters are LoRA ids, handed out here so
    that they are unique engine-wide (vLLM's lora_int_id is; an int32 inside its batches)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._engine = None  # vllm AsyncLLM, created in start()
        self.limits: EngineLimits | None = None  # known once started
        self._last_lora_id = 0
        # The sync-group members of the jobs served here live in vLLM's first worker; this is the link to them.
        self.members: MemberLink | None = None

    async def start(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.config
        args = AsyncEngineArgs(
            model=cfg.model_dir,
            tokenizer=cfg.model_dir,
            dtype=cfg.dtype,  # explicit: left unset, a float32 model would be served in bfloat16
            seed=cfg.seed,
            enable_lora=True,
            max_lora_rank=cfg.max_lora_rank,
            max_loras=cfg.max_loras,
            max_cpu_loras=cfg.max_cpu_loras or cfg.max_loras + 1,
            tensor_parallel_size=cfg.tensor_parallel_size,
            max_model_len=cfg.max_model_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
            **(
                {"enable_chunked_prefill": False, "max_num_batched_tokens": whole_prefill_budget(cfg)}
                if cfg.whole_prefills
                else {}
            ),
            # Logprobs of the distribution tokens were sampled from (temperature applied): the behaviour policy
            # that GRPO's importance ratio needs.
            logprobs_mode="processed_logprobs",
            # vLLM's statistics (KV-cache usage, queue, preemptions: what maxNumSeqs and gpuMemoryUtilization are
            # tuned with), served beside ours on /metrics (metrics.exposition) and logged every 10 s.
            disable_log_stats=False,
            # Adapters are built from memory in vLLM's own workers (workers/inference/vllm_worker.py).
            worker_extension_cls=WORKER_EXTENSION,
        )
        self._engine = AsyncLLM.from_engine_args(args)
        model_config = self._engine.model_config
        self.limits = EngineLimits(model_config.max_model_len, model_config.get_vocab_size())
        self.members = MemberLink()
        await self.members.start(
            lambda address, key: self._engine.collective_rpc(
                "grpolora_member_host", args=(address, key, sorted(os.sched_getaffinity(0)))
            )
        )
        log.info("vLLM engine ready: %s (%s)", cfg.model_dir, cfg.dtype)

    @property
    def started(self) -> bool:
        return self._engine is not None

    @property
    def dead(self) -> bool:
        """vLLM's engine is gone for good: its EngineCore process (or, with TP > 1, a worker, which takes the core
        down with it) died. MPClient's monitor thread sees the process end and sets the flag AsyncLLM.errored reads
        (vllm/v1/engine/core_client.py, start_engine_core_monitor): every later call would raise EngineDeadError."""
        return self._engine is not None and self._engine.errored

    async def round_trip(self) -> None:
        """One call through the engine to every worker and back: returns once each has answered. vLLM's EngineCore
        serves it between two engine steps (EngineCore.collective_rpc, a utility call of its busy loop), and each
        worker answers it on the thread that runs the model (WorkerBase.check_health, vllm/v1/worker/worker_base.py),
        so an engine whose step never ends (a wedged GPU, a deadlock, a stopped process) never answers: `dead` stays
        false for it, since its processes live. The caller bounds the wait (app.EngineProbe)."""
        await self._engine.collective_rpc("check_health")

    def shutdown(self) -> None:
        members, self.members = self.members, None
        if members is not None:
            members.close()
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def new_lora_id(self) -> int:
        """A LoRA id never used before in this engine (called on the event loop only)."""
        self._last_lora_id += 1
        return self._last_lora_id

    async def add_lora(self, request, tensors: Mapping[str, torch.Tensor], adapter_config: dict) -> None:
        """Load the adapter of `request` (a LoRARequest from vllm_worker.lora_request) from its tensors: they travel
        to vLLM's workers as one payload in shared memory, between engine steps, and become a LoRA model there (no
        folder)."""
        with shared_payload(tensors) as (segment, size, layout):
            await self.add_staged_lora(request, segment, size, layout, adapter_config)

    async def add_staged_lora(self, request, segment: str, size: int, layout: Layout, adapter_config: dict) -> None:
        """Load the adapter of `request` from a payload already in shared-memory `segment` (where a sync member
        received and verified it): every worker maps it and builds its LoRA, between engine steps."""
        await self._engine.collective_rpc(
            "grpolora_add_adapter",
            args=(request.lora_name, request.lora_int_id, segment, size, layout, adapter_config),
        )

    async def remove_lora(self, lora_id: int) -> None:
        await self._engine.collective_rpc("grpolora_remove_adapter", args=(lora_id,))

    async def held_adapters(self) -> list[list[int]]:
        """Per vLLM worker, the LoRA ids whose payloads it holds."""
        return await self._engine.collective_rpc("grpolora_held_adapters")

    async def list_loras(self) -> list[int]:
        """The LoRA ids vLLM itself holds (what really is loaded, whatever the book-keeping says)."""
        return sorted(await self._engine.list_loras())

    async def generate(self, prompt_token_ids: list[int], request: SamplingRequest, lora) -> list[Sample]:
        """`request.n` samples for one prompt under `lora` (a LoRARequest, or None for the base model)."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError, VLLMUnprocessableEntityError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        final = None
        try:
            params = SamplingParams(
                n=request.n,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
                max_tokens=request.max_tokens,
                seed=request.seed,
                stop=list(request.stop) or None,
                logprobs=0,  # the sampled token's own logprob
                stop_token_ids=list(request.stop_token_ids) or None,
                # One output holding all n samples; streamed outputs of n > 1 can carry only the samples that moved.
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            async for output in self._engine.generate(
                TokensPrompt(prompt_token_ids=prompt_token_ids), params, uuid.uuid4().hex, lora_request=lora
            ):
                final = output
        except VLLMClientError as exc:  # vLLM's own verdict on the request: the client's error, with its reason
            raise InvalidRequest(str(exc), 422 if isinstance(exc, VLLMUnprocessableEntityError) else 400) from None
        assert final is not None
        samples = []
        for completion in sorted(final.outputs, key=lambda c: c.index):
            token_ids = list(completion.token_ids)
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs or [], token_ids, strict=True)]
            samples.append(Sample(token_ids, logprobs, completion.text, completion.finish_reason))
        return samples

    async def reference_logprobs(self, prompt_token_ids: list[int], samples: list[Sample]) -> list[Sample]:
        """`samples` with the logprobs of their tokens under the base model (adapter off), the KL term's reference:
        each prompt + completion is prefilled once without a LoRA and vLLM's prompt logprobs read at the completion
        positions. Prompt logprobs skip vLLM's sampling processors, so they are the untempered distribution's
        (GRPOSpec allows `referenceFrom: inference` only at temperature 1 and topP 1, where the two agree)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # One output token is the least vLLM generates; greedy, so no seed is drawn for it.
        params = SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
        )

        async def score(sample: Sample) -> Sample:
            if not sample.token_ids:
                return dataclasses.replace(sample, reference_logprobs=[])
            sequence = prompt_token_ids + sample.token_ids
            final = None
            async for output in self._engine.generate(
                TokensPrompt(prompt_token_ids=sequence), params, uuid.uuid4().hex, lora_request=None
            ):
                final = output
            assert final is not None and final.prompt_logprobs is not None
            # prompt_logprobs[i] is the dict for token i given tokens < i (None at i = 0); prompt_logprobs=0 still
            # holds the token's own logprob.
            tail = final.prompt_logprobs[len(prompt_token_ids) :]
            reference = [step[token].logprob for step, token in zip(tail, sample.token_ids, strict=True)]
            return dataclasses.replace(sample, reference_logprobs=reference)

        return list(await asyncio.gather(*(score(sample) for sample in samples)))

    def tokenizer(self):
        """The model's tokenizer, as vLLM loaded it (the chat sessions render with it)."""
        return self._engine.get_tokenizer()

    async def encode(self, text: str) -> list[int]:
        tokenizer = self._engine.get_tokenizer()
        return list(tokenizer.encode(text))
