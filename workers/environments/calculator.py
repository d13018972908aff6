"""`calculator`: a tool for the arithmetic task. The model may write `<calc>12*7</calc>`; the environment answers
`<result>84</result>` as a tool message and the model goes on; a message without a call ends the episode, and
spec.task's reward (the arithmetic reward: the `Answer: N` line) scores that last message."""

from __future__ import annotations

import ast
import operator
import re

from grpolora.workers.environments.base import Message, Opening, Reply
from grpolora.workers.tasks.base import Prompt

INSTRUCTIONS = (
    "You have a calculator. To use it, write <calc>EXPRESSION</calc> (numbers, + - * / and parentheses) and stop; "
    "the result comes back as <result>VALUE</result>. When you know the answer, give it on its own line as "
    "`Answer: <integer>`."
)
# One worked episode before the prompt: without it SmolLM2-135M never calls the tool; with it about half of its
# samples do (8 samples at temperature 1), so groups differ and the habit can be learned.
EXAMPLE = (
    {"role": "user", "content": "What is 3 * 14?"},
    {"role": "assistant", "content": "<calc>3 * 14</calc>"},
    {"role": "tool", "content": "<result>42</result>"},
    {"role": "assistant", "content": "Answer: 42"},
)
# The closing tag may be missing: with `</calc>` as a stop string (grpo.stop), vLLM leaves it out of the text.
CALL = re.compile(r"<calc>(.*?)(?:</calc>|\Z)", re.DOTALL)
LONGEST_EXPRESSION = 200  # characters: arithmetic, not a program
LARGEST_EXPONENT = 64
# Bits of an integer operand or result at most (~155 digits). Bounding the exponent alone bounds nothing once
# powers nest: (((((9**64)**64)**64)**64)**64) is 31 characters and ~3.4 Gbit, hours in one C call.
LARGEST_BITS = 512

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); ValueError otherwise. Parsed,
    never evaluated as Python: a model's text is untrusted."""
    if len(expression) > LONGEST_EXPRESSION:
        raise ValueError(f"longer than {LONGEST_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression ({exc.msg})") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > LARGEST_EXPONENT:
                raise ValueError(f"exponent above {LARGEST_EXPONENT}")
            _refuse_large(node.op, left, right)
            try:
                return _bounded(_OPERATORS[type(node.op)](left, right))
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
            except OverflowError:
                raise ValueError("overflow: the result is too large") from None
        raise ValueError(f"{type(node).__name__} is not arithmetic")

    result = value(tree.body)
    return int(result) if isinstance(result, float) and result.is_integer() else result


def _bits(number: int | float) -> int:
    return abs(number).bit_length() if isinstance(number, int) else 0


def _refuse_large(op: ast.operator, left: int | float, right: int | float) -> None:
    """ValueError before an integer power or product whose result would pass LARGEST_BITS is computed (it would
    hold the GIL for as long as it takes)."""
    if isinstance(op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0:
        bits = (abs(left).bit_length() - 1) * right  # a lower bound of the result's bits, exact for powers of 2
        if bits > LARGEST_BITS:
            raise ValueError(f"too large: the result would have more than {LARGEST_BITS} bits")
    if isinstance(op, ast.Mult) and _bits(left) + _bits(right) > LARGEST_BITS + 1:
        raise ValueError(f"too large: the result would have more than {LARGEST_BITS} bits")


def _bounded(result: int | float) -> int | float:
    if _bits(result) > LARGEST_BITS:
        raise ValueError(f"too large: the result has more than {LARGEST_BITS} bits")
    return result


class CalculatorEnvironment:
    name = "calculator"

    def reset(self, prompt: Prompt) -> Opening:
        # The arithmetic task's question alone, in the example's words: its own instruction to answer at once
        # (`Answer: <integer>`) talks a small model out of the call (no call in 8 episodes of the example job).
        expression = prompt.meta.get("expression")
        question = f"What is {expression}?" if expression else prompt.text
        return Opening([{"role": "system", "content": INSTRUCTIONS}, *EXAMPLE, {"role": "user", "content": question}])

    def step(self, message: Message) -> Reply:
        call = CALL.search(message["content"])
        if call is None:  # the final answer
            return Reply(done=True)
        try:
            result = str(calculate(call.group(1)))
        except ValueError as exc:
            result = f"error: {exc}"  # the tool's answer (the model may try again), not an environment fault
        return Reply([{"role": "tool", "content": f"<result>{result}</result>"}])
