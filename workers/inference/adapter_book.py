"""The adapter versions of a job on a vLLM engine: which is live, which are loaded, which requests hold which.

Every synced adapter becomes a new LoRA id (= its version), so activation never waits for a drain: a new
version is loaded next to the old one, new requests get it from the moment it is live, requests already running
finish on the version they started with, and an old one is unloaded when its last request ends. Under
grpo.maxStaleness = k the book keeps the newest k + 1 versions loaded (buffered and in-flight rollouts may still
ask for them), so the engine needs k + 1 LoRA slots and never fewer than two (`inference.maxLoras`, checked by the
spec); version 0 is the base model (no adapter).

Version numbers are a trainer's: each version loaded is recorded with the incarnation of the trainer that published
it (sync/control.py, JoinRequest.incarnation), and the book follows the newest incarnation that joined. A lease
from an older one is refused (StaleIncarnation: a stale trainer, which must stop, as for its joins and rounds); a
lease from the newest is served only a version that incarnation published (or version 0, the base model), never
another's weights under the same number (a restart numbering from a checkpoint).

Adapters reach vLLM from memory: a synced version was received and verified by the job's sync member inside vLLM's
first worker, into a shared-memory segment (workers/inference/member_host.py); `activate_staged` hands that segment to
every worker between engine steps, where it becomes a LoRA model (workers/inference/vllm_worker.py), with no folder
and no copy through this process on the way; every worker of a tensor-parallel engine builds its own.

`AdapterBook` is one job's book on a shared engine (a RolloutPool's server holds one per attached job);
`OwnEngineBook` is the book of a job with an engine of its own (a job's own server, `grpolora eval`, the
benchmarks), which also starts and stops that engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import torch

from grpolora.workers.inference import metrics
from grpolora.workers.inference.payload import Layout
from grpolora.workers.inference.vllm_engine import EngineConfig, EngineLimits, Sample, SamplingRequest, VllmEngine
from grpolora.workers.inference.vllm_worker import lora_request
from grpolora.workers.sync.control import ACTIVATION_TIMEOUT_SECONDS, StaleIncarnation

log = logging.getLogger(__name__)


REMOVAL_TIMEOUT_SECONDS = 10.0
"""Longest the cleanup of a failed or timed-out activation (remove_lora of its id) is waited for: an engine that did not
load the version in ACTIVATION_TIMEOUT_SECONDS (sync/control.py: the round's closing status allows for both) may be
wedged, and answer no removal either. Past it the member is told the activation failed all the same; the id, if some
worker holds it, stays loaded until the engine is replaced (a wedged one is, by its health check)."""


class VersionUnavailable(RuntimeError):
    """The requested adapter version is not (or no longer) served here."""


def versions_to_unload(loaded: Iterable[int], *, live: int, leases: Mapping[int, int], kept: int) -> list[int]:
    """The loaded adapter versions to unload now: older than the newest `kept` (live - kept + 1 ... live) and with
    no request running on them. Version 0 is the base model, never unloaded."""
    return sorted(v for v in loaded if 0 < v <= live - kept and not leases.get(v))


class AdapterBook:
    """The adapter versions of one job on a shared engine: which is live, which are loaded (each under a LoRA id
    of its own), which requests hold which. In the replica's HTTP process: `activate_staged` is called from the
    tenant's RemoteMember events thread (member_link.py, answering its member in vLLM's worker), `activate` from a
    thread of the caller's (`grpolora eval`, the benchmarks, in-process tests); everything else runs on the event
    loop."""

    def __init__(self, engine: VllmEngine, *, kept_versions: int, job: str, instance: str):
        self._engine = engine
        self.kept_versions = kept_versions
        self.job = job  # the `job` label of its metrics
        self.instance = instance  # this attachment of the job to the engine, unique on it (see _lora_request)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live_version = 0
        self.live_since = time.time()  # wall time the live version started serving (for latency measurements)
        self._leases: dict[int, int] = {}  # version -> requests running on it
        self._loaded: dict[int, int] = {}  # version -> its LoRA id, for versions added to vLLM and not yet removed
        self._published: dict[int, int] = {}  # version -> the incarnation of the trainer that sent it (of _loaded)
        self.incarnation = 0  # the newest trainer incarnation that joined (follow): leases of older ones are refused
        self._version_changed = asyncio.Condition()
        self._closed = False
        self._unloading: set[asyncio.Task[None]] = set()  # unloads activations left running (held: asyncio keeps none)

    def bind(self) -> None:
        """Serve from the running event loop (activations from the sync thread are run on it)."""
        self._loop = asyncio.get_running_loop()

    @property
    def live_version(self) -> int:
        return self._live_version

    def loaded_versions(self) -> list[int]:
        return sorted({self._live_version, *self._leases, *self._loaded} - {0})

    def lora_ids(self) -> list[int]:
        """The LoRA ids of this job's versions loaded in vLLM."""
        return sorted(self._loaded.values())

    def follow(self, incarnation: int) -> None:
        """A trainer of `incarnation` joined this replica (the join was accepted): leases of older ones are refused
        from now on. Called on the event loop, by the join's handler."""
        self.incarnation = max(self.incarnation, incarnation)

    def activate(
        self, version: int, tensors: dict[str, torch.Tensor], adapter_config: dict, *, incarnation: int = 0
    ) -> None:
        """Load `version`, published by trainer `incarnation`, next to the live one and switch new requests to it
        (called from a sync thread)."""
        self._run(version, incarnation, lambda request: self._engine.add_lora(request, tensors, adapter_config))

    def activate_staged(
        self, version: int, segment: str, size: int, layout: Layout, adapter_config: dict, *, incarnation: int = 0
    ) -> None:
        """As `activate`, for a version that a sync member in vLLM's worker received and verified into shared-memory
        `segment` (workers/inference/member_host.py): the workers map it, nothing is copied through this process."""
        self._run(
            version,
            incarnation,
            lambda request: self._engine.add_staged_lora(request, segment, size, layout, adapter_config),
        )

    def _run(self, version: int, incarnation: int, add: Callable[[Any], Awaitable[None]]) -> None:
        assert self._loop is not None, "engine not started"
        asyncio.run_coroutine_threadsafe(self._activate(version, incarnation, add), self._loop).result()

    async def _activate(self, version: int, incarnation: int, add: Callable[[Any], Awaitable[None]]) -> None:
        if self._closed:  # a round that finished after its job was detached must not load anything again
            raise RuntimeError(f"job {self.job} is detached from this server")
        if version <= self._live_version or version in self._loaded:
            # Versions only grow: loaded again, it went live a second time under a new id, and the book forgot the
            # older id, left loaded in vLLM for good.
            raise RuntimeError(f"{self.job}: version {version} is not newer than the live version {self._live_version}")
        started = time.perf_counter()
        lora_id = self._engine.new_lora_id()
        try:
            async with asyncio.timeout(ACTIVATION_TIMEOUT_SECONDS):
                await add(self._lora_request(version, lora_id))
        except BaseException as exc:
            # One collective_rpc into every TP worker: some may have loaded it before another failed (or before the
            # wait gave up). vLLM runs the engine's calls in order, so this removal follows that load wherever it
            # happened; an id a worker never loaded is nothing to remove there.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(REMOVAL_TIMEOUT_SECONDS):
                    await self._engine.remove_lora(lora_id)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(
                    f"{self.job}: version {version} not loaded by vLLM's workers within {ACTIVATION_TIMEOUT_SECONDS:g}s"
                ) from None
            raise
        self._loaded[version] = lora_id
        self._published[version] = incarnation
        async with self._version_changed:
            previous, self._live_version = self._live_version, version
            self.live_since = time.time()
            self._version_changed.notify_all()
        metrics.ADAPTER_VERSION.labels(job=self.job).set(version)
        metrics.ACTIVATION_SECONDS.labels(job=self.job).observe(time.perf_counter() - started)
        log.info(
            "%s: adapter version %d live (was %d): built in vLLM's workers in %.3fs",
            self.job,
            version,
            previous,
            time.perf_counter() - started,
        )
        # Returns now, so the member acknowledges the round (and the trainer's send() returns) with the version live;
        # the version that left the window is unloaded meanwhile (overlapping unloads: see _unload_if_idle).
        task = asyncio.create_task(self._unload_unneeded())
        self._unloading.add(task)
        task.add_done_callback(self._unloaded)

    def _unloaded(self, task: asyncio.Task[None]) -> None:
        self._unloading.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: unloading old adapter versions failed: %r", self.job, task.exception())

    def _lora_name(self, version: int) -> str:
        """Every version is a LoRA id of its own: a new id per version, so no drain, and no id shared with another
        job's same version.

        Its name is unique on the engine too, per job instance and version: vLLM 0.32 keys prefix-cache blocks on
        the LoRA's name and path (vllm/v1/core/kv_cache_utils.py, `_gen_lora_extra_hash_keys`; the path of an
        adapter from memory is made from its name) and tells LoRARequests apart by name alone
        (vllm/lora/request.py). A job deleted and re-created under its name, or attached again, starts again at
        version 1 (or re-sends a version restored from a checkpoint) with other weights; its name then differs by
        `instance`, so none of its prompts can hit a KV block computed under the old adapter."""
        return f"{self.job}@{self.instance}/v{version}"

    def _lora_request(self, version: int, lora_id: int):
        return lora_request(self._lora_name(version), lora_id)

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
        self._published.pop(version, None)
        await self._engine.remove_lora(lora_id)
        log.info("%s: adapter version %d unloaded", self.job, version)

    async def close(self) -> None:
        """Detach: requests waiting for a version not yet live are answered VersionUnavailable at once, no new
        request is leased; once the requests running end, every version is unloaded from vLLM."""
        self._closed = True
        async with self._version_changed:
            self._version_changed.notify_all()
            await self._version_changed.wait_for(lambda: not self._leases)
        while self._loaded:  # taken out before each await, as _unload_if_idle does: an unload may be under way
            version = min(self._loaded)
            self._published.pop(version, None)
            await self._engine.remove_lora(self._loaded.pop(version))
            log.info("%s: adapter version %d unloaded (job detached)", self.job, version)

    def _serves(self, version: int, incarnation: int | None) -> bool:
        """`version` is loaded here as `incarnation`'s (version 0, the base model, is everyone's; None: no trainer
        asks, any incarnation's will do)."""
        if version == 0:
            return True
        if version != self._live_version and version not in self._loaded and not self._leases.get(version):
            return False
        return incarnation is None or self._published.get(version, 0) == incarnation

    @contextlib.asynccontextmanager
    async def lease(
        self, version: int | None, wait_seconds: float, *, incarnation: int | None = None
    ) -> AsyncIterator[int]:
        """Hold an adapter version for one request: the live one, or `version` (waiting until it is live).

        `incarnation`: of the trainer asking (None: no trainer, e.g. an evaluation). One older than the newest that
        joined is refused (StaleIncarnation); otherwise only a version that incarnation published is leased: a
        version number another incarnation published is waited for as a version not yet live."""
        if incarnation is not None and incarnation < self.incarnation:
            raise StaleIncarnation(
                f"rollouts from trainer incarnation {incarnation} refused: this replica follows incarnation "
                f"{self.incarnation}, a newer trainer of job {self.job}"
            )
        of = "" if incarnation is None else f" of trainer incarnation {incarnation}"
        if version is None:
            version = self._live_version
            if not self._serves(version, incarnation):
                raise VersionUnavailable(
                    f"the live version {version} was published by trainer incarnation "
                    f"{self._published.get(version, 0)}, not by incarnation {incarnation}"
                )
        elif version >= self._live_version and not self._serves(version, incarnation):
            async with self._version_changed:
                try:
                    await asyncio.wait_for(
                        self._version_changed.wait_for(
                            lambda: self._live_version > version or self._serves(version, incarnation) or self._closed
                        ),
                        wait_seconds,
                    )
                except TimeoutError:
                    raise VersionUnavailable(
                        f"adapter version {version}{of} is not live after {wait_seconds:.0f}s "
                        f"(live: {self._live_version})"
                    ) from None
        if self._closed:
            raise VersionUnavailable(f"job {self.job} is detached from this server")
        if not self._serves(version, incarnation):
            raise VersionUnavailable(f"adapter version {version}{of} is no longer served (live: {self._live_version})")
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


class OwnEngineBook(AdapterBook):
    """The book of one job with a vLLM engine of its own (a job's own inference server, `grpolora eval`, the
    benchmarks): it also starts and shuts down that engine, and passes on its limits, LoRA ids and tokenizer."""

    def __init__(self, config: EngineConfig, *, job: str = "local"):
        # One job for the engine's whole life (a re-created job gets new servers, so a new engine): "own" is
        # unique on it.
        super().__init__(VllmEngine(config), kept_versions=config.kept_versions, job=job, instance="own")
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

    @property
    def dead(self) -> bool:
        return self._engine.dead

    async def round_trip(self) -> None:
        await self._engine.round_trip()

    @property
    def members(self):
        """The link to the sync members in vLLM's worker (VllmEngine.members), once started."""
        return self._engine.members

    def shutdown(self) -> None:
        self._engine.shutdown()

    async def list_loras(self) -> list[int]:
        return await self._engine.list_loras()

    async def encode(self, text: str) -> list[int]:
        return await self._engine.encode(text)

    def tokenizer(self):
        return self._engine.tokenizer()
