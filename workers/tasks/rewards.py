"""Rewards of `spec.task.reward`: built-ins, plugins and remote services, weighted and summed.

Every reward scores a whole batch at once (`Scorer`), so a remote service gets few large requests instead of one
per completion. Each reward's own scores are kept (`Scores.parts`, by label) so that metrics show them apart.

The remote contract (docs/tasks.md): `POST <url>` with `{"items": [{"prompt": str, "completion": str, "answer":
str | null}, ...]}` answers `{"scores": [float, ...]}`, one per item, in order. Requests carry at most
`batchSize` items, at most `concurrency` are in flight; a timeout, a connection error, a 429 or a 5xx answer is
retried `retries` times with backoff; anything else (4xx, a malformed answer) fails at once. A failure is a
RewardError naming the reward and the last problem, raised within a bounded time: about
(retries + 1) * (timeoutSeconds + backoff) per batch, never a hung step; 401 and 403 are the job's credentials
refused (AuthRefused: a spec error). workers/remote_service.py keeps the rule, which environment services share.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from grpolora.api.spec import RewardSpec
from grpolora.workers import remote_service
from grpolora.workers.secrets import SecretError, secret_values
from grpolora.workers.tasks.arithmetic import arithmetic_reward
from grpolora.workers.tasks.base import Prompt, RewardFn, Scores, TaskError, TaskUnreachable
from grpolora.workers.tasks.keyword import keyword_reward
from grpolora.workers.tasks.plugin import batched, call_batched, call_reward, load_reward_function

log = logging.getLogger(__name__)

FIELD = "spec.task.reward"


class RewardError(TaskError):
    """A reward that could not be computed (a failing service, a plugin returning garbage)."""


def math_reward(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 if the completion's final mathematical answer equals `answer` (math-verify: LaTeX or plain expressions,
    \\boxed{...} preferred, 1/2 == 0.5 == \\frac{1}{2}), else 0.0. A prompt without an answer scores 0."""
    from math_verify import parse, verify

    if answer is None:
        return 0.0
    # math-verify bounds its time with SIGALRM, which only the main thread may use.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer if "$" in answer else f"${answer}$", parsing_timeout=timeout)  # a bare answer is math
    guess = parse(completion, parsing_timeout=timeout)
    return 1.0 if gold and guess and verify(gold, guess, timeout_seconds=timeout) else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "arithmetic": lambda prompt, completion, answer: arithmetic_reward(completion, answer or "nan"),
    "keyword": lambda prompt, completion, answer: keyword_reward(completion, answer or ""),
}
"""Built-in rewards by name; the names must equal grpolora.api.constants.BUILTIN_REWARDS (a test checks)."""


class Scorer(Protocol):
    label: str

    def __call__(self, items: Sequence[tuple[Prompt, str]]) -> list[float]: ...

    def close(self) -> None: ...


@dataclass
class FunctionScorer:
    """A built-in or plugin reward, called once per item in this thread."""

    label: str
    fn: RewardFn
    ref: str
    field: str

    def __call__(self, items: Sequence[tuple[Prompt, str]]) -> list[float]:
        try:
            if batched(self.fn):
                return call_batched(self.fn, self.ref, [p for p, _ in items], [c for _, c in items])
            return [call_reward(self.fn, self.ref, prompt, completion) for prompt, completion in items]
        except TaskError as err:
            raise RewardError(self.field, err.message) from None

    def close(self) -> None:
        pass


