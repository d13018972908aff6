"""Job documents for tests and benchmarks (plain builders, not fixtures that hide what a caller does)."""

from __future__ import annotations

import copy
from typing import Any

MINIMAL_JOB: dict[str, Any] = {
    "apiVersion": "grpolora.dev/v1alpha1",
    "kind": "GRPOLoraJob",
    "metadata": {"name": "demo", "namespace": "team-a"},
    "spec": {"model": {"name": "Qwen/Qwen3-0.6B"}},
}


def job_doc(**spec_overrides: Any) -> dict[str, Any]:
    """A minimal valid job with `spec` sections merged in (dotted keys are not supported: pass dicts)."""
    doc = copy.deepcopy(MINIMAL_JOB)
    _merge(doc["spec"], spec_overrides)
    return doc


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
