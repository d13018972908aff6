"""`grpolora run`'s environment servers (spec.environment.server): on one machine, the processes a cluster runs as the
server's pods, from the same command. Run by the `grpolora run` driver process (workers/launcher/local.py).

Each of `replicas` processes gets a free port of this machine in GRPOLORA_ENVIRONMENT_PORT (a pod gets
spec.environment.server.port there), the environment token in GRPOLORA_ENVIRONMENT_TOKEN (derived from the job's,
grpolora.api.pool.environment_token: the server runs model-driven code, so it never holds the job's token), and the
`value`s of the server's `env`. Its argv is the server's `command` and `args` with `$(NAME)` references expanded
from that environment by Kubernetes' own rule (a pod's command and args are expanded so: kubernetes/third_party/
forked/golang/expansion/expand.go: `$(NAME)` becomes the variable's value, `$$` is a `$`, an unknown name stays as
written), so a server of your own takes its port as `--port $(GRPOLORA_ENVIRONMENT_PORT)` in both places, or reads
the variable. Without a `command`, the project's service serves the job's `builtin` or `plugin` (workers/
environments/service.py). A command starting with `python` runs on this run's interpreter (where the project and the
job's plugins are installed, as they are in the server's image).

A server is ready when its GET /health answers 200-399 (the kubelet's rule for an HTTP probe); the trainer starts only
once every one is, and gets their base URLs in pod order in GRPOLORA_ENVIRONMENT_URL. A server that exits before, or
is not ready within READY_SECONDS, fails its job with the end of its log. A server that exits while the job runs is
started again on its port (as its pod would be), RESTARTS times at most. Every process runs in its own process group,
and stop() (at the job's end, however it ends) ends each group: nothing is left behind. A `grpolora run` killed
outright runs no stop(): then the process it started gets SIGKILL from the kernel (lifetime.die_with_parent), though
not what that process started in turn.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from grpolora.api import contract
from grpolora.api.plan import SERVICE_MODULE, environment_server_command
from grpolora.api.pool import environment_token
from grpolora.api.spec import EnvironmentSpec
from grpolora.workers.lifetime import die_with_parent, signal_group

FIELD = "spec.environment.server"
READY_SECONDS = 120.0
"""How long `grpolora run` waits for a server's first 200 from GET /health (a plugin importing a heavy library)."""
POLL_SECONDS = 0.1
STOP_SECONDS = 5.0
"""SIGTERM, then this long, then SIGKILL to what is left of the process group."""
RESTARTS = 3
"""Times a server that exits while its job runs is started again before the run fails."""
LOG_LINES = 30


class EnvironmentServerFailed(RuntimeError):
    """A server exited, or never answered /health: the message names spec.environment.server's command and carries
    the end of the server's log."""


def expand(text: str, values: Mapping[str, str]) -> str:
    """`text` with `$(NAME)` references replaced as Kubernetes replaces them in a container's command and args
    (expansion.Expand): `$(NAME)` by values[NAME] when it is there (else left as written), `$$` by `$`, and any
    other `$` kept."""
    out, i = [], 0
    while i < len(text):
        char = text[i]
        if char != "$" or i + 1 == len(text):
            out.append(char)
            i += 1
            continue
        following = text[i + 1]
        if following == "$":  # an escaped `$`: `$$(NAME)` stays `$(NAME)`
            out.append("$")
            i += 2
        elif following == "(" and (close := text.find(")", i + 2)) != -1:
            name = text[i + 2 : close]
            out.append(values.get(name, f"$({name})"))
            i = close + 1
        else:
            out.append("$" + following)
            i += 2
    return "".join(out)


@dataclass(frozen=True)
class ServerProcess:
    """One server process to start: its argv, its own environment (added to this process's), its port."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def describe_command(spec: EnvironmentSpec) -> str:
    """How errors name what was started: the server's own command, or the project's service of the job's kind."""
    server = spec.server
    assert server is not None
    if server.command is not None:
        return f"{FIELD}.command {[*server.command, *server.args]}"
    served = spec.builtin or spec.plugin
    return f"{FIELD} (no command: python -m {SERVICE_MODULE} --environment {served})"


def server_processes(spec: EnvironmentSpec, ports: Sequence[int], token: str) -> list[ServerProcess]:
    """What `grpolora run` starts for `spec` (a job's spec.environment with a server), one process per port; `token`:
    the job's, from which the servers' is derived (they get that one only, as the operator's pods do)."""
    server = spec.server
    assert server is not None and len(ports) == server.replicas
    # Only `value`s: a valueFrom names a Secret, ConfigMap or field of a cluster, which this machine has not.
    own = {var["name"]: str(var["value"]) for var in server.env if "value" in var}
    found = []
    for port in ports:
        env = own | {contract.ENVIRONMENT_PORT: str(port), contract.ENVIRONMENT_TOKEN: environment_token(token)}
        # The pods' command (grpolora.api.plan, one source), on loopback; its port expanded below as a pod's would be.
        command, args = environment_server_command(
            spec, port=f"$({contract.ENVIRONMENT_PORT})", token_file=None, host="127.0.0.1"
        )
        argv = [expand(part, env) for part in [*command, *args]]
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        found.append(ServerProcess(tuple(argv), env, port))
    return found


def unset_here(spec: EnvironmentSpec) -> list[str]:
    """The server's `env` names that `grpolora run` leaves unset: those with a valueFrom (a Secret, a ConfigMap or
    a field of the cluster's)."""
    return [var["name"] for var in spec.server.env if "value" not in var] if spec.server else []


