"""Rollouts from the inference replicas over HTTP: prompts spread evenly over the replicas in the sync group,
all replicas at once, each request asking for the adapter version the trainer means (the server waits for it)."""

from __future__ import annotations

import hashlib
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


class RolloutClient:
    def __init__(self, endpoints: Sequence[str], token: str, *, timeout_seconds: float):
        self.endpoints = list(endpoints)
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
        per prompt, make each prompt's samples reproducible whichever replica serves it."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"need one seed per prompt, got {len(seeds)} seeds for {len(prompts)} prompts")
        if not replicas:
            raise RolloutError("no inference replica is in the sync group")
        shares: dict[int, list[int]] = {r: [] for r in replicas}
        for position in range(len(prompts)):
            shares[replicas[position % len(replicas)]].append(position)
        results: list[list[Completion] | None] = [None] * len(prompts)
        failed: list[int] = []

        def request(replica: int, positions: list[int]) -> None:
            if not positions:
                return
            body = {
                "prompt_token_ids": [prompts[p] for p in positions],
                "n": sampling.n,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "max_tokens": sampling.max_tokens,
                "seed": None if seeds is None else [seeds[p] for p in positions],
                "adapter_version": version,
            }
            try:
                response = self._client.post(f"{self.endpoints[replica]}/v1/generate", json=body)
                response.raise_for_status()
            except httpx.HTTPError as exc:
                log.warning("rollout: replica %d failed: %s", replica, exc)
                failed.extend(positions)
                return
            for position, result in zip(positions, response.json()["results"], strict=True):
                results[position] = [Completion(**sample) for sample in result["samples"]]

        list(self._pool.map(lambda item: request(*item), shares.items()))
        if failed:
            # Another replica takes over the lost share; the sync group re-forms before the next round.
            alive = [r for r in replicas if not any(p in failed for p in shares[r])]
            if not alive:
                raise RolloutError(f"every replica failed to generate ({len(failed)} prompts lost)")
            retry = self.generate(
                [prompts[p] for p in failed],
                sampling,
                version=version,
                replicas=alive,
                seeds=None if seeds is None else [seeds[p] for p in failed],
            )
            for position, completions in zip(failed, retry, strict=True):
                results[position] = completions
        return [r for r in results if r is not None]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
