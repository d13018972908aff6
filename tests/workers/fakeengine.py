"""The real inference API (create_app) and the real version leasing of OwnEngineBook, around a stand-in for vLLM,
served by uvicorn on loopback: for what the HTTP contract does, cheaply and without an engine to start.
(The real engine's side is tested in tests/workers/test_inference_sync.py.)

FakeOwnEngineBook stands in for the book's activation too (a test sets the live version); MarkingEngine stands in
for vLLM alone, under the real book and its real activation, and tells whose weights generated a completion."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
import uvicorn

from grpolora.workers.inference.adapter_book import OwnEngineBook
from grpolora.workers.inference.app import create_app
from grpolora.workers.inference.vllm_engine import EngineConfig, EngineLimits, Sample, SamplingRequest, VllmEngine
from grpolora.workers.sync import wire
from grpolora.workers.sync.receiver import AdapterReceiver
from tests.workers.syncfakes import free_port

TOKEN = "fake-token"


class FakeOwnEngineBook(OwnEngineBook):
    """OwnEngineBook's versions and leases, with generation that answers at once: completion i of a prompt is
    the prompt's last token + i + 1, with logprob -0.5."""

    def __init__(self, tmp: Path):
        super().__init__(EngineConfig(model_dir="fake", dtype="float32", max_lora_rank=8, max_loras=2))
        self.died = False  # a test sets it: the engine's processes are gone (VllmEngine.dead)
        self.hung = False  # a test sets it: the engine lives and answers nothing (a wedged GPU, a stopped EngineCore)
        self.round_trips = 0  # round trips sent to the engine (VllmEngine.round_trip)

    @property
    def dead(self) -> bool:
        return self.died

    async def round_trip(self) -> None:
        self.round_trips += 1
        while self.hung:
            await asyncio.sleep(0.01)

    async def start(self) -> None:
        self.requests: list[tuple[list[int], SamplingRequest]] = []  # what generate was asked, in order
        self._loop = asyncio.get_running_loop()
        self._version_changed = asyncio.Condition()
        self.limits = EngineLimits(max_model_len=256, vocab_size=1000)

    def shutdown(self) -> None:
        pass

    async def _unload_if_idle(self, version: int) -> None:
        pass

    async def go_live(self, version: int) -> None:
        async with self._version_changed:
            self._live_version = version
            self._version_changed.notify_all()

    def set_live(self, version: int) -> None:
        """From the test's thread: `version` serves new requests (and earlier ones are no longer served)."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self.go_live(version), self._loop).result()

    async def generate(self, prompt_token_ids: list[int], request: SamplingRequest, version: int) -> list[Sample]:
        self.requests.append((prompt_token_ids, request))
        return [Sample([prompt_token_ids[-1] + i + 1], [-0.5], f"t{i}", "length") for i in range(request.n)]


class MarkingEngine(VllmEngine):
    """vLLM's side of a book, stood in for: LoRA ids are added and removed as vLLM holds them, and every completion is
    one token, the first value of the `mark` tensor of the adapter that generated it (0: the base model), so that a
    test sees whose weights served a request."""

    errored = False  # AsyncLLM.errored, which VllmEngine.dead reads: this one never dies

    def __init__(self) -> None:
        super().__init__(EngineConfig(model_dir="fake", dtype="float32", max_lora_rank=8, max_loras=4))
        self.marks: dict[int, int] = {}  # LoRA id -> its adapter's mark

    async def start(self) -> None:
        self.limits = EngineLimits(max_model_len=256, vocab_size=1000)
        self._engine = self  # started

    def shutdown(self) -> None:
        self._engine = None

    async def add_lora(self, request, tensors, adapter_config: dict) -> None:
        self.marks[request.lora_int_id] = int(tensors["mark"][0])

    async def remove_lora(self, lora_id: int) -> None:
        self.marks.pop(lora_id, None)

    async def list_loras(self) -> list[int]:
        return sorted(self.marks)

    async def collective_rpc(self, method: str, *_, **__) -> list[None]:  # AsyncLLM's: the health round trip
        return [None]

    async def generate(self, prompt_token_ids: list[int], request: SamplingRequest, lora) -> list[Sample]:
        mark = self.marks[lora.lora_int_id] if lora is not None else 0
        return [Sample([mark], [-0.5], f"m{mark}", "length") for _ in range(request.n)]


def marked(mark: int) -> dict[str, torch.Tensor]:
    """An adapter whose completions on a MarkingEngine are the token `mark`."""
    return {"mark": torch.full((4,), float(mark))}


class MarkingBook(OwnEngineBook):
    """A job's own book, real in everything (versions, leases, activation, unloads), on a MarkingEngine."""

    def __init__(self) -> None:
        super().__init__(EngineConfig(model_dir="fake", dtype="float32", max_lora_rank=8, max_loras=4))
        self._engine = MarkingEngine()


class AppThread:
    """An ASGI app served by uvicorn in a thread of this process, on a free loopback port."""

    def __init__(self, app):
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self):
        self._thread.start()
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            assert time.monotonic() < deadline, "the in-process inference server did not start"
            time.sleep(0.05)

    def __exit__(self, *_) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


class FakeServer(AppThread):
    """A job's own server (fingerprint "fp", TOKEN) with an in-process sync receiver, on `book` (by default a
    FakeOwnEngineBook)."""

    def __init__(
        self, tmp: Path | None = None, *, version_wait_seconds: float = 1.0, book: OwnEngineBook | None = None
    ):
        self.engine = book if book is not None else FakeOwnEngineBook(tmp)
        super().__init__(
            create_app(
                self.engine,
                lambda engine: AdapterReceiver(engine, replica_index=0, fingerprint="fp", key=wire.round_key(TOKEN)),
                token=TOKEN,
                version_wait_seconds=version_wait_seconds,
            )
        )


@contextlib.contextmanager
def fake_servers(tmp: Path, count: int, **options) -> Iterator[list[FakeServer]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(FakeServer(tmp / f"s{i}", **options)) for i in range(count)]
