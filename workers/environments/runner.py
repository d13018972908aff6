"""Episodes on the replicas: every episode of a round runs on its own, its next turn asked for as soon as its
environment has answered (the replicas batch whatever turns are in flight; lockstep turns, every episode's turn t
before any turn t + 1, remain for comparison: bench/episodes_async.py). Each episode stays on one replica (its
prefix is in that replica's cache) and asks for the adapter version the round started on (the version that generated
it is recorded per turn; the episode's is the oldest, for staleness and importance weights); each turn is a
/v1/generate call with the episode's ids so far and n = 1. The environment's resets and steps are each bounded by
spec.environment.stepTimeoutSeconds (a built-in's or plugin's run in environment processes: processes.py); faults
are the model's (scored with errorReward) or the infrastructure's (the episode played again; a step whose every
episode fails so waits within outageSeconds), never a silent refuge from a low reward.

An agent (spec.environment.agent) is an episode too, played by the agent's own code in an environment process against
a chat session on the episode's replica (agent.py): the same rounds, replays, outage wait and sample (_completion);
its whole run is bounded by maxTurns x stepTimeoutSeconds, its calls by the session's bounds on the replica.

A call that times out on a thread here cannot be stopped (Python threads are not killable): its own thread is left
to finish and its answer is dropped; an environment process is ended instead.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx

from grpolora.api.constants import MAX_EPISODE_TURNS
from grpolora.api.spec import EnvironmentSpec
from grpolora.workers.environments.agent import AgentCall, checked_return, session_sample
from grpolora.workers.environments.base import (
    EnvironmentFactory,
    EnvironmentFault,
    EnvironmentUnavailable,
    InvalidAction,
    Message,
    Opening,
    Reply,
    checked_opening,
    checked_reply,
    close_environment,
    fault_reason,
)
from grpolora.workers.environments.episode import ChatDelta, Episode, EpisodeTokens
from grpolora.workers.environments.tools import ToolCallParser
from grpolora.workers.remote_service import AuthRefused
from grpolora.workers.sync.control import StaleIncarnation
from grpolora.workers.tasks import Prompt
from grpolora.workers.trainer.rollout import Completion, ReplicasLost, Sampling

log = logging.getLogger(__name__)

TurnGenerate = Callable[[int, list[list[int]], Sampling, list[int]], list[Completion]]
"""(replica, each episode's ids so far, sampling with n = 1, one seed per episode) -> one Completion per episode."""


class SessionHost(Protocol):
    """Where an agent's sessions are opened and closed (the trainer's RolloutClient)."""

    token: str

    def open_session(self, replica: int, sid: str, bounds: dict[str, Any]) -> tuple[str, int]:
        """Open session `sid` on `replica` with SessionBounds: (its OpenAI base URL, its adapter version)."""
        ...

    def close_session(self, replica: int, sid: str) -> dict[str, Any]:
        """Close it: its record."""
        ...


@dataclass(frozen=True)
class _AgentRound:
    """What every agent episode of one play shares."""

    sessions: SessionHost
    sampling: Sampling
    version: int
    replicas: Sequence[int]


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
    episode_retries: int = 0  # spec.environment.episodeRetries
    error_reward: float = 0.0  # spec.environment.errorReward
    outage_seconds: float = 0.0  # spec.environment.outageSeconds
    discount: float = 1.0  # spec.environment.discount

    @classmethod
    def of(cls, env: EnvironmentSpec, max_new_tokens: int, model_length: int | None, margin: int = 0) -> EpisodeLimits:
        """spec.environment's limits, the episode's budget also within what the model holds (`model_length`:
        inference.maxModelLen or the model's own), since the replicas refuse a longer request."""
        budget = min(env.max_episode_tokens, model_length or env.max_episode_tokens)
        return cls(env.max_turns, budget, max_new_tokens, env.step_timeout_seconds, margin, env.episode_retries,
                   env.error_reward, env.outage_seconds, env.discount)  # fmt: skip


def episode_return(turn_rewards: dict[int, float], discount: float = 1.0) -> float | None:
    """An episode's return from the rewards its environment gave per assistant turn (turn t from 1; a turn without
    one counts 0): sum of discount^(t-1) * r_t. None where it gave none: spec.task's reward scores the episode."""
    if not turn_rewards:
        return None
    return sum(discount ** (turn - 1) * reward for turn, reward in turn_rewards.items())


class EnvironmentOutage(RuntimeError):
    """Every episode of a step failed on the environment's infrastructure for longer than
    spec.environment.outageSeconds: the run fails (exit 1: a restart may find the environment back)."""


@dataclass
class _Live:
    """One episode while it runs."""

    prompt: Prompt
    replica: int
    seed: int
    fallback: list[int]
    tokens: EpisodeTokens = field(default_factory=lambda: EpisodeTokens([]))
    env: Any = None
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    turns: int = 0
    tool_calls: int = 0
    versions: list[int] = field(default_factory=list)
    text: str = ""
    ended: bool = False
    error: str | None = None
    truncated: bool = False
    seconds: float = 0.0
    unread_call: str | None = None  # the tool error that answers a call the tool parser could not read
    tool_errors: int = 0
    fault: str | None = None  # what the environment raised at the model's message (scored with errorReward)
    turn_rewards: dict[int, float] = field(default_factory=dict)  # assistant turn (from 1) -> the reward its step gave
    attempts: int = 0  # plays begun again on a fresh environment after an infrastructure fault
    returned: float | None = None  # an agent's own reward (the episode's return as it is), or errorReward
    segments: int | None = None  # an agent's session: its segments (the last is the sample); None: no agent
    replica_lost: bool = False  # the last play failed at opening or closing its session: the replica's fault

    def end(self, *, error: str | None = None, truncated: bool = False) -> None:
        self.ended, self.error, self.truncated = True, error, truncated

    def begin(self, env: Any, opening: Opening, ids: list[int]) -> None:
        """A (new) play of the episode: its environment, its opening, nothing generated yet."""
        self.env, self.tokens, self.messages = env, EpisodeTokens(ids), list(opening.messages)
        self.tools = opening.tools
        self.turns, self.tool_calls, self.tool_errors, self.versions, self.text = 0, 0, 0, [], ""
        self.unread_call, self.turn_rewards = None, {}


class EpisodeRunner:
    def __init__(
        self, factory: EnvironmentFactory, delta: ChatDelta, limits: EpisodeLimits, *, workers: int = 8,
        tool_parser: ToolCallParser | None = None, name: str = "the environment", lockstep: bool = False,
        agent: bool = False,
    ):  # fmt: skip
        self.factory = factory
        # The factory makes agents' players (agent.py): each episode is an agent's run against a chat session.
        self.agent = agent
        # Episodes advance on their own by default: each its next turn as soon as its environment has answered (the
        # replicas batch whatever requests are in flight). Lockstep (every live episode's turn t, then every step,
        # then turn t + 1) is kept for the benchmark that compares the two (bench/episodes_async.py).
        self.lockstep = lockstep
        self.name = name  # how errors name the environment (its built-in, plugin or url)
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
        sessions: SessionHost | None = None,
    ) -> list[list[EpisodeCompletion]]:
        """`sampling.n` episodes per prompt, spread over `replicas`, on adapter `version` (what `generate` asks
        for); `fallback_ids` (each prompt's ids as the task renders it) stand in as the opening of an episode whose
        environment failed to open it, and `version` as the version of one that generated nothing. An agent's
        episodes open their sessions on `sessions` instead of calling `generate`."""
        if not replicas:
            raise ValueError("no replica to run episodes on")
        agents = None
        if self.agent:
            if sessions is None:
                raise ValueError("an agent's episodes need the replicas' sessions")
            agents = _AgentRound(sessions, sampling, version, replicas)
        started = time.monotonic()
        pause = 1.0
        while True:
            groups = self._play(prompts, fallback_ids, seeds, sampling, generate, replicas, agents)
            lost = [e for group in groups for e in group if e.error is not None]
            if len(lost) < sum(len(group) for group in groups):
                return [[self._completion(e, version) for e in group] for group in groups]
            if agents is not None and all(e.replica_lost for e in lost):
                # No replica opened or closed a session: the replicas are gone, not the environment. The producer
                # re-forms the sync group (waiting for replacements) and plays the round again, as for /v1/generate.
                raise ReplicasLost(f"every replica failed the agents' sessions; the last error: {lost[-1].error}")
            # Every episode met an infrastructure fault (the environment is down or restarting): wait for it.
            waited = time.monotonic() - started
            if waited + pause > self.limits.outage_seconds:
                raise EnvironmentOutage(
                    f"spec.environment ({self.name}): every episode of the step failed on the environment for "
                    f"{waited:.0f} s, past outageSeconds ({self.limits.outage_seconds:g}); the last error: "
                    f"{lost[-1].error}"
                )
            log.warning("every episode of the step failed on the environment (%s; e.g. %s); playing the step again "
                        "in %.0f s", self.name, lost[-1].error, pause)  # fmt: skip
            time.sleep(pause)
            pause = min(pause * 2, 30.0)

    def _play(self, prompts: Sequence[Prompt], fallback_ids: Sequence[list[int]], seeds: Sequence[int],
              sampling: Sampling, generate: TurnGenerate, replicas: Sequence[int],
              agents: _AgentRound | None = None) -> list[list[_Live]]:  # fmt: skip
        """One play of the round's episodes, each to its end (an episode that meets an infrastructure fault begins
        again on a fresh environment, episodeRetries times at most, and ends with the fault after that)."""
        episodes = [
            _Live(prompt, replicas[(p * sampling.n + g) % len(replicas)], seeds[p] + g * MAX_EPISODE_TURNS, fallback)
            for p, (prompt, fallback) in enumerate(zip(prompts, fallback_ids, strict=True))
            for g in range(sampling.n)
        ]
        # Made in order (a factory may count its environments), then reset all at once, as steps are.
        made = [_Call.now(self.factory) for _ in episodes]
        if agents is not None:  # each agent runs on its own, from its session's opening to its close
            with ThreadPoolExecutor(max_workers=max(len(episodes), 1), thread_name_prefix="agent") as drivers:
                list(drivers.map(lambda item: self._agent(*item, agents), zip(episodes, made, strict=True)))
        else:
            list(self._pool.map(lambda item: self._open(*item), zip(episodes, made, strict=True)))
            if self.lockstep:
                while live := [e for e in episodes if not e.ended]:
                    self._generate_turn(live, sampling, generate)
                    self._environment_turn([e for e in live if not e.ended])
            else:
                with ThreadPoolExecutor(max_workers=max(len(episodes), 1), thread_name_prefix="episode") as drivers:
                    list(drivers.map(lambda e: self._drive(e, sampling, generate), episodes))
        _close_all([e.env for e in episodes if e.env is not None])
        return [episodes[p * sampling.n : (p + 1) * sampling.n] for p in range(len(prompts))]

    def _open(self, episode: _Live, made: tuple[Any, BaseException | None]) -> None:
        """A play of `episode` begun: `made` (its environment, or what making it raised) reset. Any failure here is
        the environment's, not the model's (it has not acted yet): played again on a fresh one, within bounds."""
        started = time.perf_counter()
        env, error = made
        try:
            if error is not None:
                raise error
            limit = self.limits.step_timeout_seconds
            opening = checked_opening(_Call(env.reset, episode.prompt).result(limit, "reset", limit))
            episode.begin(env, opening, self.delta.opening(opening))
        except AuthRefused:  # the job's credentials: a spec error for the run, not one episode's
            raise
        except Exception as exc:  # the environment's own failure: this episode's, not the run's
            episode.seconds += time.perf_counter() - started
            self._lost(episode, env, exc)
            return
        episode.seconds += time.perf_counter() - started
        if len(episode.tokens) + self.limits.margin >= self.limits.max_episode_tokens:
            episode.end(
                error=f"the opening's {len(episode.tokens)} tokens leave no room in maxEpisodeTokens "
                f"({self.limits.max_episode_tokens})"
            )

    def _lost(
        self, episode: _Live, env: Any, exc: BaseException, again: Callable[[_Live, Any], None] | None = None
    ) -> None:
        """An infrastructure fault (`exc`): the episode begins again on a fresh environment (`again`, default
        _open), or, past episodeRetries, ends with the fault (unscorable: no sample of the model's own doing)."""
        if env is not None:
            _close_all([env])
        reason = fault_reason(exc)
        if episode.attempts >= self.limits.episode_retries:
            episode.tokens = EpisodeTokens(list(episode.fallback))  # what it generated trains on nothing
            episode.env = None
            episode.end(error=reason if not episode.attempts else f"{reason} (after {episode.attempts} more plays)")
            return
        episode.attempts += 1
        log.info("an episode begins again on a fresh environment (play %d): %s", episode.attempts + 1, reason)
        (again or self._open)(episode, _Call.now(self.factory))

    def _agent(self, episode: _Live, made: tuple[Any, BaseException | None], round: _AgentRound) -> None:
        """A play of an agent's episode: its session opened on its replica with the episode's bounds, the agent run
        in its environment process (maxTurns x stepTimeoutSeconds at most, the process ended past it), the session
        closed and its last segment taken as the episode's tokens. The replica's or the process's failure plays the
        episode again (_lost, on the next replica); what the agent raised otherwise, or a return that is no reward,
        is its own: scored with errorReward. A call the session refused past its bounds truncates the episode."""
        started = time.perf_counter()
        env, error = made
        sid, opened = f"agent-{uuid.uuid4().hex}", False
        episode.segments = episode.segments or 0  # an agent's, whatever befalls it (its step's figures say so)
        limits = self.limits
        try:
            if error is not None:
                raise error
            bounds = {
                "adapter_version": round.version,
                "max_calls": limits.max_turns,
                "max_tokens": limits.max_episode_tokens - limits.margin,
                "max_new_tokens": min(limits.max_new_tokens, round.sampling.max_tokens),
                "temperature": round.sampling.temperature,
                "top_p": round.sampling.top_p,
                "top_k": round.sampling.top_k,
                "seed": episode.seed,
            }
            base_url, version = round.sessions.open_session(episode.replica, sid, bounds)
            opened = True
            seconds = limits.max_turns * limits.step_timeout_seconds
            call = AgentCall(episode.prompt, base_url, round.sessions.token, version, seconds)
            try:
                returned, raised = env.play(call, seconds), None
            except EnvironmentUnavailable:
                raise
            except Exception as exc:  # the agent's own exception (EnvironmentRaised from its process)
                returned, raised = None, exc
            record = round.sessions.close_session(episode.replica, sid)
            opened = False
            sample = session_sample(record)
        except (AuthRefused, StaleIncarnation):
            raise
        except Exception as exc:  # the process died or ran past its time, the replica failed: the infrastructure's
            episode.seconds += time.perf_counter() - started
            episode.replica_lost = isinstance(exc, httpx.HTTPError)
            if opened:
                _forget(round.sessions, episode.replica, sid)
            if episode.replica in round.replicas:  # played again on the next replica: this one may be what failed
                episode.replica = round.replicas[(round.replicas.index(episode.replica) + 1) % len(round.replicas)]
            self._lost(episode, env, exc, again=lambda e, again_made: self._agent(e, again_made, round))
            return
        episode.seconds += time.perf_counter() - started
        episode.env = env
        if sample is not None:
            episode.tokens, episode.messages, episode.turns = sample.tokens, sample.messages, sample.calls
            episode.versions, episode.text = [sample.version] * sample.calls, sample.text
            episode.tool_calls = sum(m.get("role") == "tool" for m in sample.messages)
            episode.segments = sample.dropped_segments + 1
        else:
            episode.tokens, episode.segments = EpisodeTokens(list(episode.fallback)), 0
            if record.get("refused") is not None:  # its first call could not fit: nothing to score, as an opening
                episode.end(error=f"the agent's first call was refused: {record['refused']}")  # that leaves no room
                return
        episode.end(truncated=sample is not None and sample.truncated)
        try:
            if sample is None and raised is None:
                raise EnvironmentFault("the agent made no call to the model")
            if raised is not None and not episode.truncated:  # past its bounds the agent fails as it may: truncated
                raise raised
            episode.returned = checked_return(returned)
        except Exception as exc:
            episode.fault = fault_reason(exc)
            episode.returned = limits.error_reward

    def _drive(self, episode: _Live, sampling: Sampling, generate: TurnGenerate) -> None:
        """One episode to its end on its own: a turn, then its environment's answer, then its next turn."""
        while not episode.ended:
            self._generate_turn([episode], sampling, generate)
            if not episode.ended:
                self._environment_turn([episode])

    def _generate_turn(self, live: list[_Live], sampling: Sampling, generate: TurnGenerate) -> None:
        """One assistant turn of every live episode: one request per replica and token budget, all at once."""
        batches: dict[tuple[int, int], list[_Live]] = {}
        for episode in live:
            room = self.limits.max_episode_tokens - len(episode.tokens) - self.limits.margin
            batches.setdefault((episode.replica, min(self.limits.max_new_tokens, room)), []).append(episode)

        def request(key: tuple[int, int]) -> list[Completion]:
            replica, budget = key
            members = batches[key]
            turn_sampling = replace(sampling, n=1, max_tokens=budget)
            seeds = [e.seed + e.turns for e in members]  # a play begun again samples as the first did
            return generate(replica, [e.tokens.ids for e in members], turn_sampling, seeds)

        keys = list(batches)
        # One request (an episode on its own): in this thread; several (lockstep): at once.
        asked = [request(keys[0])] if len(keys) == 1 else list(self._pool.map(request, keys))
        for key, answers in zip(keys, asked, strict=True):
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

    def _environment_turn(self, live: list[_Live]) -> None:
        """Every live episode's environment answers its last assistant message (at once, each bounded in time).
        After an episode's last turn (maxTurns) its answer goes into the transcript only: no turn follows that would
        train on it. What the environment raises at the model's message is the model's: InvalidAction is answered
        as the tool's error, anything else ends the episode with errorReward; an infrastructure fault
        (EnvironmentUnavailable, a step past stepTimeoutSeconds) plays the episode again (_lost)."""
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
                    try:
                        reply = checked_reply(call.result(max(deadline - time.monotonic(), 0.0), "step", limit))
                    except InvalidAction as exc:
                        reply = exc.reply()
                        episode.tool_errors += 1
                if reply.reward is not None:  # the reward of the turn this step answered
                    episode.turn_rewards[episode.turns] = reply.reward
                if reply.done:
                    episode.end()
                    continue
                ids = self.delta.environment_turn(episode.tokens.tokens[-8:], reply.messages, episode.tools)
            except AuthRefused:
                raise
            except EnvironmentUnavailable as exc:
                self._lost(episode, episode.env, exc)
                continue
            except Exception as exc:  # raised at the model's message: scored, never a refuge from a low reward
                episode.fault = fault_reason(exc)
                episode.turn_rewards[episode.turns] = self.limits.error_reward
                episode.end()
                continue
            episode.messages += reply.messages
            episode.tool_calls += sum(m["role"] == "tool" for m in reply.messages)
            last = episode.turns >= self.limits.max_turns
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
            fault=e.fault,
            turn_rewards=[e.turn_rewards.get(t) for t in range(1, e.turns + 1)] if e.turn_rewards else None,
            error=e.error,
            reward=None if e.error is not None else (
                e.returned if e.returned is not None else episode_return(e.turn_rewards, self.limits.discount)
            ),
            segments=e.segments,
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
        if callable(close := getattr(self.factory, "close", None)):  # the environment processes, a service's client
            close()


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
            raise EnvironmentUnavailable(f"{what}() took longer than stepTimeoutSeconds ({limit:g} s)")
        if self._error is not None:
            raise self._error
        return self._value


def _forget(sessions: SessionHost, replica: int, sid: str) -> None:
    """Close a session whose episode is played again (its record trains on nothing); the replica may be gone."""
    try:
        sessions.close_session(replica, sid)
    except Exception as exc:
        log.info("closing an agent's session %s on replica %d: %s", sid, replica, exc)


def _close_all(environments: list[Any]) -> None:
    """Every ended episode's environment closed (close_environment), in turn on a thread of their own: the step goes
    on meanwhile."""
    if any(callable(getattr(env, "close", None)) for env in environments):
        threading.Thread(
            target=lambda: [close_environment(env) for env in environments], name="environment-close", daemon=True
        ).start()
