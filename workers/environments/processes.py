"""Environment code out of the trainer's process: a built-in's or a plugin's environments live in a pool of worker
processes (spec.environment.processes), spawned by the trainer (rank 0, which runs the episodes) and each bounded in
address space (spec.environment.processMemoryMiB). The trainer holds a proxy per episode; each reset and step is one
request to the episode's process, answered on a thread there (several episodes' steps overlap, as I/O-bound tools
should), and a call that takes longer than stepTimeoutSeconds ends that process (SIGKILL): a step holding its GIL in
C for hours (a catastrophic regex, a huge power) costs one episode that long and no more, and the trainer's own
threads (training, sync heartbeats) never share a GIL with environment code. The other episodes on an ended process
lose their environment (EnvironmentUnavailable: played again on a fresh one, runner.py); the next episode made there
gets a new process.

Requests and answers are pickled over a pipe; an exception raised by environment code comes back as its type's
name and message (its own class may not unpickle in the trainer); InvalidAction and EnvironmentUnavailable (a plugin
whose own backend is gone) are raised again as themselves, as runner.py tells them apart."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from grpolora.api.spec import EnvironmentSpec
from grpolora.workers.environments.base import EnvironmentRaised, EnvironmentUnavailable, InvalidAction
from grpolora.workers.tasks.base import TaskError

log = logging.getLogger(__name__)

CALL_THREADS = 256
"""An environment process's threads for reset, step, make and close calls (short ones; the trainer bounds each by
stepTimeoutSeconds from its send, queued or not). An agent's play holds its call for the whole run: it gets a thread
of its own, so more agents than this run at once (every episode of a step whose environment is an agent)."""
START_SECONDS = 120.0  # a process's start and its factory's import at most (a plugin may import a large library)
# A new interpreter, not a fork of the trainer (which would copy its threads' locks, torch's and NCCL's, in whatever
# state) and not multiprocessing's spawn (which imports the parent's __main__ again: the trainer's, torch and vLLM
# with it, minutes on a loaded machine); -P: the working directory (the repository's operator/ folder, a job's
# folder) must not shadow the standard library. Its end of a socket pair is its only channel.
_CHILD = "from grpolora.workers.environments.processes import child; child()"


@dataclass(frozen=True)
class Raised:
    """What environment code raised, as it crosses the pipe."""

    kind: str
    message: str
    invalid_action: bool = False
    unavailable: bool = False
    """EnvironmentUnavailable (a plugin whose own backend is gone: an adapter's server): the trainer raises it again,
    so the episode is played again rather than scored."""


def child() -> None:
    """An environment process's entry (`python -P -c`): argv names its socket's descriptor; the first message is
    (the spec as JSON, the plugin root, the trainer's sys.path, the memory limit)."""
    conn = Connection(int(sys.argv[1]))
    spec_json, root, path, memory_mib = conn.recv()
    sys.path[:] = path  # where the trainer finds plugins (as multiprocessing's spawn would set it)
    _serve(conn, spec_json, root, memory_mib)


def _serve(conn: Connection, spec_json: str, root: str | None, memory_mib: int) -> None:
    """A worker process: make environments by id and run their calls, each on a thread of its own (an episode's calls
    come one at a time; different episodes' overlap, as a tool waiting on I/O should), until the pipe closes."""
    import resource
    from concurrent.futures import ThreadPoolExecutor

    limit = memory_mib * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from grpolora.workers.environments import load_environment

    try:
        factory = load_environment(EnvironmentSpec.model_validate_json(spec_json), Path(root) if root else None)
    except TaskError as exc:
        conn.send((None, "refused", (exc.path, exc.message)))
        return
    conn.send((None, "ready", None))
    environments: dict[int, Any] = {}
    sending = threading.Lock()

    def run(call: int, op: str, eid: int, argument: Any) -> None:
        try:
            if op == "make":
                environments[eid] = factory()
                value = None
            elif op == "close":
                env = environments.pop(eid, None)
                close = getattr(env, "close", None)
                value = close() if callable(close) else None
            else:
                value = getattr(environments[eid], op)(argument)
            answer = (call, "ok", value)
        except BaseException as exc:  # handed back: the episode ends with it (or answers it, InvalidAction)
            answer = (call, "raised", Raised(type(exc).__name__, str(exc)[:2000], isinstance(exc, InvalidAction),
                                             isinstance(exc, EnvironmentUnavailable)))  # fmt: skip
        with sending:
            try:
                conn.send(answer)
            except Exception:  # an answer that does not pickle
                conn.send((call, "raised", Raised("PicklingError", f"{op}() answered what cannot be sent back")))

    with ThreadPoolExecutor(max_workers=CALL_THREADS, thread_name_prefix="environment") as calls:
        while True:
            try:
                call, op, eid, argument = conn.recv()
            except (EOFError, OSError):
                return
            if op == "play":  # an agent's whole run: never queued behind the pool (its time runs from the send)
                threading.Thread(target=run, args=(call, op, eid, argument), name="agent", daemon=True).start()
            else:
                calls.submit(run, call, op, eid, argument)


class _Worker:
    """One environment process, seen from the trainer: requests go down its pipe, each numbered; a reader thread
    hands each answer to the call waiting for it."""

    def __init__(self, spec: EnvironmentSpec, root: Path | None, memory_mib: int):
        mine, theirs = socket.socketpair()
        self._conn = Connection(mine.detach())
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-P", "-c", _CHILD, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONSAFEPATH": "1"},
            )  # fmt: skip
        finally:
            theirs.close()
        self._conn.send((spec.model_dump_json(by_alias=True), str(root) if root else None, sys.path, memory_mib))
        self.dead: str | None = None
        self._lock = threading.Lock()
        self._calls = itertools.count()
        self._waiting: dict[int, Future] = {}
        self._ready: Future = Future()
        threading.Thread(target=self._read, name="environment-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                call, kind, value = self._conn.recv()
            except (EOFError, OSError):
                self._fail(f"died (exit code {self.process.poll()}; over processMemoryMiB, or a crash)")
                return
            if call is None:  # the start: ready, or the plugin refused
                self._ready.set_result((kind, value))
                continue
            with self._lock:
                waiting = self._waiting.pop(call, None)
            if waiting is not None and not waiting.done():
                waiting.set_result((kind, value))

    def _fail(self, why: str) -> None:
        """The process is gone: every call waiting on it fails (its episodes are played again elsewhere)."""
        with self._lock:
            self.dead = self.dead or why
            waiting, self._waiting = list(self._waiting.values()), {}
        lost = EnvironmentUnavailable(f"the environment's process {self.dead}")
        for future in [*waiting, self._ready]:
            if not future.done():
                future.set_exception(lost)

    def wait_ready(self) -> None:
        """Raise TaskError if the process cannot load the environment (a bad plugin), or EnvironmentUnavailable."""
        try:
            kind, value = self._ready.result(START_SECONDS)
        except TimeoutError:
            self.end(f"did not start within {START_SECONDS:g} s")
            raise EnvironmentUnavailable(f"the environment process {self.dead}") from None
        if kind == "refused":
            self.end("refused its environment")
            raise TaskError(*value)

    def call(self, op: str, eid: int, argument: Any, timeout: float) -> Any:
        self.wait_ready()
        future: Future = Future()
        with self._lock:
            if self.dead is not None:
                raise EnvironmentUnavailable(f"the environment's process {self.dead}")
            call = next(self._calls)
            self._waiting[call] = future
            try:
                self._conn.send((call, op, eid, argument))
            except (OSError, ValueError) as exc:
                self._waiting.pop(call, None)
                raise EnvironmentUnavailable(f"the environment's process cannot be reached ({exc})") from None
        try:
            kind, value = future.result(timeout)
        except TimeoutError:
            self.end(f"was ended: {op}() took longer than stepTimeoutSeconds ({timeout:g} s)")
            raise EnvironmentUnavailable(f"{op}() took longer than stepTimeoutSeconds ({timeout:g} s); its process "
                                         "was ended") from None  # fmt: skip
        if kind == "raised":
            if value.invalid_action:
                raise InvalidAction(value.message)
            if value.unavailable:
                raise EnvironmentUnavailable(value.message)
            raise EnvironmentRaised(value.kind, value.message)
        return value

    def end(self, why: str) -> None:
        with self._lock:
            self.dead = self.dead or why
        if self.process.poll() is None:
            self.process.kill()
        self._fail(why)
        threading.Thread(target=self.process.wait, name="environment-reap", daemon=True).start()  # no zombie


class EnvironmentProcesses:
    """A factory of environments that live in a pool of `size` processes; each made environment is a proxy."""

    def __init__(self, spec: EnvironmentSpec, root: Path | None = None):
        self.spec = spec
        self.root = root
        self.size = spec.processes
        self._workers: list[_Worker | None] = [None] * self.size
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def start(self) -> EnvironmentProcesses:
        """Start the first process and load the environment there: a bad plugin fails now (TaskError)."""
        self._worker(0).call("make", -1, None, START_SECONDS)
        self._worker(0).call("close", -1, None, START_SECONDS)
        return self

    def _worker(self, slot: int) -> _Worker:
        with self._lock:
            worker = self._workers[slot]
            if worker is None or worker.dead is not None:
                worker = self._workers[slot] = _Worker(self.spec, self.root, self.spec.process_memory_mib)
            return worker

    def __call__(self) -> ProcessEnvironment:
        eid = next(self._ids)
        worker = self._worker(eid % self.size)
        worker.call("make", eid, None, self.spec.step_timeout_seconds)
        return ProcessEnvironment(worker, eid, self.spec.step_timeout_seconds)

    def close(self) -> None:
        with self._lock:
            for worker in self._workers:
                if worker is not None:
                    worker.end("closed")


class ProcessEnvironment:
    """One episode's environment in its process: reset, step and close as the protocol has them."""

    def __init__(self, worker: _Worker, eid: int, timeout: float):
        self._worker, self._eid, self._timeout = worker, eid, timeout

    def reset(self, prompt: Any) -> Any:
        return self._worker.call("reset", self._eid, prompt, self._timeout)

    def step(self, message: Any) -> Any:
        return self._worker.call("step", self._eid, message, self._timeout)

    def play(self, call: Any, timeout: float) -> Any:
        """An agent's run (agent.AgentPlayer.play), `timeout` seconds at most: past it the process is ended."""
        return self._worker.call("play", self._eid, call, timeout)

    def close(self) -> None:
        if self._worker.dead is None:
            self._worker.call("close", self._eid, None, self._timeout)
