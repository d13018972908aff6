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

Next to it (key `replicas.json`; a file of that name beside the attachment list locally), the pool's replicas now,
which the servers pass on to the jobs' trainers so that these follow a scaled pool (PoolReplicas):

    {"generation": <the pool's metadata.generation>, "endpoints": ["http://<replica 0>:<port>", ...]}

A key of its own rather than fields of the attachment list: a server of an earlier release, which refuses fields it
does not know, keeps reading the attachment list of an operator that writes both.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from grpolora.api.spec import GRPOLoraJob, GRPOLoraJobSpec, RolloutPoolSpec, min_lora_slots, serving_wire_names

JOBS_FILE_KEY = "jobs.json"
"""Key of the attachment list in the pool's Secret (and the file's name where it is mounted)."""
REPLICAS_FILE_KEY = "replicas.json"
"""Key of the pool's replicas (PoolReplicas) in the same Secret; the file beside the attachment list."""
SYNC_HEADER_PURPOSE = b"grpolora sync round header"
ENVIRONMENT_TOKEN_PURPOSE = b"grpolora.dev/environment-server"


def auth_digest(token: str) -> str:
    """What a pool stores to recognise a job's bearer token (hex SHA-256)."""
    return hashlib.sha256(token.encode()).hexdigest()


FINGERPRINT_CHARS = 16


def token_fingerprint(token: str) -> str:
    """Which token a job's pods and its pool attachment hold, safe to show in a status (the start of its digest: it
    tells tokens apart, and the token cannot be recovered from it)."""
    return auth_digest(token)[:FINGERPRINT_CHARS]


def sync_key(token: str) -> bytes:
    """The MAC key of a job's sync rounds (header and payload), derived from its token (one secret, a key per
    purpose; the purpose string names the header, where it was first used, and stays so that keys do not change)."""
    return hmac.new(token.encode(), SYNC_HEADER_PURPOSE, hashlib.sha256).digest()


def environment_token(token: str) -> str:
    """The bearer token of a job's environment server (spec.environment.server), derived from the job's token: hex
    HMAC-SHA256 of ENVIRONMENT_TOKEN_PURPOSE keyed by it. The server runs model-driven code in a sandbox, so it holds
    this token, not the job's: the trainer, which holds the job's, derives it to call the server, and the inference
    servers, which accept only the job's token (or its digest), refuse it. What the server holds gives no way back to
    the job's token, nor to its sync key. The operator writes it beside the job's token in the job's token Secret
    (key c.ENVIRONMENT_TOKEN_SECRET_KEY, the only key the server's pods mount); `grpolora run` gives it to the
    server's processes."""
    return hmac.new(token.encode(), ENVIRONMENT_TOKEN_PURPOSE, hashlib.sha256).hexdigest()


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

    @property
    def fingerprint(self) -> str:
        """The token's fingerprint (token_fingerprint), from the digest kept here."""
        return self.auth[:FINGERPRINT_CHARS]


class Attachments(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    pool: str
    jobs: list[Attachment] = Field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(by_alias=True, mode="json"), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Attachments:
        return cls.model_validate_json(text)


class PoolReplicas(BaseModel):
    """A RolloutPool's replicas as its servers are told them, and as they answer an attached job's trainer
    (GET /v1/sync/pool): how a trainer started with the pool's endpoints of then finds the replicas a scale-up added
    and leaves those a scale-down removed."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    generation: int
    """The pool's metadata.generation it was written for (a counter locally): where two servers hold different
    lists (a Secret volume is updated on each node in its own time), the higher one is the newer."""
    endpoints: tuple[str, ...]
    """The replicas' base URLs, in replica order, as many as spec.replicas now."""

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def replicas_file(jobs_file: Path) -> Path:
    """Where a pool's server reads the pool's replicas: beside its attachment list (the same Secret's volume)."""
    return jobs_file.with_name(REPLICAS_FILE_KEY)


def write_attachments(path: Path, attachments: Attachments | PoolReplicas) -> None:
    """Replace the attachment list file (or the replicas file) at once, as the kubelet swaps a Secret volume: written
    aside (readable by its owner only: the list holds each job's sync key), then renamed over it, so that a server
    never reads half a list."""
    aside = path.with_name(f".{path.name}.partial")
    aside.write_text(attachments.to_json())
    aside.chmod(0o600)
    os.replace(aside, path)


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
    # A whole episode is one request's prompt and completion on the pool's replicas (bind would refuse it too, as
    # it refuses a job's own inference.maxModelLen below maxEpisodeTokens).
    env = job.environment
    if env is not None and pool.max_model_len is not None and env.max_episode_tokens > pool.max_model_len:
        errors.append(
            (
                "environment.maxEpisodeTokens",
                f"{env.max_episode_tokens} does not fit in {pool_says}'s maxModelLen ({pool.max_model_len}), which "
                "holds a whole episode",
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


# ---- admission: one rule for the operator (grpolora.operator.pools) and `grpolora run` ---------------------------


@dataclass(frozen=True)
class Candidate:
    """A GRPOLoraJob that names the pool, as the pool's pass sees it."""

    key: str
    """<namespace>/<name> (grpolora.api.pool.job_key)."""
    uid: str
    created: str
    """metadata.creationTimestamp (RFC 3339, so that string order is time order)."""
    active: bool
    """Wants the pool now: not deleted, not finished or failed, not suspended."""
    fits: bool
    """Its spec parses and fits the pool (grpolora.api.pool.fit_errors is empty)."""
    ready: bool = True
    """Can be attached now: its token Secret exists (the attachment holds the token's digest)."""
    job: GRPOLoraJob | None = None
    token: str = ""
    """The fingerprint of the token its pods were created with (its status.tokenDigest; empty: not known)."""

    @property
    def wants(self) -> bool:
        return self.active and self.fits


@dataclass(frozen=True)
class Admission:
    attached: tuple[str, ...]
    """Keys of the jobs the servers serve, in the order they attached."""
    waiting: tuple[str, ...]
    """Keys of the jobs that want the pool but have no place yet, first in line first."""


def admit(max_jobs: int, candidates: Sequence[Candidate], previous: Sequence[Attachment]) -> Admission:
    """Attached: the jobs already attached that still want the pool (the same uid: a job re-created under the same
    name is a new job), then the waiting ones in order of creation (then name), up to max_jobs. A job attached
    before is never detached to make room (a lowered maxJobs takes effect as jobs leave). A job that cannot be
    attached yet (its token Secret is being created) keeps its place: those behind it wait too, so that the order
    of creation is the order of attachment whatever the timing of the jobs' own passes."""
    wanting = {c.key: c for c in candidates if c.wants}
    kept = [a.job for a in previous if a.job in wanting and wanting[a.job].uid == a.uid]
    line = sorted((c for c in wanting.values() if c.key not in kept), key=lambda c: (c.created, c.key))
    attached, waiting = list(kept), []
    for entry in line:
        if not waiting and len(attached) < max_jobs and entry.ready:
            attached.append(entry.key)
        else:
            waiting.append(entry.key)
    return Admission(tuple(attached), tuple(waiting))
