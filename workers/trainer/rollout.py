"""Rollouts from the inference replicas over HTTP: prompts spread evenly over the replicas that serve the version,
all replicas at once, each request asking for the adapter version the trainer means (the server waits for it)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from grpolora.api.constants import TOKEN_HEADER
from grpolora.workers.sync.control import StaleIncarnation, refusal_named

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # behaviour logprobs: those of `version`, the adapter that generated the tokens
    text: str
    finish_reason: str | None
    version: int
    reference_logprobs: list[float] | None = None  # the base model's, when the replica was asked for them


@dataclass(frozen=True)
class Sampling:
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    reference_logprobs: bool = False  # the replicas also return each sample's (grpo.referenceFrom: inference)
    top_k: int = 0  # 0: off
    stop: tuple[str, ...] = ()


def prompt_seed(run_seed: int, prompt_index: int) -> int:
    """The sampling seed of the prompt at `prompt_index` in the run's prompt stream (step * promptsPerStep + its
    place in the step): the same prompt of the same run gets the same seed on any replica, after any resume.

    A hash rather than `run_seed + prompt_index`: vLLM seeds a prompt's n samples with seed, seed + 1, ...,
    seed + n - 1, so consecutive seeds would make neighbouring prompts (and neighbouring runs) share noise.
    62 bits leave room for that + n inside vLLM's int64.
    """
    digest = hashlib.blake2b(f"{run_seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


class RolloutError(RuntimeError):
    """No replica could serve a rollout request."""


class ReplicasLost(RolloutError):
    """Every replica a round went to failed it (died, unreachable, 5xx): the request itself was not refused, so the
    same round may succeed once the sync group has re-formed on the replicas that answer (or their replacements)."""


class RequestRefused(RolloutError):
    """A replica refused the request itself (4xx other than 409): every replica would, so it is not retried."""


class _VersionGone(Exception):
    """409: the replica serves a newer version than the one asked for; `live` is what it serves now."""

    def __init__(self, live: int):
        self.live = live


class RolloutClient:
    def __init__(
        self,
        endpoints: Sequence[str],
        token: str,
        *,
        timeout_seconds: float,
        endpoint_of: Callable[[int], str | None] | None = None,
        incarnation: int | None = None,
    ):
        """`endpoint_of`: the base URL of a replica by index where the replicas change while the trainer runs (a
        scaled RolloutPool: AdapterSender.endpoint); `endpoints` (those the trainer started with) otherwise.
        `incarnation`: the trainer's (AdapterSender.incarnation), in every request: a replica that follows a newer
        one refuses them (StaleIncarnation: this trainer must stop), and serves a version number only under
        weights this incarnation published. None: no trainer (an evaluation, a benchmark), not fenced."""
        self.endpoints = list(endpoints)
        self.token = token  # an agent's client authenticates its session's calls with it (runner.SessionHost)
        self.incarnation = incarnation
        self._endpoint_of = endpoint_of
        self._client = httpx.Client(headers={TOKEN_HEADER: f"Bearer {token}"}, timeout=timeout_seconds)
        self._pool = ThreadPoolExecutor(max_workers=max(len(self.endpoints), 1), thread_name_prefix="rollout")

    def generate(
        self,
        prompts: Sequence[list[int]],
        sampling: Sampling,
        *,
        version: int,
        replicas: Sequence[int],
        seeds: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """`sampling.n` completions per prompt, on adapter `version`, spread over `replicas` (indices); `seeds`, one
        per prompt, make each prompt's samples reproducible whichever replica serves it.

        A replica that has moved past `version` (a request generated ahead, retried after a newer version went live)
        serves its live version instead: each Completion says which version generated it, so the step is accounted as
        off-policy with the right behaviour logprobs. A replica that fails (unreachable, 5xx, or behind and never
        reaching `version`) has its share served by the others. A request the replica refuses (400/422) is an
        error in the request: it is raised, since every replica would refuse it.
        """
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"need one seed per prompt, got {len(seeds)} seeds for {len(prompts)} prompts")
        if not replicas:
            raise RolloutError(f"no inference replica in the sync group serves adapter version {version}")
        shares: dict[int, list[int]] = {r: [] for r in replicas}
        for position in range(len(prompts)):
            shares[replicas[position % len(replicas)]].append(position)
        results: list[list[Completion] | None] = [None] * len(prompts)
        failed: dict[int, str] = {}  # replica -> why

        def request(replica: int, positions: list[int]) -> None:
            share = [prompts[p] for p in positions]
            share_seeds = None if seeds is None else [seeds[p] for p in positions]
            try:
                try:
                    answer = self._post(replica, share, sampling, version, share_seeds)
                except _VersionGone as gone:
                    log.info("rollout: replica %d serves version %d, no longer %d", replica, gone.live, version)
                    answer = self._post(replica, share, sampling, None, share_seeds)
            except httpx.HTTPError as exc:  # unreachable, 5xx, or behind and never reaching `version` (409)
                failed[replica] = _reason(exc)
                log.warning("rollout: replica %d failed: %s", replica, failed[replica])
                return
            served = answer["adapter_version"]
            for position, result in zip(positions, answer["results"], strict=True):
                results[position] = [Completion(**sample, version=served) for sample in result["samples"]]

        busy = [(replica, positions) for replica, positions in shares.items() if positions]
        if len(busy) == 1:  # one replica's share (an episode's turn): in the caller's thread, not queued behind others
            request(*busy[0])
        else:
            list(self._pool.map(lambda item: request(*item), busy))
        if failed:
            # Others take over the lost shares; the sync group re-forms before the next round.
            alive = [r for r in replicas if r not in failed]
            lost = [p for r in failed for p in shares[r]]
            if not alive:
                reasons = "; ".join(f"replica {r} ({self._url(r)}): {why}" for r, why in sorted(failed.items()))
                raise ReplicasLost(f"every replica failed to generate ({len(lost)} prompts lost): {reasons}")
            retry = self.generate(
                [prompts[p] for p in lost],
                sampling,
                version=version,
                replicas=alive,
                seeds=None if seeds is None else [seeds[p] for p in lost],
            )
            for position, completions in zip(lost, retry, strict=True):
                results[position] = completions
        return [r for r in results if r is not None]

    def _post(
        self, replica: int, prompts: list[list[int]], sampling: Sampling, version: int | None, seeds: list[int] | None
    ) -> dict:
        body = {
            "prompt_token_ids": prompts,
            "n": sampling.n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
            "seed": seeds,
            "adapter_version": version,
        }
        # Only when set: a server of an older release refuses fields it does not know.
        if self.incarnation is not None:
            body["incarnation"] = self.incarnation
        if sampling.reference_logprobs:
            body["reference_logprobs"] = True
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        response = self._refusals(replica, self._client.post(f"{self._url(replica)}/v1/generate", json=body), version)
        if response.status_code in (400, 413, 422):
            raise RequestRefused(f"inference replica {replica} refused the request: {response.text[:2000]}")
        response.raise_for_status()
        return response.json()

    def open_session(self, replica: int, sid: str, bounds: dict[str, Any]) -> tuple[str, int]:
        """Open an agent's chat session `sid` on `replica` with SessionBounds (workers/inference/sessions.py):
        (the base URL of its OpenAI API, the adapter version it is pinned to). A replica that has moved past the
        bounds' version pins it to its live one instead, as generate serves it (the episode is accounted with the
        version that generated it). httpx.HTTPError where the replica fails; StaleIncarnation as generate."""
        body = dict(bounds) | ({"incarnation": self.incarnation} if self.incarnation is not None else {})
        url = f"{self._url(replica)}/sessions/{sid}"
        asked = body.get("adapter_version")
        try:
            response = self._refusals(replica, self._client.post(url, json=body), asked)
        except _VersionGone as gone:
            log.info("rollout: replica %d serves version %d, no longer %d (an agent's session)", replica, gone.live,
                     asked)  # fmt: skip
            response = self._refusals(replica, self._client.post(url, json=body | {"adapter_version": None}), None)
        response.raise_for_status()
        return f"{url}/v1", int(response.json()["adapter_version"])

    def close_session(self, replica: int, sid: str) -> dict[str, Any]:
        """Close session `sid` on `replica`: its record (segments, calls, what was refused)."""
        response = self._client.post(f"{self._url(replica)}/sessions/{sid}/close")
        response.raise_for_status()
        return response.json()

    def _refusals(self, replica: int, response: httpx.Response, version: int | None) -> httpx.Response:
        """`response`, unless it is a refusal every request of the trainer to a replica meets: a newer trainer of this
        job took over (StaleIncarnation: stop, as on sync), or the replica moved past `version` (_VersionGone: ask
        again for its live one)."""
        if refusal_named(response) is StaleIncarnation:
            raise StaleIncarnation(f"inference replica {replica}: {response.json().get('detail', response.text)}")
        if response.status_code == 409 and version is not None:
            live = self._live_version(replica)
            if live is not None and live > version:
                raise _VersionGone(live)
        return response

    def _live_version(self, replica: int) -> int | None:
        try:
            return int(self._client.get(f"{self._url(replica)}/v1/adapter").json()["live_version"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def _url(self, replica: int) -> str:
        found = self._endpoint_of(replica) if self._endpoint_of is not None else None
        if found is None and replica < len(self.endpoints):
            found = self.endpoints[replica]
        if found is None:  # a replica that left (a scaled-down pool): its share fails over to the others
            raise httpx.ConnectError(f"inference replica {replica} is no longer a member")
        return found

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()


def _reason(exc: httpx.HTTPError) -> str:
    """Why a replica failed, in its own words where it gave some (the server's `detail`)."""
    if isinstance(exc, httpx.HTTPStatusError):
        try:
            detail = exc.response.json().get("detail", exc.response.text)
        except ValueError:
            detail = exc.response.text
        return f"{exc.response.status_code} {str(detail)[:2000]}"
    return f"{type(exc).__name__}: {exc}"
