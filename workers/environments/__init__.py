"""Multi-turn environments (spec.environment): the protocol (base.py), the built-ins, a service's client (remote.py)
and server (service.py), and the episode's tokens (episode.py) and its run on the replicas (runner.py).
`load_environment` is the one entry point; it fails early with a TaskError that names the spec field."""

from __future__ import annotations

from pathlib import Path

from grpolora.api.spec import EnvironmentSpec
from grpolora.workers.environments.base import (
    Environment,
    EnvironmentFactory,
    EnvironmentFault,
    Message,
    Opening,
    Reply,
)
from grpolora.workers.environments.calculator import CalculatorEnvironment
from grpolora.workers.environments.remote import EnvironmentService
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
    the mounted Secret now), or the plugin's factory, imported (from sys.path or `root`, default the current
    directory, as reward plugins are) and called once to check that what it makes has reset and step. Raises
    TaskError naming the field."""
    if spec.builtin is not None:
        if spec.builtin not in BUILTIN_ENVIRONMENTS:
            valid = ", ".join(BUILTIN_ENVIRONMENTS)
            raise TaskError("spec.environment.builtin", f"unknown built-in {spec.builtin!r}; valid: {valid}")
        return BUILTIN_ENVIRONMENTS[spec.builtin]
    if spec.url is not None:
        return _service(spec)
    assert spec.plugin is not None  # the spec requires one of the three
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
    assert spec.url is not None
    try:
        headers = secret_values(spec.headers_from.secret_name, "") if spec.headers_from else {}
    except SecretError as err:  # mounted in the trainer pod; not there where `grpolora validate` runs
        raise TaskUnreachable("spec.environment.headersFrom", str(err).removeprefix(": ")) from None
    timeout = spec.step_timeout_seconds
    return EnvironmentService(spec.url, timeout_seconds=timeout, retries=spec.retries, headers=headers)


def check_environment(
    spec: EnvironmentSpec | None, root: Path | None = None
) -> tuple[list[TaskError], list[TaskUnreachable]]:
    """What `grpolora validate` checks of spec.environment from where it runs: (problems, things it could not reach
    here), loading the plugin as the trainer does."""
    if spec is None:
        return [], []
    try:
        load_environment(spec, root)
    except TaskUnreachable as exc:
        return [], [exc]
    except TaskError as exc:
        return [exc], []
    return [], []
