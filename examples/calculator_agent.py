"""An agent written on the `openai` package, trained as it is (spec.environment.agent: calculator_agent:solve;
examples/calculator-agent.yaml). It is an ordinary OpenAI tool loop: a calculator function offered as a tool and run
here when the model calls it, then a follow-up question, so that every conversation has more than one assistant turn
even when the model calls no tool. The trainer hands it an `openai.AsyncOpenAI` client bound to the episode's chat
session on a replica; what the model generated there, and only that, trains. Returning None leaves the reward to
spec.task's (arithmetic: the last answer's `Answer: N`)."""

from __future__ import annotations

import ast
import json
import operator

import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression of integers with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 12 * 7"}},
            "required": ["expression"],
        },
    },
}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
TOOL_ROUNDS = 2  # calculator calls answered before the follow-up


def calculate(expression: str) -> str:
    """The tool: integer arithmetic, never eval (the model's text is untrusted)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def answer_tool_calls(message) -> list[dict]:
    """The tool's answer to each call of an assistant message, as OpenAI's tool messages."""
    answers = []
    for call in message.tool_calls or []:
        try:
            expression = json.loads(call.function.arguments).get("expression", "")
        except (json.JSONDecodeError, AttributeError):
            expression = ""
        content = calculate(expression) if call.function.name == "calculate" else "error: unknown tool"
        answers.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": content})
    return answers


async def solve(prompt, client: openai.AsyncOpenAI) -> float | None:
    messages = [{"role": "user", "content": prompt.text}]
    for _ in range(TOOL_ROUNDS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # sent back as returned: the session continues it
        if not message.tool_calls:
            break
        messages += answer_tool_calls(message)
    messages.append({"role": "user", "content": "Check your result, then give it again as `Answer: <integer>`."})
    await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
    return None  # spec.task's reward scores the last answer
