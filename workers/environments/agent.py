"""Agents (spec.environment.agent, issue 48): an async function of the task's prompt and an `openai.AsyncOpenAI`
client, played as an episode. Two processes run this module's parts:

- the environment processes (processes.py) run the agent: `AgentPlayer.play` makes the client, bound to the
  episode's session on the episode's replica (base_url `<replica>/sessions/<id>/v1`, api_key the job's token, the
  adapter version pinned by the X-Grpolora-Adapter-Version header), and runs the agent's coroutine on an event loop
  of its own (one per call's thread: a blocking agent holds up no other). What the agent meets on the replica or its
  sandbox's network (a connection error, a timeout, a 5xx, its session gone or its version no longer served) comes
  back as EnvironmentUnavailable, the infrastructure's fault (the episode is played again); anything else it raises
  is its own (scored with spec.environment.errorReward).
- the trainer (rank 0, runner.py) opens the session with the episode's bounds before the agent runs
  (workers/inference/sessions.py enforces them: the agent cannot pass maxTurns, maxEpisodeTokens or grpo.maxNewTokens,
  and samples at the job's temperature), closes it after, and turns its record into the episode's tokens
  (`session_sample`): the session's last segment, exactly as the replica generated it, with the loss on the
  generated ids only.

Which segment trains: a session whose agent rewrote its history (edited or dropped earlier messages) holds several
segments, each a conversation of its own; the sample is the last one, which holds the final answer that spec.task's
reward scores (and which an agent's own reward judges). Earlier segments train on nothing and are counted
(`agent_segments_dropped` in metrics.jsonl).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpolora.workers.environments.base import EnvironmentFault, EnvironmentUnavailable, Message
from grpolora.workers.environments.episode import EpisodeTokens
from grpolora.workers.tasks.base import TaskError
from grpolora.workers.tasks.plugin import import_plugin_module

FIELD = "spec.environment.agent"
# What the agent meets on the replica that is not its own doing: its session gone (404: the replica restarted), its
# version no longer served (409), the server full (429), the token refused (401: a replica of another job at the
# address). 400 and 422 are the agent's (a request the session does not serve, or a call past its bounds).
_INFRASTRUCTURE_STATUSES = frozenset({401, 404, 408, 409, 429})


@dataclass(frozen=True)
class AgentCall:
    """What the trainer sends an environment process to play one episode's agent."""

    prompt: Any  # the task's Prompt
    base_url: str  # <replica>/sessions/<id>/v1
    api_key: str  # the job's token
    version: int  # the session's adapter version (the header repeats it on every call)
    timeout_seconds: float  # each model call at most (the whole run is bounded by the trainer)


class AgentPlayer:
    """One episode's agent in an environment process (what the factory of load_agent makes)."""

    def __init__(self, function: Callable[..., Any]):
        self.function = function

    def play(self, call: AgentCall) -> float | None:
        return asyncio.run(self._play(call))

    async def _play(self, call: AgentCall) -> float | None:
        import openai

        from grpolora.workers.inference.sessions import VERSION_HEADER

        client = openai.AsyncOpenAI(
            base_url=call.base_url, api_key=call.api_key, max_retries=0, timeout=call.timeout_seconds,
            default_headers={VERSION_HEADER: str(call.version)},
        )  # fmt: skip
        # No retries: a call whose answer was lost and asked again would no longer continue the session's ids.
        try:
            async with client:
                return await self.function(call.prompt, client)
        except Exception as exc:
            why = infrastructure_fault(exc)
            if why is not None:
                raise EnvironmentUnavailable(f"the agent's session failed on the replica: {why}") from None
            raise


def infrastructure_fault(exc: BaseException) -> str | None:
    """Why `exc` is the infrastructure's fault (the replica's or the network's, also where the agent wrapped it, as
    frameworks do), or None: the agent's own."""
    import httpx
    import openai

    seen: set[int] = set()
    pending = [exc]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, openai.APIConnectionError | httpx.TransportError):  # APITimeoutError is one
            return f"{type(error).__name__}: {error}"
        if isinstance(error, openai.APIStatusError) and (
            error.status_code >= 500 or error.status_code in _INFRASTRUCTURE_STATUSES
        ):
            return f"HTTP {error.status_code}: {error.response.text[:500]}"
        pending += [error.__cause__, error.__context__, *getattr(error, "exceptions", ())]
    return None


def load_agent(reference: str, root: Path | None = None) -> Callable[[], AgentPlayer]:
    """The factory of spec.environment.agent's players: its module imported (from sys.path or `root`, as plugins are)
    and its function checked to be a coroutine function; a TaskError naming the field otherwise."""
    module_name, _, attr = reference.partition(":")
    module = import_plugin_module(module_name, FIELD, root)
    function = getattr(module, attr, None)
    if not callable(function):
        raise TaskError(FIELD, f"{module_name!r} has no callable {attr!r} (async def {attr}(prompt, client))")
    if not inspect.iscoroutinefunction(function):
        raise TaskError(FIELD, f"{reference} is not an async function: write `async def {attr}(prompt, client)`, "
                        "which the trainer awaits with an openai.AsyncOpenAI client")  # fmt: skip
    # Imported now, in the process's start (START_SECONDS), not in an agent's bounded run.
    import openai  # noqa: F401

    import grpolora.workers.inference.sessions  # noqa: F401
    return lambda: AgentPlayer(function)


def checked_return(value: Any) -> float | None:
    """What the agent returned, as the episode's reward: a finite number, or None (spec.task's reward scores the last
    answer); an EnvironmentFault otherwise (the agent's fault)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise EnvironmentFault(f"the agent returned {value!r:.100}; expected a finite reward or None")
    return float(value)


@dataclass(frozen=True)
class SessionSample:
    """A closed session as an episode's sample: its last segment."""

    tokens: EpisodeTokens
    messages: list[Message]
    calls: int  # the segment's calls: the episode's assistant turns
    version: int
    text: str  # the last assistant message: what spec.task's reward scores
    truncated: bool  # a call cut at grpo.maxNewTokens, or one refused past maxTurns or maxEpisodeTokens
    dropped_segments: int


def session_sample(record: dict[str, Any]) -> SessionSample | None:
    """The sample of a session's record (GET or close of /sessions/<id>): its last segment's prompt ids, then every
    id after them with its behaviour logprob and mask (1 on generated ids only), as the replica recorded them; None
    where the agent made no call."""
    segments = record["segments"]
    if not segments:
        return None
    last = segments[-1]
    tokens = EpisodeTokens(list(last["prompt_token_ids"]), list(last["token_ids"]), list(last["logprobs"]),
                           list(last["mask"]), reference=None)  # fmt: skip
    if not len(tokens.tokens) == len(tokens.logprobs) == len(tokens.mask):
        raise EnvironmentUnavailable("the session's record is malformed: ids, logprobs and mask differ in length")
    messages = list(last["messages"])
    said = [m for m in messages if m.get("role") == "assistant"]
    return SessionSample(
        tokens=tokens,
        messages=messages,
        calls=int(last["calls"]),
        version=int(record["adapter_version"]),
        text=str(said[-1].get("content") or "") if said else "",
        truncated=record.get("refused") is not None or "length" in last.get("finish_reasons", []),
        dropped_segments=len(segments) - 1,
    )
