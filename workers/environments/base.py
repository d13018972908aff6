"""What an environment is: it opens an episode from a task's prompt and answers each assistant message, until it
says the episode is done. Torch-free and tokenizer-free (the episode's tokens are episode.py's business).

The shape follows the common one of agent libraries (OpenEnv's reset/step; verifiers' MultiTurnEnv before 0.4:
setup state, then env_response per assistant turn with an is_completed check), so that one written for them is a
thin adapter:

    reset(prompt) -> Opening(messages, tools)        the conversation the model answers first, and tool specs
    step(message) -> Reply(messages, done, reward)   the messages to append, whether the episode ends, and its
                                                     reward (None: spec.task's reward of the last assistant message)

One environment object serves one episode (the factory makes a new one per episode), so it may keep state.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from grpolora.workers.tasks.base import Prompt

log = logging.getLogger(__name__)

Message = dict[str, Any]
"""A chat message as chat templates take it: {"role", "content"}; with spec.environment.toolParser an assistant
message may carry "tool_calls" (OpenAI's form: [{"id", "type": "function", "function": {"name", "arguments"}}],
arguments a JSON string), and a tool message answering one "tool_call_id" and "name"."""

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Opening:
    messages: list[Message]
    """The conversation the model answers first (ending with a user message)."""
    tools: list[dict[str, Any]] | None = None
    """Tool specs (JSON schema, as `apply_chat_template(tools=...)` takes them), rendered by the chat template."""


@dataclass(frozen=True)
class Reply:
    messages: list[Message] = field(default_factory=list)
    """Messages to append after the assistant's (a tool's result, a game's answer); none when the episode ends."""
    done: bool = False
    reward: float | None = None
    """The reward of the assistant turn this answers (any turn, the last included); the episode's return sums them
    (spec.environment.discount). An environment that gives none leaves the episode to spec.task's reward of the last
    assistant message."""


class Environment(Protocol):
    def reset(self, prompt: Prompt) -> Opening: ...

    def step(self, message: Message) -> Reply: ...


EnvironmentFactory = Callable[[], Environment]


class EnvironmentFault(Exception):
    """An environment that answered what it may not (or raised, or took too long): the episode ends with a counted
    error, not the run."""


class EnvironmentUnavailable(EnvironmentFault):
    """The environment could not be reached or is gone (a service refusing connections, answering 5xx or timing
    out past its retries; a dead environment process): an infrastructure fault, not the model's. The episode is
    played again on a fresh environment; a step whose every episode meets one waits for the environment
    (spec.environment.outageSeconds)."""


class InvalidAction(Exception):
    """Raised by an environment's step for an assistant message it cannot act on (a malformed call, an illegal move):
    the model's mistake. Its message goes back to the model as a tool message (`error: ...`) and the episode goes
    on; any other exception from step ends the episode with spec.environment.errorReward."""

    def reply(self) -> Reply:
        """The answer to the model's message: the tool's error (the same from the trainer and from service.py)."""
        return Reply([{"role": "tool", "content": f"error: {self}"}])


def checked_messages(value: Any, where: str) -> list[Message]:
    """`value` as a list of {"role", "content"} messages, or an EnvironmentFault saying what is wrong."""
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise EnvironmentFault(f"{where}: expected a list of messages, got {type(value).__name__}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise EnvironmentFault(f"{where}[{i}]: expected a message {{role, content}}, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise EnvironmentFault(f"{where}[{i}].role: {role!r}; valid: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise EnvironmentFault(f"{where}[{i}].content: expected a string, got {type(content).__name__}")
        checked: Message = {"role": role, "content": content}
        for key in ("tool_call_id", "name"):
            if key in message and message[key] is not None:
                if not isinstance(message[key], str):
                    raise EnvironmentFault(f"{where}[{i}].{key}: expected a string, got {message[key]!r:.100}")
                checked[key] = message[key]
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(call, Mapping) for call in calls):
                raise EnvironmentFault(f"{where}[{i}].tool_calls: expected a list of calls, got {calls!r:.100}")
            checked["tool_calls"] = [dict(call) for call in calls]
        messages.append(checked)
    return messages


def checked_opening(value: Any) -> Opening:
    """What reset returned, as an Opening (a bare list of messages is one without tools)."""
    if not isinstance(value, Opening):
        value = Opening(value)
    messages = checked_messages(value.messages, "reset().messages")
    if not messages:
        raise EnvironmentFault("reset().messages: empty; an episode opens with at least one message")
    if value.tools is not None and not (
        isinstance(value.tools, list) and all(isinstance(t, Mapping) for t in value.tools)
    ):
        raise EnvironmentFault(f"reset().tools: expected a list of tool specs (dicts), got {value.tools!r:.200}")
    return Opening(messages, value.tools)


def checked_reply(value: Any) -> Reply:
    """What step returned, as a Reply: a Reply, or a tuple (messages, done, reward)."""
    if isinstance(value, tuple) and len(value) == 3:
        value = Reply(*value)
    if not isinstance(value, Reply):
        raise EnvironmentFault(f"step(): expected a Reply or (messages, done, reward), got {type(value).__name__}")
    messages = checked_messages(value.messages, "step().messages")
    if not isinstance(value.done, bool):
        raise EnvironmentFault(f"step().done: expected a bool, got {value.done!r:.100}")
    reward = value.reward
    if reward is not None and (
        isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward))
    ):
        raise EnvironmentFault(f"step().reward: expected a finite float or None, got {reward!r:.100}")
    if not value.done and not messages:
        raise EnvironmentFault("step(): not done and no messages to append; the model would answer itself")
    return Reply(messages, value.done, None if reward is None else float(reward))


class EnvironmentRaised(Exception):
    """Environment code raised in an environment process (processes.py): its exception's type name and message (its
    own class may not unpickle in the trainer)."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(message)


def fault_reason(exc: BaseException) -> str:
    """Why an environment's call failed, as an episode's error says it."""
    if isinstance(exc, EnvironmentFault):
        return str(exc)
    kind = exc.kind if isinstance(exc, EnvironmentRaised) else type(exc).__name__
    return f"the environment raised {kind}: {exc}"[:2000]


def close_environment(env: Any) -> None:
    """The environment's own close(), where it has one (optional: it frees a sandbox, a service's episode); a
    failure is logged, not raised: the episode is over either way."""
    if callable(close := getattr(env, "close", None)):
        try:
            close()
        except Exception as exc:
            log.info("closing an episode's environment: %s", fault_reason(exc))
