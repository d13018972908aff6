"""Small builders shared by the tests (job documents, not fixtures that hide what a test does). The job builders
live in grpolora.testing.jobs, which the benchmarks use too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from grpolora.testing.jobs import MINIMAL_JOB, job_doc

__all__ = ["EXAMPLES", "MINIMAL_JOB", "ROOT", "example", "job_doc", "not_checked_lines"]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def not_checked_lines(stderr: str) -> list[str]:
    """validate's "not checked here" lines, less its word on a model it could not ask the hub about (the tests run
    without a hub, tests/conftest.py's endpoint refusing every connection: grpolora/model_check.py says so for every
    hub model)."""
    hubless = [line for line in stderr.splitlines() if "on the hub (could not check:" not in line]
    return [line for line in hubless if "not checked here" in line]


def example(name: str) -> dict[str, Any]:
    """The example file's grpolora.dev document (a file may bring the claims its job names beside it)."""
    documents = [d for d in yaml.safe_load_all((ROOT / "examples" / name).read_text()) if d]
    (ours,) = [d for d in documents if d["apiVersion"].startswith("grpolora.dev/")]
    return ours
