"""The results a job leaves: the final adapter (a standard peft folder that names its base model and revision, with
a model card) in the output folder, and its optional push to an S3-compatible store (spec.output.push).

A push uploads the folder under `.tmp-<name>` first and moves it to `<name>` only once the whole upload succeeded,
so an interrupted upload never leaves a partial `<name>/`; a failed push fails the job (the adapter is still in
the output folder) with a message naming the destination.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from grpolora.api.spec import GRPOLoraJobSpec, S3PushSpec
from grpolora.workers import adapter as adapter_io
from grpolora.workers.secrets import export_secret

log = logging.getLogger(__name__)

FINAL_ADAPTER = "final-adapter"
CARD_FILE = "README.md"


class PushError(RuntimeError):
    """The adapter could not be copied to spec.output.push (the message names it)."""


def adapter_config(config: dict[str, Any], spec: GRPOLoraJobSpec) -> dict[str, Any]:
    """peft's config with the base model as the job names it (hub id and revision), not the trainer's local copy."""
    return config | {"base_model_name_or_path": spec.model.name, "revision": spec.model.revision}


def model_card(spec: GRPOLoraJobSpec, step: int, job_name: str) -> str:
    revision = spec.model.revision or "(default branch)"
    lines = [
        "---",
        "library_name: peft",
        f"base_model: {spec.model.name}",
        "tags: [grpo, lora, grpolora]",
        "---",
        f"# {job_name}: LoRA adapter trained with GRPO",
        "",
        f"- base model: `{spec.model.name}`, revision `{revision}`",
        f"- LoRA rank {spec.lora.rank}, alpha {spec.lora.alpha}, target modules {spec.lora.target_modules}",
        f"- steps: {step}, {spec.grpo.prompts_per_step} prompts x {spec.grpo.generations_per_prompt} completions "
        f"per step, learning rate {spec.grpo.learning_rate}, KL coefficient {spec.grpo.kl_coef}",
        "",
    ]
    return "\n".join(lines)


def save_adapter(
    folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], spec: GRPOLoraJobSpec, *, step: int,
    job_name: str,
) -> Path:  # fmt: skip
    """Write a peft adapter folder with its card; returns the folder."""
    adapter_io.save_adapter(folder, tensors, adapter_config(config, spec))
    (folder / CARD_FILE).write_text(model_card(spec, step, job_name))
    return folder


def push(folder: Path, spec: GRPOLoraJobSpec, name: str) -> str | None:
    """Copy `folder` to spec.output.push as `<destination>/<name>`; returns where it went (None: no push set)."""
    target = spec.output.push if spec.output else None
    if target is None:
        return None
    assert target.s3 is not None  # the spec requires a destination
    return push_s3(folder, target.s3, name)


def push_s3(folder: Path, s3: S3PushSpec, name: str) -> str:
    import s3fs

    export_secret(s3.secret_name, "spec.output.push.s3.secretName")
    destination = f"{s3.url.rstrip('/')}/{name}"
    staging = f"{s3.url.rstrip('/')}/.tmp-{name}"
    try:
        fs = s3fs.S3FileSystem(endpoint_url=s3.endpoint_url) if s3.endpoint_url else s3fs.S3FileSystem()
        bucket = s3.url.removeprefix("s3://").split("/", 1)[0]
        if not fs.exists(bucket):  # s3fs would create it: a typo must not make a new bucket
            raise FileNotFoundError(f"bucket {bucket!r} does not exist (or these credentials cannot see it)")
        if fs.exists(staging):
            fs.rm(staging, recursive=True)
        fs.put(str(folder).rstrip("/") + "/", staging + "/", recursive=True)
        if fs.exists(destination):
            fs.rm(destination, recursive=True)
        # S3 has no rename: copy each uploaded object into place, then drop the staging prefix.
        staged = fs._strip_protocol(staging)
        for source in fs.find(staged):
            fs.copy(source, fs._strip_protocol(destination) + source[len(staged) :])
        fs.rm(staged, recursive=True)
    except Exception as err:
        raise PushError(
            f"spec.output.push.s3: cannot copy the adapter to {destination}: {type(err).__name__}: {err}"
        ) from err
    log.info("adapter pushed to %s", destination)
    return destination
