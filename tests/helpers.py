"""Small builders shared by the tests (job documents, not fixtures that hide what a test does)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

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


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())
