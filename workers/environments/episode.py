"""An episode's tokens, token in and token out: the training sample is exactly the ids vLLM generated for each
assistant turn, with the environment's turns between them tokenised once each, never the transcript re-tokenised
(BPE merges across a turn boundary would change the ids, and the logprobs vLLM returned would no longer be those of
the sequence trained on). The loss mask is 1 on the assistant's tokens and 0 on the environment's and the template's.

The environment's turn is the chat template applied to the appended messages only, as a delta: the template's text
of a fixed short conversation plus the new messages (and the generation prompt), less the text of that conversation
alone. What the template puts after an assistant message (`<|im_end|>\\n` for ChatML) and the model did not
generate itself (it stopped at `<|im_end|>`, or at a stop string) goes first in that delta.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpolora.workers.environments.base import EnvironmentFault, Message, Opening

# A conversation that every delta is rendered after; its contents never reach a sample.
_MARK = "\u00b6"
_BASE: tuple[Message, ...] = ({"role": "user", "content": _MARK}, {"role": "assistant", "content": _MARK})


class ChatDelta:
    """Renders and tokenises the parts of an episode with a tokenizer's chat template and `template_args`
    (spec.task.chatTemplateArgs); `system_prompt` (spec.task.systemPrompt) opens an episode whose opening has
    no system message."""

    def __init__(
        self, tokenizer: Any, template_args: Mapping[str, Any] | None = None, system_prompt: str | None = None
    ):
        self.tokenizer = tokenizer
        self.template_args = dict(template_args or {})
        self.system_prompt = system_prompt

    def _render(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=generation, **self.template_args
        )

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def opening(self, opening: Opening) -> list[int]:
        """The opening conversation's ids, generation prompt included (the first request's prompt)."""
        messages = list(opening.messages)
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self._ids(self._render(messages, opening.tools, generation=True))

    def environment_turn(
        self, generated: Sequence[int], messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The ids that follow an assistant turn of `generated` ids: the end of the assistant's message the model
        did not generate, `messages` rendered, and the generation prompt of the next assistant turn."""
        base = self._render(_BASE, tools, generation=False)
        full = self._render([*_BASE, *messages], tools, generation=True)
        if not full.startswith(base):
            raise EnvironmentFault(
                "the chat template renders a conversation differently once messages follow it, so an environment's "
                "turn cannot be tokenised on its own (a template that rewrites earlier turns)"
            )
        closing = base[base.rindex(_MARK) + len(_MARK) :]  # what the template puts after an assistant's content
        return self._ids(self._unwritten(closing, generated) + full[len(base) :])

    def _unwritten(self, closing: str, generated: Sequence[int]) -> str:
        """The part of `closing` that the generated ids do not already end with (all of it, or none)."""
        tail = self.tokenizer.decode(list(generated[-8:]), skip_special_tokens=False)
        for size in range(len(closing), 0, -1):
            if tail.endswith(closing[:size]):
                return closing[size:]
        return closing


@dataclass
class EpisodeTokens:
    """A growing episode: the opening's ids, then every later id with its behaviour logprob (0 where the
    environment's), its loss mask, and its reference logprob where the replicas gave them."""

    opening: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    reference: list[float] | None = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.opening) + len(self.tokens)

    @property
    def ids(self) -> list[int]:
        """The whole episode so far: the next turn's prompt."""
        return self.opening + self.tokens

    def add_assistant(self, ids: Sequence[int], logprobs: Sequence[float], reference: Sequence[float] | None) -> None:
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} generated ids with {len(logprobs)} logprobs")
        self.tokens += ids
        self.logprobs += logprobs
        self.mask += [1] * len(ids)
        if reference is None or self.reference is None:
            self.reference = None
        else:
            self.reference += reference

    def add_environment(self, ids: Sequence[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        if self.reference is not None:
            self.reference += [0.0] * len(ids)


@dataclass(frozen=True)
class Episode:
    """A finished episode, as a rollout carries it beside its ids (rollout.Completion.episode)."""

    opening: list[int]
    """The opening's ids: the sample's prompt (its loss mask is 0)."""
    loss_mask: list[int]
    """One per id after the opening: 1 on the assistant's tokens, 0 on the environment's and the template's."""
    messages: list[Message]
    """The whole conversation, role-tagged, the opening's messages included (samples.jsonl)."""
    turns: int
    """Assistant turns generated."""
    tool_calls: int
    """Tool messages the environment answered with."""
    error: str | None = None
    """Why the environment ended the episode early (it raised, timed out or answered malformed data); the episode
    is then unscorable (out of its group's baseline, advantage 0)."""
    reward: float | None = None
    """The environment's reward; None: spec.task's reward of the last assistant message."""
    truncated: bool = False
    """Cut off by maxTurns, maxEpisodeTokens or a turn's grpo.maxNewTokens (as grpo.maskTruncated treats it)."""
    environment_seconds: float = 0.0
    """Time spent in the environment's reset and steps."""
