"""Example reward plugins for a dataset task (docs/tasks.md). Reference one from a job as
`reward: examples.rewards:contains_answer` (run from the repository root) or install the module in the image.

The contract: function(prompt: str, completion: str, answer: str | None) -> float, called positionally with the
user prompt (no chat template), the generated text only, and the line's answer (None if the line has none).
"""

from __future__ import annotations

import re


def contains_answer(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 if the reference answer appears in the completion as a whole word (case-insensitive), else 0.0."""
    if not answer:
        return 0.0
    return 1.0 if re.search(rf"\b{re.escape(answer)}\b", completion, re.IGNORECASE) else 0.0


def short_and_correct(prompt: str, completion: str, answer: str | None) -> float:
    """contains_answer, with 0.2 taken off for answers longer than 20 words: an example of a shaped reward."""
    words = len(completion.split())
    return contains_answer(prompt, completion, answer) - (0.2 if words > 20 else 0.0)
