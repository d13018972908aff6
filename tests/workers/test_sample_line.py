"""The sample line in `grpolora run`'s terminal progress: every samplesEverySteps steps, one line with a sample
prompt -> completion and its reward and advantage, fitted to the terminal width with newlines escaped."""

from __future__ import annotations

import json

import pytest

from grpolora.api.status import TrainerStatus
from grpolora.workers.launcher.progress import Progress, sample_line

ROW = {
    "step": 10,
    "prompt": "What is 37 + 48?\nThink briefly, then answer.",
    "completion": "37 + 48 = 85.\nAnswer: 85",
    "reward": 1.1,
    "advantage": 0.8165,
}


def test_a_sample_line_escapes_newlines_and_shows_reward_and_advantage():
    line = sample_line(ROW, 200)
    assert line == (
        'step 10 sample: "What is 37 + 48?\\nThink briefly, then answer." -> "37 + 48 = 85.\\nAnswer: 85"'
        " (reward 1.100, adv +0.817)"
    )
    assert "\n" not in line


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_a_sample_line_fits_the_terminal_width(width):
    long = ROW | {"prompt": "p" * 300, "completion": "c\n" * 300, "advantage": -1.5}
    line = sample_line(long, width)
    assert len(line) <= width and "\n" not in line
    assert line.endswith("(reward 1.100, adv -1.500)") or width < 60  # the figures stay whole where they fit
    if width >= 80:  # room for some of both texts
        assert "p…" in line and "…" in line.split(" -> ")[1]  # both texts shortened, the completion gets more
        prompt_part, completion_part = line.split(" -> ")
        assert completion_part.count("c") > prompt_part.count("p") // 2


def test_the_progress_printer_shows_one_sample_line_per_sampled_step(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "90")
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps(ROW | {"step": 1, "completion": "left by an earlier run"}) + "\n")
    progress = Progress(4, enabled=True, samples=samples)  # not a terminal here: one line per step
    rows = [ROW | {"step": 2, "completion": f"completion {i}"} for i in range(3)]
    with samples.open("a") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)
        handle.write('{"step": 2, "prompt": "half a li')  # the trainer is still writing this line
    progress.update(TrainerStatus(phase="Running", step=2, total_steps=4))
    progress.update(TrainerStatus(phase="Running", step=2, total_steps=4))
    err = capsys.readouterr().err.splitlines()
    assert err == ["[Running] step 2/4", sample_line(rows[0], 90)]
    progress.close(TrainerStatus(phase="Succeeded", step=4, total_steps=4))
    assert "earlier run" not in capsys.readouterr().err


def test_the_progress_line_shows_the_policys_entropy(capsys):
    # The figure clip-higher exists to keep up: a user watching a run sees it collapse (or not) step by step, the
    # same number as metrics.jsonl's `entropy` (the trainer's /status carries the last step's).
    progress = Progress(4, enabled=True)
    progress.update(TrainerStatus(phase="Running", step=2, total_steps=4, reward_mean=0.5, kl=0.001, entropy=1.234))
    assert capsys.readouterr().err.splitlines() == ["[Running] step 2/4 reward 0.500 kl 0.0010 entropy 1.23"]


def test_an_episodes_sample_line_shows_its_turns():
    # spec.environment (issue 39): the completion is the last assistant message, and the line says after how
    # many turns (and whether the episode was cut off).
    line = sample_line({**ROW, "turns": 3, "truncated": False}, 200)
    assert line.endswith(" (reward 1.100, adv +0.817, 3 turns)")
    assert sample_line({**ROW, "turns": 4, "truncated": True}, 200).endswith(", 4 turns, truncated)")


def test_an_unscorable_samples_line_says_so():
    # A row whose reward is None (no reward applied; an episode the environment ended with an error) used to
    # raise in the format of its reward.
    assert sample_line({**ROW, "reward": None}, 200).endswith(" (reward none, adv +0.817)")
