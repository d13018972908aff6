"""An episode's tokens, token in and token out: the training sample is exactly the ids vLLM generated for each
assistant turn, with the environment's turns between them tokenised once each, never the transcript re-tokenised
(BPE merges across a turn boundary would change the ids, and the logprobs vLLM returned would no longer be those of
the sequence trained on). The loss mask is 1 on the assistant's tokens and 0 on the environment's and the template's.

The environment's turn is the chat template applied to the appended messages only, as a suffix: the template renders
a fixed short conversation (a user message, an assistant message) followed by the new messages and the generation
prompt, and the turn is what follows the assistant's content there. The conversation is never rendered again, so a
template that renders earlier turns differently once later ones follow (Qwen3 drops an earlier assistant turn's think
block) still continues what the model generated; TRL's tool loop takes the same suffix (trl
`GRPOTrainer._get_tool_suffix_ids`) but needs the template to be prefix-preserving, which this does not. What the
template puts after an assistant's content (`<|im_end|>\n` for ChatML, `<|eot_id|>` for Llama 3) and the model did
not generate itself (it stopped at a stop string, or at an end-of-turn id the closing does not start with) goes first
in that suffix, decided by token ids, never by text: a turn that ends with a plain `<` has not begun `<|im_end|>`.

At start, `ChatDelta.probe` renders a two-turn conversation and refuses (ChatTemplateError, exit 78) a template that
cannot be continued so; a template that takes no `tool` message (Gemma 3's alternates user and model only) gets the
environment's tool answers as user messages, as Gemma's function-calling guide has them sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpolora.workers.environments.base import EnvironmentFault, Message, Opening

# The contents of the fixed conversation every suffix is rendered after; they never reach a sample.
_MARK = "\u00b6"
_BASE: tuple[Message, ...] = ({"role": "user", "content": _MARK}, {"role": "assistant", "content": _MARK})
# A tool call id as strict templates want it (Mistral's: 9 alphanumerics), for the probe's tool message.
_PROBE_CALL_ID = "probe0001"
FIELD = "spec.task.chatTemplate"


class ChatTemplateError(ValueError):
    """A chat template that cannot continue a conversation turn by turn: a spec error (exit 78), found at start."""

    def __init__(self, message: str, field: str = FIELD):
        super().__init__(f"{field}: {message}")


class ChatDelta:
    """Renders and tokenises the parts of an episode with a chat template (`chat_template`: spec.task.chatTemplate's
    text; None, the tokenizer's own) and `template_args` (spec.task.chatTemplateArgs); `system_prompt`
    (spec.task.systemPrompt) opens an episode whose opening has no system message."""

    def __init__(
        self,
        tokenizer: Any,
        template_args: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
        chat_template: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.template_args = dict(template_args or {})
        self.system_prompt = system_prompt
        self.chat_template = chat_template
        self.tool_role = True
        """The template renders a `tool` message after an assistant's as it is sent (else: as a user message)."""
        self._closings: dict[str, list[int]] = {}

    def _render(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=generation,
            chat_template=self.chat_template, **self.template_args,
        )  # fmt: skip

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
        messages = [self._sendable(m) for m in messages]
        try:
            closing, after = self._closing_text(tools), self._after_assistant([*_BASE, *messages], tools)
        except EnvironmentFault:
            raise
        except Exception as exc:  # the template raised (jinja's TemplateError, or its own raise_exception)
            raise EnvironmentFault(f"the chat template cannot render the environment's messages: {exc}") from None
        if not after.startswith(closing):
            raise EnvironmentFault(
                "the chat template ends an assistant message differently once messages follow it "
                f"({closing!r} alone, {after[: len(closing) + 20]!r} followed)"
            )
        return self._unwritten(self._closing_ids(closing), generated) + self._ids(after[len(closing) :])

    def probe(self, where: str = "the model's chat template") -> None:
        """Refuse (ChatTemplateError) a template that cannot continue a conversation after an assistant's turn; learn
        whether it takes a `tool` message. `where` says which template (the model's own, or spec.task.chatTemplate)."""
        instead = (
            f"set {FIELD} to a template that renders each message once, in order (your own Jinja text, or a name the "
            "project ships: see docs/tasks.md)"
        )
        try:
            self.environment_turn([], [{"role": "user", "content": _MARK}])
        except Exception as exc:
            raise ChatTemplateError(f"{where} cannot continue a conversation after an assistant's turn "
                                    f"({_why(exc)}); {instead}") from None  # fmt: skip
        try:
            self.environment_turn([], [{"role": "tool", "content": _MARK}])
        except Exception:
            self.tool_role = False  # as Gemma 3: tool answers go as user messages
        native = {"role": "tool", "content": _MARK, "tool_call_id": _PROBE_CALL_ID, "name": "probe"}
        try:
            self.environment_turn([], [native])
        except Exception as exc:
            if self.tool_role:
                raise ChatTemplateError(f"{where} renders a tool message but not one answering a tool call "
                                        f"({_why(exc)}); {instead}") from None  # fmt: skip

    def _sendable(self, message: Message) -> Message:
        """`message` as the template can take it: a tool answer becomes a user message where the template has no
        `tool` role for a message without a call id."""
        if message["role"] == "tool" and not self.tool_role and "tool_call_id" not in message:
            return {"role": "user", "content": message["content"]}
        return message

    def _after_assistant(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None) -> str:
        """The text `messages` (the fixed user and assistant messages first) render to after the assistant's
        content, with the generation prompt."""
        full = self._render(messages, tools, generation=True)
        user = full.find(_MARK)
        assistant = full.find(_MARK, user + 1) if user >= 0 else -1
        if assistant < 0:
            raise EnvironmentFault("the chat template does not render an assistant message's content")
        return full[assistant + len(_MARK) :]

    def _closing_text(self, tools: list[dict[str, Any]] | None) -> str:
        """What the template puts after the content of an assistant message that ends the conversation."""
        base = self._render(_BASE, tools, generation=False)
        if base.count(_MARK) < 2:
            raise EnvironmentFault("the chat template does not render an assistant message's content")
        return base[base.rindex(_MARK) + len(_MARK) :]

    def closing_ids(self, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The ids the template puts after an assistant's content (`<|im_end|>`, `\\n` for ChatML)."""
        return self._closing_ids(self._closing_text(tools))

    def _closing_ids(self, closing: str) -> list[int]:
        if closing not in self._closings:
            self._closings[closing] = self._ids(closing)
        return self._closings[closing]

    @staticmethod
    def _unwritten(closing: Sequence[int], generated: Sequence[int]) -> list[int]:
        """The ids of the closing that the generated ids do not already end with: all of it, or what follows the
        longest start of it that the turn's last ids equal (the end-of-turn id the model stopped at)."""
        for size in range(min(len(closing), len(generated)), 0, -1):
            if list(generated[-size:]) == list(closing[:size]):
                return list(closing[size:])
        return list(closing)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


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
    """Why the environment failed the episode on infrastructure (unreachable, a dead process, a step past
    stepTimeoutSeconds; its reset failed), after spec.environment.episodeRetries more plays; the episode is then
    unscorable (out of its group's baseline, advantage 0)."""
    reward: float | None = None
    """The environment's return: its per-turn rewards (a step's reward is its turn's; errorReward a fault's), summed
    with spec.environment.discount; None where it gave none: spec.task's reward of the last assistant message."""
    truncated: bool = False
    """Cut off by maxTurns, maxEpisodeTokens or a turn's grpo.maxNewTokens (as grpo.maskTruncated treats it)."""
    environment_seconds: float = 0.0
    """Time spent in the environment's reset and steps."""
    tool_errors: int = 0
    """Calls answered with the tool's error: one the tool parser (spec.environment.toolParser) could not read, or
    an InvalidAction the environment raised."""
    fault: str | None = None
    """What the environment raised at the model's message (or answered malformed): the episode ended there with
    spec.environment.errorReward, and is scored (no refuge from a low reward)."""
    turn_rewards: list[float | None] | None = None
    """The reward the environment gave each assistant turn (None: none for that turn); None where it gave none."""
    segments: int | None = None
    """An agent's episode (spec.environment.agent): the segments of its session (the last is the sample; a rewritten
    history began the others, which train on nothing); None for an environment's episode."""