class EnvironmentServers:
    """A job's environment server processes on this machine: start() them and wait until each is ready, urls for
    the trainer, revive() one that exited, stop() them all."""

    def __init__(
        self,
        spec: EnvironmentSpec,
        logs: Path,
        token: str,
        *,
        ports: Sequence[int],
        ready_seconds: float = READY_SECONDS,
    ):
        """`ports`: a free port of this machine per server; `logs`: the folder of the servers' logs
        (environment-<i>.log)."""
        self.spec, self.logs, self.ready_seconds = spec, logs, ready_seconds
        self.processes = server_processes(spec, ports, token)
        self._running: list[subprocess.Popen | None] = [None] * len(self.processes)
        self.restarts = [0] * len(self.processes)

    @property
    def urls(self) -> list[str]:
        """The servers' base URLs, in order: GRPOLORA_ENVIRONMENT_URL."""
        return [process.url for process in self.processes]

    def log(self, index: int) -> Path:
        return self.logs / f"environment-{index}.log"

    def launch(self) -> None:
        """Start every process not started yet (returns at once; wait_ready() waits for them)."""
        self.logs.mkdir(parents=True, exist_ok=True)
        for index in range(len(self.processes)):
            if self._running[index] is None:
                self._running[index] = self._spawn(index)

    def _spawn(self, index: int) -> subprocess.Popen:
        process = self.processes[index]
        with self.log(index).open("ab") as log:
            try:
                return subprocess.Popen(
                    process.argv,
                    env=dict(os.environ) | dict(process.env),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # one group: whatever it starts is stopped with it
                    preexec_fn=die_with_parent,  # a `grpolora run` killed outright takes its servers along
                )
            except OSError as err:  # no such program, not executable
                raise EnvironmentServerFailed(
                    f"{describe_command(self.spec)}: cannot start {process.argv[0]!r}: {err}"
                ) from None

    def start(self) -> None:
        """launch() and wait_ready(); on a failure nothing is left running."""
        try:
            self.launch()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, *, restart: bool = False) -> list[str]:
        """Until every server answers GET /health with 200-399; EnvironmentServerFailed when one exits first or is
        not ready within ready_seconds. With `restart`, one that exits first is started again instead, within its
        budget of RESTARTS (a line per restart, returned)."""
        deadline = time.monotonic() + self.ready_seconds
        waiting = set(range(len(self.processes)))
        said: list[str] = []
        with httpx.Client(timeout=2.0) as client:
            while waiting:
                for index in sorted(waiting):
                    if restart and (code := self._exit_code(index)) is not None:
                        said.append(self._restart(index, code))
                        continue  # its new process is looked at in the next round
                    self._check_alive(index, "before it was ready")
                    if _ready(client, self.processes[index].url):
                        waiting.discard(index)
                if not waiting:
                    return said
                if time.monotonic() > deadline:
                    index = min(waiting)
                    raise EnvironmentServerFailed(
                        f"{describe_command(self.spec)}: server {index} (port {self.processes[index].port}) did not "
                        f"answer GET {self.processes[index].url}/health with 200 within {self.ready_seconds:g} s; "
                        f"a server listens on ${contract.ENVIRONMENT_PORT} and answers /health once it serves; end of "
                        f"{self.log(index)}:\n{self._tail(index)}"
                    )
                time.sleep(POLL_SECONDS)
        return said

    def _exit_code(self, index: int) -> int | None:
        running = self._running[index]
        return running.poll() if running is not None else None

    def _check_alive(self, index: int, when: str) -> None:
        code = self._exit_code(index)
        if code is not None:
            raise EnvironmentServerFailed(
                f"{describe_command(self.spec)}: server {index} exited with code {code} {when}; end of "
                f"{self.log(index)}:\n{self._tail(index)}"
            )

    def revive(self) -> list[str]:
        """Start again each server that exited (on its port, as a pod comes back under its name), RESTARTS times
        each at most, and wait until it is ready (one that exits again before it is ready is started again, within
        the same budget); a line per restart for the run's output. EnvironmentServerFailed past the budget."""
        said = [self._restart(index, code) for index in range(len(self.processes))
                if (code := self._exit_code(index)) is not None]  # fmt: skip
        if said:
            said += self.wait_ready(restart=True)
        return said

    def _restart(self, index: int, code: int) -> str:
        """Start server `index`, which exited with `code`, again: the line saying so, or EnvironmentServerFailed past
        its budget."""
        running = self._running[index]
        assert running is not None
        if self.restarts[index] >= RESTARTS:
            self._check_alive(index, f"after {RESTARTS} restarts")
        self.restarts[index] += 1
        signal_group(running.pid, signal.SIGKILL)  # what it started and left behind
        with self.log(index).open("a") as log:
            log.write(f"\n--- grpolora run: exited with code {code}; restart {self.restarts[index]} ---\n")
        self._running[index] = self._spawn(index)
        return (
            f"environment server {index} exited with code {code}; started it again (restart "
            f"{self.restarts[index]} of {RESTARTS}); log: {self.log(index)}"
        )

    def stop(self) -> None:
        """Every server's process group: SIGTERM, STOP_SECONDS for them all, then SIGKILL."""
        running = [p for p in self._running if p is not None]
        for process in running:
            signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        for process in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(deadline - time.monotonic(), 0.0))
        for process in running:
            signal_group(process.pid, signal.SIGKILL)  # whatever of its group is left
            process.wait()
        self._running = [None] * len(self.processes)

    def _tail(self, index: int) -> str:
        try:
            lines = self.log(index).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-LOG_LINES:]) or "(the log is empty)"


def _ready(client: httpx.Client, url: str) -> bool:
    try:
        return 200 <= client.get(f"{url}/health").status_code < 400
    except httpx.HTTPError:
        return False
