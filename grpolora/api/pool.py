"""Shared rollout pools: whether a job fits a RolloutPool, the job spec its trainer runs with once attached, and
the attachment list through which the operator (or `grpolora run`) tells a pool's servers which jobs may use them.

Torch-free: the operator, the CLI and the inference servers all read these facts from here.

The attachment list is JSON (the RolloutPool's Secret `<pool>-pool-jobs`, key `jobs.json`, mounted into the pool's
pods; a file in the run folder for `grpolora run`), named by GRPOLORA_POOL_JOBS_FILE:

    {"pool": "<pool name>", "jobs": [{"job": "<namespace>/<name>", "uid": "...", "auth": "<hex>",
                                      "syncKey": "<hex>", "keptVersions": 2}, ...]}

It holds no job token: `auth` is the SHA-256 of the job's token (a request whose bearer token hashes to it acts as
that job) and `syncKey` the MAC key of that job's sync rounds (derived from the token, as the trainer derives it),
so reading the pool's Secret gives no way to act as a job against the job's own trainer.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from grpolora.api.spec import GRPOLoraJobSpec, RolloutPoolSpec, min_lora_slots, serving_wire_names

JOBS_FILE_KEY = "jobs.json"
"""Key of the attachment list in the pool's Secret (and the file's name where it is mounted)."""
SYNC_HEADER_PURPOSE = b"grpolora sync round header"


def auth_digest(token: str) -> str:
    """What a pool stores to recognise a job's bearer token (hex SHA-256)."""
    return hashlib.sha256(token.encode()).hexdigest()


def sync_key(token: str) -> bytes:
    """The MAC key of a job's sync round headers, derived from its token (one secret, a key per purpose)."""
    return hmac.new(token.encode(), SYNC_HEADER_PURPOSE, hashlib.sha256).digest()


def job_key(namespace: str, name: str) -> str:
    """How a pool names an attached job: in its attachment list, its metrics' `job` label and its status."""
    return f"{namespace}/{name}"


class Attachment(BaseModel):
    """One job a pool's servers serve."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)
    job: str
    uid: str = ""
    auth: str = Field(pattern=r"^[0-9a-f]{64}$")
    sync_key: str = Field(pattern=r"^[0-9a-f]{64}$")
    kept_versions: int = Field(ge=1)
    """Adapter versions the job keeps in use (grpo.maxStaleness + 1): the newest this many stay loaded."""


class Attachments(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    pool: str
    jobs: list[Attachment] = Field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(by_alias=True, mode="json"), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Attachments:
        return cls.model_validate_json(text)


def attachment(namespace: str, name: str, uid: str, token: str, spec: GRPOLoraJobSpec) -> Attachment:
    """The entry that lets the pool serve one job."""
    return Attachment(
        job=job_key(namespace, name),
        uid=uid,
        auth=auth_digest(token),
        sync_key=sync_key(token).hex(),
        kept_versions=spec.grpo.staleness + 1,
    )


def fit_errors(pool_name: str, pool: RolloutPoolSpec, job: GRPOLoraJobSpec) -> list[tuple[str, str]]:
    """Why the job cannot attach to the pool, as (job spec path, message naming both values); empty if it fits."""
    pool_says = f"RolloutPool {pool_name}"
    errors: list[tuple[str, str]] = []
    for field in ("name", "revision", "dtype", "source"):
        mine, theirs = getattr(job.model, field), getattr(pool.model, field)
        if mine != theirs:
            errors.append((f"model.{field}", f"is {_shown(mine)} but {pool_says} serves {_shown(theirs)}"))
    if job.lora.rank > pool.max_lora_rank:
        errors.append(
            ("lora.rank", f"{job.lora.rank} is above {pool_says}'s maxLoraRank ({pool.max_lora_rank}); use at most it")
        )
    if pool.lora_target_modules != "all-linear":
        allowed = set(pool.lora_target_modules)
        wanted = job.lora.target_modules
        outside = ["all-linear"] if wanted == "all-linear" else sorted(set(wanted) - allowed)
        if outside:
            errors.append(
                (
                    "lora.targetModules",
                    f"{', '.join(outside)} not within {pool_says}'s loraTargetModules ({', '.join(sorted(allowed))})",
                )
            )
    slots = min_lora_slots(job.grpo.staleness)
    if slots > pool.adapters_per_job:
        errors.append(
            (
                "grpo.maxStaleness",
                f"{job.grpo.staleness} keeps {slots} adapter versions in use, but {pool_says} gives each job "
                f"{pool.adapters_per_job} (adaptersPerJob); use at most {pool.adapters_per_job - 1}",
            )
        )
    if pool.max_model_len is not None and job.grpo.max_new_tokens > pool.max_model_len:
        errors.append(
            (
                "grpo.maxNewTokens",
                f"{job.grpo.max_new_tokens} does not fit in {pool_says}'s maxModelLen ({pool.max_model_len})",
            )
        )
    if job.sync.backend == "nccl" and not (job.trainer.gpus_per_replica and pool.gpus_per_replica):
        errors.append(("sync.backend", f"`nccl` needs GPUs on the trainer and on {pool_says}; use gloo or auto"))
    return errors


def _shown(value: object) -> str:
    if isinstance(value, BaseModel):
        return json.dumps(value.model_dump(by_alias=True, mode="json", exclude_none=True), sort_keys=True)
    return "unset" if value is None else repr(value)


def bind(job: GRPOLoraJobSpec, pool: RolloutPoolSpec) -> GRPOLoraJobSpec:
    """The spec a job's trainer runs with on the pool: its own, with `inference` holding the pool's serving fields
    (so the trainer, the sync backend and the rollout lengths see the servers they really use) and no poolRef.
    Check fit_errors first."""
    serving = {
        name: value
        for name, value in pool.model_dump(by_alias=True, mode="json", exclude_none=True).items()
        if name in serving_wire_names()
    }
    wire = job.to_wire()
    wire["inference"] = serving | {"maxLoras": pool.adapters_per_job}
    return GRPOLoraJobSpec.model_validate(wire)
