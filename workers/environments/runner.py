"""Episodes on the replicas: every episode of a round runs turn by turn, all episodes' turns at once. Each episode
stays on one replica (its prefix is in that replica's cache) and asks for the adapter version the round started on
(the version that generated it is recorded per turn; the episode's is the oldest, for staleness and importance
weights); each turn is a /v1/generate call with the episode's ids so far and n = 1. The environment's resets and
steps run each on a thread of its own, bounded by spec.environment.stepTimeoutSeconds; one that raises, times out or
answers malformed data ends its episode with an error, not the run.

A call that times out cannot be stopped (Python threads are not killable): its own thread is left to finish and
its answer is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from grpolora.api.constants import MAX_EPISODE_TURNS
from grpolora.api.spec import EnvironmentSpec
from grpolora.workers.environments.base import (
    EnvironmentFactory,
    EnvironmentFault,
    Message,
    Reply,
    checked_opening,
    checked_reply,
    close_environment,
    fault_reason,
)
from grpolora.workers.environments.episode import ChatDelta, Episode, EpisodeTokens
from grpolora.workers.environments.tools import ToolCallParser
from grpolora.workers.remote_service import AuthRefused
from grpolora.workers.tasks import Prompt
from grpolora.workers.trainer.rollout import Completion, Sampling

log = logging.getLogger(__name__)

TurnGenerate = Callable[[int, list[list[int]], Sampling, list[int]], list[Completion]]
"""(replica, each episode's ids so far, sampling with n = 1, one seed per episode) -> one Completion per episode."""


@dataclass(frozen=True)
class EpisodeCompletion(Completion):
    """A rollout that is a whole episode: `token_ids` are every id after its opening (assistant and environment
    turns), `logprobs` 0 at the environment's, `text` the last assistant message (what spec.task's reward scores)."""

    episode: Episode | None = None


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_episode_tokens: int
    max_new_tokens: int
    step_timeout_seconds: float
    margin: int = 0  # tokens kept free at the end (the replicas' reference pass needs one more)

    @classmethod
    def of(cls, env: EnvironmentSpec, max_new_tokens: int, model_length: int | None, margin: int = 0) -> EpisodeLimits:
        """spec.environment's limits, the episode's budget also within what the model holds (`model_length`:
        inference.maxModelLen or the model's own), since the replicas refuse a longer request."""
        budget = min(env.max_episode_tokens, model_length or env.max_episode_tokens)
        return cls(env.max_turns, budget, max_new_tokens, env.step_timeout_seconds, margin)


@dataclass
class _Live:
    """One episode while it runs."""

    env: Any
    replica: int
    seed: int
    tokens: EpisodeTokens
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    turns: int = 0
    tool_calls: int = 0
    versions: list[int] = field(default_factory=list)
    text: str = ""
    ended: bool = False
    error: str | None = None
    reward: float | None = None
    truncated: bool = False
    seconds: float = 0.0
    unread_call: str | None = None  # the tool error that answers a call the tool parser could not read
    tool_errors: int = 0

    def end(self, *, error: str | None = None, truncated: bool = False, reward: float | None = None) -> None:
        self.ended, self.error, self.truncated, self.reward = True, error, truncated, reward


class EpisodeRunner:
    def __init__(
        self, factory: EnvironmentFactory, delta: ChatDelta, limits: EpisodeLimits, *, workers: int = 8,
        tool_parser: ToolCallParser | None = None,
    ):  # fmt: skip
        self.factory = factory
        self.delta = delta
        self.limits = limits
        self.tool_parser = tool_parser
        # Requests to the replicas, one per replica and budget of a turn. The environment's calls each get a thread
        # of their own (_Call): one that never returns must not hold a thread another call waits for.
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="episode-turn")

    def run(
        self,
        prompts: Sequence[Prompt],
        fallback_ids: Sequence[list[int]],
        seeds: Sequence[int],
        sampling: Sampling,
        generate: TurnGenerate,
        replicas: Sequence[int],
        *,
        version: int,
    ) -> list[list[EpisodeCompletion]]:
        """`sampling.n` episodes per prompt, spread over `replicas`, on adapter `version` (what `generate` asks
        for); `fallback_ids` (each prompt's ids as the task renders it) stand in as the opening of an episode whose
        environment failed to open it, and `version` as the version of one that generated nothing."""
        if not replicas:
            raise ValueError("no replica to run episodes on")
        starts = [
            (prompt, replicas[(p * sampling.n + g) % len(replicas)], seeds[p] + g * MAX_EPISODE_TURNS, fallback)
            for p, (prompt, fallback) in enumerate(zip(prompts, fallback_ids, strict=True))
            for g in range(sampling.n)
        ]
        # Made in order (a factory may count its environments), then reset all at once, as steps are.
        made = [_Call.now(self.factory) for _ in starts]
        opened = list(self._pool.map(lambda item: self._open(item[0], *item[1]), zip(made, starts, strict=True)))
        groups = [opened[p * sampling.n : (p + 1) * sampling.n] for p in range(len(prompts))]
        episodes = [e for group in groups for e in group]
        for turn in range(self.limits.max_turns):
            live = [e for e in episodes if not e.ended]
            if not live:
                break
            self._generate_turn(live, turn, sampling, generate)
            self._environment_turn([e for e in live if not e.ended], last=turn + 1 == self.limits.max_turns)
        for episode in episodes:
            if not episode.ended:  # maxTurns reached with the environment still going
                episode.end(truncated=True)
        _close_all([e.env for e in episodes if e.env is not None])
        return [[self._completion(e, version) for e in group] for group in groups]

    def _open(self, made: tuple[Any, BaseException | None], prompt: Prompt, replica: int, seed: int,
              fallback: list[int]) -> _Live:  # fmt: skip
        started = time.perf_counter()
        env, error = made
        try:
            if error is not None:
                raise error
            limit = self.limits.step_timeout_seconds
            opening = checked_opening(_Call(env.reset, prompt).result(limit, "reset", limit))
            episode = _Live(
                env, replica, seed, EpisodeTokens(self.delta.opening(opening)), list(opening.messages), opening.tools
            )
        except AuthRefused:  # the job's credentials: a spec error for the run, not one episode's
            raise
        except Exception as exc:  # the environment's own failure: this episode's error, not the run's
            episode = _Live(env, replica, seed, EpisodeTokens(list(fallback)))
            episode.end(error=fault_reason(exc))
        episode.seconds += time.perf_counter() - started
        if not episode.ended and len(episode.tokens) + self.limits.margin >= self.limits.max_episode_tokens:
            episode.end(
                error=f"the opening's {len(episode.tokens)} tokens leave no room in maxEpisodeTokens "
                f"({self.limits.max_episode_tokens})"
            )
        return episode

    def _generate_turn(self, live: list[_Live], turn: int, sampling: Sampling, generate: TurnGenerate) -> None:
        """One assistant turn of every live episode: one request per replica and token budget, all at once."""
        batches: dict[tuple[int, int], list[_Live]] = {}
        for episode in live:
            room = self.limits.max_episode_tokens - len(episode.tokens) - self.limits.margin
            batches.setdefault((episode.replica, min(self.limits.max_new_tokens, room)), []).append(episode)

        def request(key: tuple[int, int]) -> list[Completion]:
            replica, budget = key
            members = batches[key]
            turn_sampling = replace(sampling, n=1, max_tokens=budget)
            return generate(replica, [e.tokens.ids for e in members], turn_sampling, [e.seed + turn for e in members])

        keys = list(batches)
        for key, answers in zip(keys, self._pool.map(request, keys), strict=True):
            for episode, answer in zip(batches[key], answers, strict=True):
                episode.tokens.add_assistant(answer.token_ids, answer.logprobs, answer.reference_logprobs)
                episode.versions.append(answer.version)
                episode.turns += 1
                episode.text = answer.text
                episode.messages.append(self._assistant_message(episode, answer))
                if answer.finish_reason == "length":  # cut off mid-message: there is nothing to answer
                    episode.end(truncated=True)

    def _assistant_message(self, episode: _Live, answer: Completion) -> Message:
        """The turn as the environment gets it: its text, or with spec.environment.toolParser, its parsed calls."""
        if self.tool_parser is None:
            return {"role": "assistant", "content": answer.text}
        closing = self.delta.closing_ids(episode.tools)
        message, episode.unread_call = self.tool_parser.message(answer.token_ids, answer.text, episode.tools, closing)
        return message

    def _environment_turn(self, live: list[_Live], *, last: bool) -> None:
        """Every live episode's environment answers its last assistant message (at once, each bounded in time).
        After the `last` turn its answer goes into the transcript only: no turn follows that would train on it."""
        started = time.perf_counter()
        # A call the tool parser could not read is answered with the tool's error, not sent to the environment.
        calls = [(e, None if e.unread_call else _Call(e.env.step, e.messages[-1])) for e in live]
        limit = self.limits.step_timeout_seconds
        deadline = time.monotonic() + limit  # they run at once: one deadline for all
        for episode, call in calls:
            try:
                if call is None:
                    reply = Reply([{"role": "tool", "content": episode.unread_call}])
                    episode.unread_call, episode.tool_errors = None, episode.tool_errors + 1
                else:
                    reply = checked_reply(call.result(max(deadline - time.monotonic(), 0.0), "step", limit))
                if reply.done:
                    episode.end(reward=reply.reward)
                    continue
                ids = self.delta.environment_turn(episode.tokens.tokens[-8:], reply.messages, episode.tools)
            except AuthRefused:
                raise
            except Exception as exc:
                episode.end(error=fault_reason(exc))
                continue
            episode.messages += reply.messages
            episode.tool_calls += sum(m["role"] == "tool" for m in reply.messages)
            if last or len(episode.tokens) + len(ids) + self.limits.margin >= self.limits.max_episode_tokens:
                episode.end(truncated=True)  # maxTurns, or no room for the environment's answer and another turn
            else:
                episode.tokens.add_environment(ids)
        seconds = time.perf_counter() - started
        for episode in live:
            episode.seconds += seconds / len(live)  # they ran at once: each its share of the wall time

    def _completion(self, e: _Live, asked: int) -> EpisodeCompletion:
        episode = Episode(
            opening=e.tokens.opening,
            loss_mask=list(e.tokens.mask),
            messages=e.messages,
            turns=e.turns,
            tool_calls=e.tool_calls,
            tool_errors=e.tool_errors,
            error=e.error,
            reward=e.reward,
            truncated=e.truncated,
            environment_seconds=e.seconds,
        )
        return EpisodeCompletion(
            token_ids=list(e.tokens.tokens),
            logprobs=list(e.tokens.logprobs),
            text=e.text,
            finish_reason="length" if e.truncated else "stop",
            version=min(e.versions, default=asked),
            reference_logprobs=None if e.tokens.reference is None else list(e.tokens.reference),
            episode=episode,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Call:
    """An environment's call on a daemon thread of its own, its result awaited for a bounded time. A call that
    takes longer is left to finish on its own (Python threads cannot be stopped) and its answer dropped."""

    def __init__(self, fn: Callable[[Any], Any], argument: Any):
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(fn, argument), name="environment", daemon=True).start()

    def _run(self, fn: Callable[[Any], Any], argument: Any) -> None:
        try:
            self._value = fn(argument)
        except BaseException as exc:  # handed to the waiting thread, which ends the episode with it
            self._error = exc
        finally:
            self._done.set()

    @staticmethod
    def now(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
        """fn() here and now, as (value, None) or (None, what it raised)."""
        try:
            return fn(), None
        except Exception as exc:
            return None, exc

    def result(self, wait: float, what: str, limit: float) -> Any:
        """The call's answer (or its exception), waiting at most `wait` seconds: what is left of `limit`
        (stepTimeoutSeconds) since the call started."""
        if not self._done.wait(wait):
            raise EnvironmentFault(f"{what}() took longer than stepTimeoutSeconds ({limit:g} s)")
        if self._error is not None:
            raise self._error
        return self._value


def _close_all(environments: list[Any]) -> None:
    """Every ended episode's environment closed (close_environment), in turn on a thread of their own: the step goes
    on meanwhile."""
    if any(callable(getattr(env, "close", None)) for env in environments):
        threading.Thread(
            target=lambda: [close_environment(env) for env in environments], name="environment-close", daemon=True
        ).start()
