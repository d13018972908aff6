"""Drawing a step's prompts from the task's stream: skipping what cannot fit, and a task that yields nothing usable
failing as bad data (EXIT_INVALID_DATA: the job fails at once) rather than as a crash the operator would restart."""

from __future__ import annotations

import pytest

from grpolora.workers.tasks import Prompt, TaskError
from grpolora.workers.trainer.producer import SKIPPED_IN_A_ROW_PER_PROMPT, draw_prompts


def prompts(*lengths: int):
    return iter([Prompt(text="x" * n, answer="1") for n in lengths])


def tokenize(prompt: Prompt) -> list[int]:
    return [1] * len(prompt.text)


def test_prompts_too_long_are_skipped_and_counted_and_positions_kept():
    drawn = draw_prompts(prompts(3, 50, 4, 5), tokenize, wanted=2, start=10, longest=8)
    assert [len(p.text) for p in drawn.prompts] == [3, 4]
    assert (drawn.drawn, drawn.skipped, drawn.positions) == (3, 1, [10, 12])


def test_a_stream_that_ends_short_returns_what_it_has():
    drawn = draw_prompts(prompts(3), tokenize, wanted=2, start=0, longest=None)
    assert len(drawn.prompts) == 1


def test_an_ended_stream_is_a_task_error():
    with pytest.raises(TaskError, match=r"^spec\.task: the prompt stream ended"):
        draw_prompts(prompts(), tokenize, wanted=2, start=0, longest=None)


def test_a_stream_where_nothing_fits_is_a_task_error():
    with pytest.raises(TaskError, match=r"^spec\.task: none of 200 prompts in a row fits in 8 tokens"):
        draw_prompts(prompts(*[9] * 1000), tokenize, wanted=2, start=0, longest=8)
    assert SKIPPED_IN_A_ROW_PER_PROMPT == 100
