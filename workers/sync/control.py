"""The control channel of the sync group: how trainer rank 0 asks inference replicas to join an epoch and to
take part in a round. Messages are small JSON over the inference server's token-guarded HTTP API; the tensors
themselves never go over HTTP.

Why a control channel at all: collectives have timeouts, and replicas idle between rounds for as long as a
training step takes. So receivers wait outside any collective, are told a round starts (`prepare`), and enter
its collectives only once the sender has committed it (its header in the group's store, transport.py). A replica
that does not answer is found out in seconds, not after the collective's timeout.
"""

from __future__ import annotations

from typing import Protocol

import httpx
from pydantic import BaseModel, ConfigDict

from grpolora.api.constants import TOKEN_HEADER
from grpolora.api.pool import PoolReplicas

ACTIVATION_TIMEOUT_SECONDS = 60.0
"""Longest an activation may take on a replica: one collective_rpc between engine steps, in which every worker maps the
staged round and builds its LoRA (milliseconds to a second or two). Past it the book (inference/adapter_book.py)
removes the version and the member reports ACTIVATION_FAILED (the older version keeps serving), instead of waiting on
an engine that no longer steps."""

CLOSING_TIMEOUT_SECONDS = ACTIVATION_TIMEOUT_SECONDS + 15.0
"""The round's watchdog bound for its closing status (sync/watchdog.py), on the sender and on every member: that
all-reduce waits for the slowest replica's activation, so `progressTimeoutSeconds` (30 s by default) would cut an
activation the book still allows (60 s) -- on NCCL with an abort in the middle of it. The activation's own bound, plus
the book's cleanup (REMOVAL_TIMEOUT_SECONDS, adapter_book.py) and the answer's trip back to the member."""

JOIN_PATH = "/v1/sync/join"
PREPARE_PATH = "/v1/sync/prepare"
STATE_PATH = "/v1/sync/state"
POOL_PATH = "/v1/sync/pool"


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class JoinRequest(_Message):
    epoch: int
    rank: int
    world_size: int
    store_addr: str
    store_port: int
    backend: str
    timeout_seconds: float  # bounds every collective of the epoch
    join_timeout_seconds: float  # bounds forming the group: a replica that cannot join by then is left out
    # A round in which nothing completes this long is cut on both sides (sync/watchdog.py); None: only
    # timeout_seconds bounds it (a trainer of an older release).
    progress_timeout_seconds: float | None = None
    trainer_fingerprint: str
    current_version: int  # the replica reports ready once it serves at least this version
    # Of the trainer asking (AdapterSender): a replica refuses joins, rounds and versions from an incarnation older
    # than the newest it has seen. 0: a trainer of an older release, or one that was given none.
    incarnation: int = 0


class PrepareRequest(_Message):
    epoch: int
    version: int
    incarnation: int = 0  # of the trainer announcing the round (JoinRequest.incarnation)


class MemberState(_Message):
    """What a replica says about itself (GET /v1/sync/state)."""

    replica_index: int
    fingerprint: str
    epoch: int | None  # the epoch it has joined, if any
    rank: int | None
    live_version: int  # adapter version serving new requests (0 = base model)
    live_incarnation: int = 0  # of the trainer that sent the live version: its version numbers are that trainer's
    incarnation: int = 0  # the newest trainer incarnation this replica has seen (older ones are refused)
    required_version: int  # the version the trainer last said is current
    busy: bool  # forming a group or inside a round
    last_error: str | None = None


class SyncError(RuntimeError):
    """A sync round or group formation failed for good (after re-forming and retrying)."""


class FingerprintMismatch(SyncError):
    """Trainer and replica loaded different base models: fatal, the adapter would be meaningless there."""


class StaleEpoch(SyncError):
    """A request for an epoch the replica is not in (the sender must re-form)."""


class StaleIncarnation(SyncError):
    """A newer incarnation of this job's trainer has taken over the replica: this trainer is a stale one (a pod of a
    restart whose predecessor still runs, a zombie behind a partition) and must stop; fatal."""


class MemberUnreachable(SyncError):
    """The replica did not answer its control endpoint."""


REFUSALS: dict[str, type[SyncError]] = {
    error.__name__: error for error in (FingerprintMismatch, StaleEpoch, StaleIncarnation)
}
"""What a replica refuses a trainer's request with, by name: answered 409 over HTTP with the name in REFUSAL_HEADER
(joins, prepares, and StaleIncarnation for rollouts too), and over the socket of a member in vLLM's worker."""
REFUSAL_HEADER = "X-Grpolora-Refusal"


def refusal_named(response: httpx.Response) -> type[SyncError] | None:
    """The refusal a replica's 409 names (None: another 409, e.g. an adapter version not live)."""
    return REFUSALS.get(response.headers.get(REFUSAL_HEADER, "")) if response.status_code == 409 else None


class Member(Protocol):
    """Trainer rank 0's handle on one inference replica."""

    index: int

    def state(self) -> MemberState:
        """Raises MemberUnreachable if the replica does not answer."""
        ...

    def join(self, request: JoinRequest) -> None:
        """Raises FingerprintMismatch, or MemberUnreachable."""
        ...

    def prepare(self, request: PrepareRequest) -> None:
        """Raises StaleEpoch, or MemberUnreachable."""
        ...

    def pool_replicas(self) -> PoolReplicas | None:
        """The pool's replicas as this replica was told them (grpolora.api.pool.PoolReplicas); None where it is not
        a pool's server. Raises MemberUnreachable."""
        ...


class HttpMember:
    """A replica reached over its HTTP API (inference server)."""

    def __init__(self, index: int, base_url: str, token: str, *, timeout_seconds: float = 10.0):
        self.index = index
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(
            base_url=self.base_url,
            headers={TOKEN_HEADER: f"Bearer {token}"},
            timeout=timeout_seconds,
        )

    def _call(self, method: str, path: str, body: BaseModel | None = None) -> httpx.Response:
        try:
            response = self._client.request(method, path, json=body.model_dump() if body else None)
        except httpx.HTTPError as exc:
            raise MemberUnreachable(f"inference replica {self.index} ({self.base_url}): {exc}") from exc
        if response.status_code == 409:
            detail = response.json().get("detail", response.text)
            raise (refusal_named(response) or StaleEpoch)(f"inference replica {self.index}: {detail}")
        if response.status_code >= 400:
            raise MemberUnreachable(
                f"inference replica {self.index} ({self.base_url}) answered {response.status_code}: {response.text}"
            )
        return response

    def state(self) -> MemberState:
        return MemberState.model_validate(self._call("GET", STATE_PATH).json())

    def join(self, request: JoinRequest) -> None:
        self._call("POST", JOIN_PATH, request)

    def prepare(self, request: PrepareRequest) -> None:
        self._call("POST", PREPARE_PATH, request)

    def pool_replicas(self) -> PoolReplicas | None:
        try:
            response = self._client.get(POOL_PATH)
        except httpx.HTTPError as exc:
            raise MemberUnreachable(f"inference replica {self.index} ({self.base_url}): {exc}") from exc
        if response.status_code == 404:  # a job's own server (or a pool server of an older release)
            return None
        if response.status_code >= 400:
            raise MemberUnreachable(
                f"inference replica {self.index} ({self.base_url}) answered {response.status_code}: {response.text}"
            )
        return PoolReplicas.model_validate(response.json())

    def close(self) -> None:
        self._client.close()
