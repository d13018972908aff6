"""The Secrets a job names (reward headers, tracking and push credentials), as the trainer reads them: the operator
mounts each read-only at `$GRPOLORA_SECRETS_DIR/<name>/`, one file per key; for `grpolora run`, point
GRPOLORA_SECRETS_DIR at a folder laid out the same way."""

from __future__ import annotations

import os
from pathlib import Path

from grpolora.api.contract import SECRETS_DIR
from grpolora.api.plan import SECRETS_MOUNT


class SecretError(ValueError):
    """A Secret the job names is not where it should be (the message starts with the spec field)."""


def secret_values(secret_name: str, field: str) -> dict[str, str]:
    """The keys of a Secret as mounted in the trainer: files in `$GRPOLORA_SECRETS_DIR/<name>/`."""
    folder = Path(os.environ.get(SECRETS_DIR) or SECRETS_MOUNT) / secret_name
    if not folder.is_dir():
        raise SecretError(
            f"{field}: Secret {secret_name!r} not found at {folder} (set {SECRETS_DIR} when running locally: "
            "one folder per Secret, one file per key)"
        )
    # Kubernetes mounts keys as symlinks into a ..data folder; its dot-entries are not keys.
    return {f.name: f.read_text().strip() for f in sorted(folder.iterdir()) if not f.name.startswith(".")}


def export_secret(secret_name: str | None, field: str) -> None:
    """Put a Secret's keys into this process's environment (for clients configured by env: MLflow, W&B, S3)."""
    if secret_name:
        os.environ.update(secret_values(secret_name, field))
