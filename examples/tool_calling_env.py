"""A tool-calling environment for spec.environment.toolParser (docs/tasks.md, "Native tool calls"): the model gets
an `add` and a `multiply` tool through the chat template's own tool prompt, calls them in its model's format
(parsed by vLLM's tool parser), and reads each result as a `role: tool` message answering its call.

    environment:
      plugin: tool_calling_env:make
      toolParser: hermes          # Qwen2.5 / Qwen3 (llama3_json for Llama 3.x, mistral for Mistral)

Any function with a JSON-schema description can be a tool the same way; a call that names no tool, or whose
arguments are wrong, is answered with an error message (the model's mistake, which it may correct), not an
exception: an exception would end the episode."""

from __future__ import annotations

import json

from grpolora.workers.environments import Opening, Reply


def _tool(name: str, description: str) -> dict:
    number = {"type": "number"}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {"a": number, "b": number}, "required": ["a", "b"]},
        },
    }


TOOLS = [_tool("add", "a + b"), _tool("multiply", "a * b")]
FUNCTIONS = {"add": lambda a, b: a + b, "multiply": lambda a, b: a * b}


class ToolCallingEnvironment:
    def reset(self, prompt) -> Opening:
        return Opening([{"role": "user", "content": prompt.text}], tools=TOOLS)

    def step(self, message) -> Reply:
        calls = message.get("tool_calls") or []
        if not calls:  # no call: the final answer, scored by spec.task's reward
            return Reply(done=True)
        return Reply([self._answer(call) for call in calls])

    @staticmethod
    def _answer(call: dict) -> dict:
        name = call["function"]["name"]
        try:
            arguments = json.loads(call["function"]["arguments"])
            result = json.dumps(FUNCTIONS[name](float(arguments["a"]), float(arguments["b"])))
        except KeyError as exc:
            result = f"error: no tool or argument {exc}; tools: {', '.join(FUNCTIONS)}, arguments a and b"
        except (TypeError, ValueError) as exc:
            result = f"error: {exc}"
        return {"role": "tool", "content": result, "tool_call_id": call["id"], "name": name}


def make() -> ToolCallingEnvironment:
    return ToolCallingEnvironment()
