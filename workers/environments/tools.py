"""Native tool calls in episodes (spec.environment.toolParser): an assistant turn's text parsed into OpenAI-form
`tool_calls` by vLLM's own tool parser for the model's format (`hermes` for Qwen2.5/Qwen3, `llama3_json` for
Llama 3.x, `mistral`, ...; vllm/tool_parsers/), in the trainer's process, where the episode runner runs, and in
an inference server's, for its chat sessions (workers/inference/sessions.py). The environment gets the assistant
message with its calls and answers with `role: tool` messages; a call the parser could not read (the format's
opening marker is there, the JSON is not) is answered with a tool error, not sent to the environment: the model's
own mistake, which it may correct on its next turn.

The parser reads the generated ids decoded with special tokens kept (Mistral's `[TOOL_CALLS]` is one; vLLM's text
leaves specials out, so its server switches that off for tool calls as well: `ToolParser.adjust_request`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpolora.workers.environments.base import Message
from grpolora.workers.tasks.base import TaskError

FIELD = "spec.environment.toolParser"


class ToolCallParser:
    def __init__(self, name: str, tokenizer: Any):
        try:
            from vllm.tool_parsers import ToolParserManager
        except ImportError as exc:  # both worker images have vLLM; a bare trainer install may not
            raise TaskError(FIELD, f"vLLM's tool parsers are not importable here ({exc})") from None
        valid = ToolParserManager.list_registered()
        if name not in valid:
            raise TaskError(FIELD, f"unknown tool parser {name!r}; vLLM's: {', '.join(valid)}")
        self.name = name
        self.tokenizer = tokenizer
        self._class = ToolParserManager.get_tool_parser(name)
        try:
            parser = self._class(tokenizer)
        except Exception as exc:  # e.g. `mistral` on a tokenizer without [TOOL_CALLS]
            raise TaskError(FIELD, f"vLLM's {name!r} parser does not work with this model's tokenizer: {exc}") from None
        marker = getattr(parser, "tool_call_start_token", None) or getattr(parser, "bot_token", None)
        self.marker: str | None = marker if isinstance(marker, str) and marker else None
        """What opens a call in this format (`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`), where it has one."""

    def message(
        self, generated: Sequence[int], text: str, tools: list[dict[str, Any]] | None, closing: Sequence[int] = ()
    ) -> tuple[Message, str | None]:
        """The assistant message of a turn of `generated` ids (vLLM's `text` of them): with `tool_calls` where the
        parser found calls; and the tool error to answer with where it found the format's marker and no call."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        ids = list(generated)
        while ids and (ids[-1] in closing[:1] or ids[-1] == self.tokenizer.eos_token_id):
            ids.pop()  # the end-of-turn id is no part of the call
        raw = self.tokenizer.decode(ids, skip_special_tokens=False)
        request = ChatCompletionRequest(messages=[], model="episode", tools=tools or None)
        parsed = self._class(self.tokenizer).extract_tool_calls(raw, request)  # a parser keeps streaming state
        if not parsed.tools_called or not parsed.tool_calls:
            if self.marker is not None and self.marker in raw:
                return {"role": "assistant", "content": text}, (
                    f"error: the tool call could not be read ({self.name} format: {self.marker} then JSON with "
                    '"name" and "arguments")'
                )
            return {"role": "assistant", "content": text}, None
        calls = [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}
            for call in parsed.tool_calls
        ]  # fmt: skip
        return {"role": "assistant", "content": parsed.content or "", "tool_calls": calls}, None
