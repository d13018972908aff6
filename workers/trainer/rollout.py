"""Rollouts from the inference replicas over HTTP: prompts spread evenly over the replicas in the sync group,
all replicas at once, each request asking for the adapter version the trainer means (the server waits for it)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from grpolora.api.constants import TOKEN_HEADER

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None


@dataclass(frozen=True)
class Sampling:
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None = None


class RolloutError(RuntimeError):
    """No replica could serve a rollout request."""


class RolloutClient:
    def __init__(self, endpoints: Sequence[str], token: str, *, timeout_seconds: float):
        self.endpoints = list(endpoints)
        self._client = httpx.Client(headers={TOKEN_HEADER: f"Bearer {token}"}, timeout=timeout_seconds)
        self._pool = ThreadPoolExecutor(max_workers=max(len(self.endpoints), 1), thread_name_prefix="rollout")

    def generate(
        self, prompts: Sequence[list[int]], sampling: Sampling, *, version: int, replicas: Sequence[int]
    ) -> list[list[Completion]]:
        """`sampling.n` completions per prompt, on adapter `version`, spread over `replicas` (indices).

        A replica that fails (gone, engine error, version not live) loses its share to the others; the sync group
        re-forms without it before the next round. A request a replica refuses as invalid (4xx) would be refused
        by every replica, so it fails at once with the replica's reason."""
        if not replicas:
            raise RolloutError("no inference replica is in the sync group")
        results: list[list[Completion] | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        alive = list(replicas)
        errors: dict[int, str] = {}
        while pending:
            if not alive:
                named = "; ".join(f"replica {r} ({self.endpoints[r]}): {e}" for r, e in sorted(errors.items()))
                raise RolloutError(f"every replica failed to generate ({len(pending)} prompts lost): {named}")
            shares: dict[int, list[int]] = {r: [] for r in alive}
            for turn, position in enumerate(pending):
                shares[alive[turn % len(alive)]].append(position)
            outcomes = self._pool.map(lambda item: self._request(*item, prompts, sampling, version), shares.items())
            pending = []
            for (replica, positions), outcome in zip(shares.items(), outcomes, strict=True):
                if isinstance(outcome, str):
                    log.warning("rollout: replica %d failed: %s", replica, outcome)
                    errors[replica] = outcome
                    alive.remove(replica)
                    pending += positions
                    continue
                for position, completions in zip(positions, outcome, strict=True):
                    results[position] = completions
        return [r for r in results if r is not None]

    def _request(
        self, replica: int, positions: list[int], prompts: Sequence[list[int]], sampling: Sampling, version: int
    ) -> list[list[Completion]] | str:
        """The completions of `positions` from one replica, or why it failed; RolloutError if it refused them."""
        if not positions:
            return []
        body = {
            "prompt_token_ids": [prompts[p] for p in positions],
            "n": sampling.n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
            "seed": None if sampling.seed is None else sampling.seed + positions[0],
            "adapter_version": version,
        }
        try:
            response = self._client.post(f"{self.endpoints[replica]}/v1/generate", json=body)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if response.status_code != 200:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            detail = str(detail)[:2000]
            # 409: the version is not live there (a replica behind); 5xx: the replica's fault. Both fail over.
            if 400 <= response.status_code < 500 and response.status_code != 409:
                raise RolloutError(f"replica {replica} refused the request ({response.status_code}): {detail}")
            return f"{response.status_code} {detail}"
        return [[Completion(**s) for s in result["samples"]] for result in response.json()["results"]]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
