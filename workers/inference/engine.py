"""A vLLM engine with LoRA slots, serving adapter versions that arrive by sync.

Every synced adapter becomes a new LoRA id (= its version), so activation never waits for a drain: a new
version is loaded next to the old one, new requests get it from the moment it is live, requests already running
finish on the version they started with, and an old one is unloaded when its last request ends. Under
grpo.maxStaleness = k the engine keeps the newest k + 1 versions loaded (buffered and in-flight rollouts may still
ask for them), so it needs k + 1 LoRA slots and never fewer than two (`inference.maxLoras`, checked by the spec);
version 0 is the base model (no adapter).

Adapters reach vLLM through its public API: the verified tensors are written as a standard peft folder on tmpfs
and loaded with `add_lora(LoRARequest(...))`, so the same path works for any tensor- or data-parallel layout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from grpolora.api.spec import GRPOLoraJobSpec, RolloutPoolSpec, ServingSpec
from grpolora.workers.adapter import save_adapter
from grpolora.workers.inference import metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    dtype: str
    max_lora_rank: int
    max_loras: int
    max_cpu_loras: int | None = None  # None: max_loras + 1 (room for a version arriving while two are in use)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
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


class VersionUnavailable(RuntimeError):
    """The requested adapter version is not (or no longer) served here."""


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
        data_parallel_size=max(gpus // serving.tensor_parallel_size, 1),
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


def versions_to_unload(loaded: Iterable[int], *, live: int, leases: Mapping[int, int], kept: int) -> list[int]:
    """The loaded adapter versions to unload now: older than the newest `kept` (live - kept + 1 ... live) and with
    no request running on them. Version 0 is the base model, never unloaded."""
    return sorted(v for v in loaded if 0 < v <= live - kept and not leases.get(v))


def cpu_engine_env(spec: GRPOLoraJobSpec | RolloutPoolSpec) -> None:
    """Environment a CPU engine needs, set before vLLM starts (values already set by the user win)."""
    serving = serving_of(spec)
    if serving.gpus_per_replica:
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(serving.kv_cache_gib))
    # vLLM's CPU sampler compiles small kernels with inductor; its shared precompiled headers were seen to go
    # stale between processes ("'at::vec' has not been declared"), which kills the engine. Compile without.
    os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")
    # vLLM keeps a core for its front end by default: on a small machine that halves generation. Our front end
    # is light, and sequential GRPO leaves the trainer idle while it generates.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


class VllmEngine:
    """One vLLM AsyncLLM with LoRA enabled, shared by every job a server serves (one on a job's own server, the
    attached ones on a pool's). It knows nothing of versions or jobs: adapters are LoRA ids, handed out here so
    that they are unique engine-wide (vLLM's lora_int_id is; an int32 inside its batches)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._engine = None  # vllm AsyncLLM, created in start()
        self.limits: EngineLimits | None = None  # known once started
        self._last_lora_id = 0

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
            data_parallel_size=cfg.data_parallel_size,
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
            disable_log_stats=True,
        )
        self._engine = AsyncLLM.from_engine_args(args)
        model_config = self._engine.model_config
        self.limits = EngineLimits(model_config.max_model_len, model_config.get_vocab_size())
        log.info("vLLM engine ready: %s (%s)", cfg.model_dir, cfg.dtype)

    @property
    def started(self) -> bool:
        return self._engine is not None

    def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def new_lora_id(self) -> int:
        """A LoRA id never used before in this engine (called on the event loop only)."""
        self._last_lora_id += 1
        return self._last_lora_id

    async def add_lora(self, request) -> None:
        await self._engine.add_lora(request)

    async def remove_lora(self, lora_id: int) -> None:
        await self._engine.remove_lora(lora_id)

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
                max_tokens=request.max_tokens,
                seed=request.seed,
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

    async def encode(self, text: str) -> list[int]:
        tokenizer = self._engine.get_tokenizer()
        return list(tokenizer.encode(text))


class AdapterBook:
    """The adapter versions of one job on a shared engine: which is live, which are loaded (each under a LoRA id
    of its own and a folder of its own), which requests hold which. `activate` is called from the job's sync
    thread; everything else runs on the event loop."""

    def __init__(self, engine: VllmEngine, *, adapter_root: Path, kept_versions: int, job: str, instance: str):
        self._engine = engine
        self._adapter_root = adapter_root
        self.kept_versions = kept_versions
        self.job = job  # the `job` label of its metrics
        self.instance = instance  # this attachment of the job to the engine, unique on it (see _lora_request)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live_version = 0
        self.live_since = time.time()  # wall time the live version started serving (for latency measurements)
        self._leases: dict[int, int] = {}  # version -> requests running on it
        self._loaded: dict[int, int] = {}  # version -> its LoRA id, for versions added to vLLM and not yet removed
        self._version_changed = asyncio.Condition()
        self._closed = False

    def bind(self) -> None:
        """Serve from the running event loop (activations from the sync thread are run on it)."""
        self._loop = asyncio.get_running_loop()
        self._adapter_root.mkdir(parents=True, exist_ok=True)

    @property
    def live_version(self) -> int:
        return self._live_version

    def loaded_versions(self) -> list[int]:
        return sorted({self._live_version, *self._leases, *self._loaded} - {0})

    def lora_ids(self) -> list[int]:
        """The LoRA ids of this job's versions loaded in vLLM."""
        return sorted(self._loaded.values())

    def activate(self, version: int, tensors: dict[str, torch.Tensor], adapter_config: dict) -> None:
        """Load `version` next to the live one and switch new requests to it (called from the sync thread)."""
        assert self._loop is not None, "engine not started"
        asyncio.run_coroutine_threadsafe(self._activate(version, tensors, adapter_config), self._loop).result()

    async def _activate(self, version: int, tensors: dict[str, torch.Tensor], adapter_config: dict) -> None:
        if self._closed:  # a round that finished after its job was detached must not load anything again
            raise RuntimeError(f"job {self.job} is detached from this server")
        started = time.perf_counter()
        await asyncio.to_thread(save_adapter, self._folder(version), tensors, adapter_config)
        written = time.perf_counter()
        lora_id = self._engine.new_lora_id()
        await self._engine.add_lora(self._lora_request(version, lora_id))
        self._loaded[version] = lora_id
        loaded = time.perf_counter()
        async with self._version_changed:
            previous, self._live_version = self._live_version, version
            self.live_since = time.time()
            self._version_changed.notify_all()
        metrics.ADAPTER_VERSION.labels(job=self.job).set(version)
        metrics.ACTIVATION_SECONDS.labels(job=self.job).observe(time.perf_counter() - started)
        log.info(
            "%s: adapter version %d live (was %d): written in %.3fs, loaded by vLLM in %.3fs",
            self.job,
            version,
            previous,
            written - started,
            loaded - written,
        )
        await self._unload_unneeded()

    def _folder(self, version: int) -> Path:
        return self._adapter_root / f"v{version}"

    def _lora_request(self, version: int, lora_id: int):
        """Every version is a LoRA id of its own, loaded from its own peft folder: a new id per version, so no
        drain, and no id shared with another job's same version.

        Its name is unique on the engine too, per job instance and version: vLLM 0.32 keys prefix-cache blocks on
        the LoRA's name and path (vllm/v1/core/kv_cache_utils.py, `_gen_lora_extra_hash_keys`) and tells
        LoRARequests apart by name alone (vllm/lora/request.py). A job deleted and re-created under its name, or
        attached again, starts again at version 1 (or re-sends a version restored from a checkpoint) with other
        weights; its name then differs by `instance`, so none of its prompts can hit a KV block computed under
        the old adapter, whether or not a folder is part of the key."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"{self.job}@{self.instance}/v{version}", lora_id, str(self._folder(version)))

    async def _unload_unneeded(self) -> None:
        for version in versions_to_unload(
            self._loaded, live=self._live_version, leases=self._leases, kept=self.kept_versions
        ):
            await self._unload_if_idle(version)

    async def _unload_if_idle(self, version: int) -> None:
        # Unloads overlap: an activation and lease exits each walk their own list of versions to unload, across
        # awaits of vLLM. The first to take a version out of `_loaded` unloads it; a later one finds it gone.
        if version == 0 or version == self._live_version or self._leases.get(version) or version not in self._loaded:
            return
        lora_id = self._loaded.pop(version)
        await self._engine.remove_lora(lora_id)
        shutil.rmtree(self._folder(version), ignore_errors=True)
        log.info("%s: adapter version %d unloaded", self.job, version)

    async def close(self) -> None:
        """Detach: requests waiting for a version not yet live are answered VersionUnavailable at once, no new
        request is leased; once the requests running end, every version is unloaded from vLLM and the job's folder
        removed."""
        self._closed = True
        async with self._version_changed:
            self._version_changed.notify_all()
            await self._version_changed.wait_for(lambda: not self._leases)
        while self._loaded:  # taken out before each await, as _unload_if_idle does: an unload may be under way
            version = min(self._loaded)
            await self._engine.remove_lora(self._loaded.pop(version))
            log.info("%s: adapter version %d unloaded (job detached)", self.job, version)
        shutil.rmtree(self._adapter_root, ignore_errors=True)

    @contextlib.asynccontextmanager
    async def lease(self, version: int | None, wait_seconds: float) -> AsyncIterator[int]:
        """Hold an adapter version for one request: the live one, or `version` (waiting until it is live)."""
        if version is None:
            version = self._live_version
        elif version > self._live_version:
            async with self._version_changed:
                try:
                    await asyncio.wait_for(
                        self._version_changed.wait_for(lambda: self._live_version >= version or self._closed),
                        wait_seconds,
                    )
                except TimeoutError:
                    raise VersionUnavailable(
                        f"adapter version {version} is not live after {wait_seconds:.0f}s (live: {self._live_version})"
                    ) from None
        if self._closed:
            raise VersionUnavailable(f"job {self.job} is detached from this server")
        if version != self._live_version and version not in self._loaded and not self._leases.get(version):
            raise VersionUnavailable(f"adapter version {version} is no longer served (live: {self._live_version})")
        self._leases[version] = self._leases.get(version, 0) + 1
        try:
            yield version
        finally:
            self._leases[version] -= 1
            if not self._leases[version]:
                del self._leases[version]
                if self._closed:  # close() waits for the last lease
                    async with self._version_changed:
                        self._version_changed.notify_all()
                else:
                    await self._unload_unneeded()

    async def generate(self, prompt_token_ids: list[int], request: SamplingRequest, version: int) -> list[Sample]:
        """`request.n` samples for one prompt on this job's adapter `version` (hold a lease on it while this runs).
        Version 0 is the base model, the same for every job."""
        lora = self._lora_request(version, self._loaded[version]) if version else None
        samples = await self._engine.generate(prompt_token_ids, request, lora)
        if request.reference_logprobs:
            samples = await self._engine.reference_logprobs(prompt_token_ids, samples)
        return samples


class AdapterEngine(AdapterBook):
    """One job on an engine of its own: a job's own inference server, `grpolora eval`, the benchmarks."""

    def __init__(self, config: EngineConfig, *, adapter_root: Path, job: str = "local"):
        # One job for the engine's whole life (a re-created job gets new servers, so a new engine): "own" is
        # unique on it.
        super().__init__(
            VllmEngine(config), adapter_root=adapter_root, kept_versions=config.kept_versions, job=job, instance="own"
        )
        self.limits: EngineLimits | None = None  # known once started

    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    @config.setter
    def config(self, config: EngineConfig) -> None:  # the model is resolved while the server already answers
        self._engine.config = config
        self.kept_versions = config.kept_versions

    async def start(self) -> None:
        await self._engine.start()
        self.limits = self._engine.limits
        self.bind()

    @property
    def started(self) -> bool:
        return self._engine.started

    def shutdown(self) -> None:
        self._engine.shutdown()
        shutil.rmtree(self._adapter_root, ignore_errors=True)

    async def list_loras(self) -> list[int]:
        return await self._engine.list_loras()

    async def encode(self, text: str) -> list[int]:
        return await self._engine.encode(text)