class RemoteScorer:
    """A reward service (module docstring): batches of `batch_size`, `concurrency` at once, bounded retries."""

    def __init__(
        self,
        label: str,
        url: str,
        *,
        field: str,
        timeout_seconds: float,
        concurrency: int,
        batch_size: int,
        retries: int,
        headers: dict[str, str] | None = None,
    ):
        import httpx

        self.label, self.url, self.field = label, url, field
        self.batch_size, self.retries = batch_size, retries
        self._client = httpx.Client(
            timeout=timeout_seconds,
            headers=headers or {},
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        )
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"reward-{label}")

    def __call__(self, items: Sequence[tuple[Prompt, str]]) -> list[float]:
        chunks = [items[i : i + self.batch_size] for i in range(0, len(items), self.batch_size)]
        return [score for chunk in self._pool.map(self._score_chunk, chunks) for score in chunk]

    def _score_chunk(self, items: Sequence[tuple[Prompt, str]]) -> list[float]:
        body = {"items": [{"prompt": p.text, "completion": c, "answer": p.answer} for p, c in items]}
        try:
            response = remote_service.post(self._client, self.url, body, retries=self.retries, field=self.field)
        except remote_service.ServiceUnavailable as err:
            raise RewardError(
                self.field, f"{self.url} failed {err.attempts} time(s) for a batch of {len(items)}: {err.problem}"
            ) from None
        if response.status_code >= 400:
            raise RewardError(self.field, f"{self.url} refused the request: HTTP {response.status_code}: "
                              f"{response.text[:300]}")  # fmt: skip
        return self._parse(response, len(items))

    def _parse(self, response, count: int) -> list[float]:
        try:
            scores = response.json()["scores"]
        except (ValueError, KeyError, TypeError):
            raise RewardError(
                self.field, f'{self.url} answered {response.text[:300]!r}; expected {{"scores": [float, ...]}}'
            ) from None
        if not isinstance(scores, list) or len(scores) != count:
            got = len(scores) if isinstance(scores, list) else type(scores).__name__
            raise RewardError(self.field, f"{self.url} returned {got} scores for {count} items; expected {count}")
        for i, score in enumerate(scores):
            if isinstance(score, bool) or not isinstance(score, numbers.Real) or not math.isfinite(score):
                raise RewardError(self.field, f"{self.url} returned scores[{i}] = {score!r}; expected a finite float")
        return [float(s) for s in scores]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()


class Rewards:
    """The weighted sum of several rewards; each reward's own scores are reported under its label."""

    def __init__(self, parts: Sequence[tuple[Scorer, float]]):
        self.parts = list(parts)

    @property
    def labels(self) -> list[str]:
        return [scorer.label for scorer, _ in self.parts]

    def score(self, items: Sequence[tuple[Prompt, str]]) -> Scores:
        parts = {scorer.label: scorer(items) for scorer, _ in self.parts}
        # NaN: a reward that does not apply to that item (a TRL-shaped plugin's None) adds nothing; an item no
        # reward applies to is unscorable, NaN in the total too (left out of its group's baseline, as TRL does).
        total = []
        for i in range(len(items)):
            applied = [(weight, v) for scorer, weight in self.parts if not math.isnan(v := parts[scorer.label][i])]
            total.append(math.fsum(weight * v for weight, v in applied) if applied else math.nan)
        return Scores(total, parts if len(self.parts) > 1 else {})

    def close(self) -> None:
        for scorer, _ in self.parts:
            scorer.close()


def build_rewards(specs: Sequence[RewardSpec], root: Path, *, plugin_string: bool = False) -> Rewards:
    """Scorers for `spec.task.rewards`, each checked now (imports, names, Secrets). `plugin_string` says the spec
    gave the single `module:function` form (errors then name `spec.task.reward` itself)."""
    parts: list[tuple[Scorer, float]] = []
    for i, spec in enumerate(specs):
        field = FIELD if plugin_string else f"{FIELD}[{i}]"
        scorer: Scorer
        if spec.name is not None:
            scorer = FunctionScorer(spec.metric_label, BUILTIN_REWARDS[spec.name], spec.name, f"{field}.name")
        elif spec.function is not None:
            where = field if plugin_string else f"{field}.function"
            try:
                fn = load_reward_function(spec.function, root)
            except TaskError as err:  # TaskUnreachable stays so: `grpolora validate` reports it as not checked
                raise type(err)(where, err.message) from None
            scorer = FunctionScorer(spec.metric_label, fn, spec.function, where)
        else:
            assert spec.url is not None
            try:
                headers = secret_values(spec.headers_from.secret_name, "") if spec.headers_from else {}
            except SecretError as err:  # mounted in the trainer pod; not there where `grpolora validate` runs
                raise TaskUnreachable(f"{field}.headersFrom", str(err).removeprefix(": ")) from None
            scorer = RemoteScorer(
                spec.metric_label,
                spec.url,
                field=f"{field}.url",
                timeout_seconds=spec.timeout_seconds,
                concurrency=spec.concurrency,
                batch_size=spec.batch_size,
                retries=spec.retries,
                headers=headers,
            )
        parts.append((scorer, spec.weight))
    return Rewards(parts)
