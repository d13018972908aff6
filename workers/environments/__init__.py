"""Multi-turn environments (spec.environment): the protocol (base.py), the built-ins, a service's client (remote.py)
and server (service.py), and the episode's tokens (episode.py) and its run on the replicas (runner.py).
`load_environment` is the one entry point; it fails early with a TaskError that names the spec field."""

from __future__ import annotations

from pathlib import Path

from grpolora.api.spec import EnvironmentSpec
from grpolora.workers.environments.agent import load_agent
from grpolora.workers.environments.base import (
    Environment,
    EnvironmentFactory,
    EnvironmentFault,
    Message,
    Opening,
    Reply,
)
from grpolora.workers.environments.calculator import CalculatorEnvironment
from grpolora.workers.environments.remote import SERVER_FIELD, EnvironmentService, server_token, server_urls
from grpolora.workers.secrets import SecretError, secret_values
from grpolora.workers.tasks.base import TaskError, TaskUnreachable
from grpolora.workers.tasks.plugin import import_plugin_module

BUILTIN_ENVIRONMENTS: dict[str, EnvironmentFactory] = {"calculator": CalculatorEnvironment}
"""Built-in environments by name; the names must equal grpolora.api.constants.BUILTIN_ENVIRONMENTS (a test checks)."""

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "Environment",
    "EnvironmentFactory",
    "EnvironmentFault",
    "Message",
    "Opening",
    "Reply",
    "check_environment",
    "load_environment",
]

FIELD = "spec.environment.plugin"


def load_environment(spec: EnvironmentSpec, root: Path | None = None) -> EnvironmentFactory:
    """The factory of a validated spec.environment: a built-in's class, a service's client (its headers read from
    the mounted Secret now; for the job's own `server`, its URLs from the env contract and the environment token,
    derived from the job's), or the plugin's factory, imported (from sys.path or `root`, default the current
    directory, as reward plugins are) and called once to check that what it makes has reset and step. Raises
    TaskError naming the field."""
    if spec.remote:
        return _service(spec)
    if spec.agent is not None:  # its players (agent.py), the function imported now
        return load_agent(spec.agent, root)
    if spec.builtin is not None:
        if spec.builtin not in BUILTIN_ENVIRONMENTS:
            valid = ", ".join(BUILTIN_ENVIRONMENTS)
            raise TaskError("spec.environment.builtin", f"unknown built-in {spec.builtin!r}; valid: {valid}")
        return BUILTIN_ENVIRONMENTS[spec.builtin]
    assert spec.plugin is not None  # the spec requires one of the kinds
    module_name, _, attr = spec.plugin.partition(":")
    module = import_plugin_module(module_name, FIELD, root)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TaskError(FIELD, f"{module_name!r} has no callable {attr!r} (a factory returning an environment)")
    try:
        made = factory()
    except Exception as err:
        raise TaskError(FIELD, f"{spec.plugin}() raised {type(err).__name__}: {err}") from err
    missing = [name for name in ("reset", "step") if not callable(getattr(made, name, None))]
    if missing:
        raise TaskError(FIELD, f"{spec.plugin}() made a {type(made).__name__} without {' and '.join(missing)}; an "
                        "environment has reset(prompt) and step(message)")  # fmt: skip
    return factory


def _service(spec: EnvironmentSpec) -> EnvironmentService:
    """The client of `url`, or of the job's own environment server (GRPOLORA_ENVIRONMENT_URL, one URL per process
    or pod, each episode pinned to one), whose calls carry the environment token (derived from the job's: remote.
    server_token) as a bearer token."""
    try:
        headers = secret_values(spec.headers_from.secret_name, "") if spec.headers_from else {}
    except SecretError as err:  # mounted in the trainer pod; not there where `grpolora validate` runs
        raise TaskUnreachable("spec.environment.headersFrom", str(err).removeprefix(": ")) from None
    timeout = spec.step_timeout_seconds
    if spec.url is not None:
        return EnvironmentService(spec.url, timeout_seconds=timeout, retries=spec.retries, headers=headers)
    if any(name.lower() == "authorization" for name in headers):
        raise TaskError("spec.environment.headersFrom", "its key `Authorization` would replace the environment "
                        "token, which every call to the job's own server carries; remove that key")  # fmt: skip
    try:
        urls = server_urls()
    except ValueError as err:
        raise TaskUnreachable(SERVER_FIELD, str(err)) from None
    token = server_token()
    if token is not None:
        headers = headers | {"Authorization": f"Bearer {token}"}
    return EnvironmentService(urls, timeout_seconds=timeout, retries=spec.retries, headers=headers, field=SERVER_FIELD)


def check_environment(
    spec: EnvironmentSpec | None, root: Path | None = None
) -> tuple[list[TaskError], list[TaskUnreachable]]:
    """What `grpolora validate` checks of spec.environment from where it runs: (problems, things it could not reach
    here), loading the plugin as the trainer does."""
    if spec is None:
        return [], []
    if spec.remote and spec.url is None:  # the job's own server
        if spec.builtin is None and spec.plugin is None:
            return [], []  # the server's own command, in its own image: nothing to load here
        # What the server serves, loaded as it will load it (its URLs exist only once the job runs).
        spec = spec.model_copy(update={"server": None})
    try:
        load_environment(spec, root)
    except TaskUnreachable as exc:
        return [], [exc]
    except TaskError as exc:
        return [exc], []
    return [], []
