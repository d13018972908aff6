"""`arithmetic`: two-operand integer sums, differences and products, generated in code (offline, endless).

Reward = 1.0 if the final number equals the exact answer, plus 0.1 if the completion also follows the requested
format, a line `Answer: <integer>`. The final number is the one on the last `Answer:` line, or else the last
integer in the text; so the possible rewards are 0, 0.1 (format but wrong), 1.0 (right but unformatted) and 1.1.
The format bonus is small so that it shapes early training without ever outweighing correctness.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from grpolora.workers.tasks.base import Prompt, Task

CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.1
INSTRUCTION = "Think briefly, then give the final answer on its own line as `Answer: <integer>`."

_ANSWER_LINE = re.compile(r"^\s*\**Answer:\**\s*(-?\d[\d,]*)\s*\.?\s*$", re.IGNORECASE | re.MULTILINE)
_INTEGER = re.compile(r"-?\d[\d,]*")


def make_problem(rng: random.Random) -> tuple[str, int]:
    """One problem as (expression, value): a + b and a - b with two-digit operands (never negative), or a * b
    with one factor from 2 to 12."""
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 12), rng.randint(10, 99)
        return f"{a} * {b}", a * b
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if op == "-":
        a, b = max(a, b), min(a, b)
        return f"{a} - {b}", a - b
    return f"{a} + {b}", a + b


def _to_int(text: str) -> int | None:
    digits = text.replace(",", "")
    return int(digits) if re.fullmatch(r"-?\d+", digits) else None


def arithmetic_reward(completion: str, answer: str) -> float:
    """CORRECT_REWARD if the final number equals `answer`, plus FORMAT_REWARD for an `Answer: <integer>` line."""
    lines = _ANSWER_LINE.findall(completion)
    if lines:
        final, bonus = _to_int(lines[-1]), FORMAT_REWARD
    else:
        numbers = _INTEGER.findall(completion)
        final, bonus = (_to_int(numbers[-1]) if numbers else None), 0.0
    correct = final is not None and final == int(answer)
    return (CORRECT_REWARD if correct else 0.0) + bonus


class ArithmeticTask(Task):
    name = "arithmetic"

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(f"arithmetic:{seed}")
        while True:
            expression, value = make_problem(rng)
            yield Prompt(
                text=f"What is {expression}? {INSTRUCTION}", answer=str(value), meta={"expression": expression}
            )

    def reward(self, prompt: Prompt, completion: str) -> float:
        assert prompt.answer is not None, "arithmetic prompts always carry their answer"
        return arithmetic_reward(completion, prompt.answer)
