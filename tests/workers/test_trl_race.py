"""bench/trl_race.py's data: what the race trains on and holds out, and the order both sides read it in."""

from __future__ import annotations

import importlib.util
import json

from grpolora.workers.tasks.dataset import epoch_order
from tests.helpers import ROOT


def _race():
    spec = importlib.util.spec_from_file_location("trl_race", ROOT / "bench" / "trl_race.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _problems(path) -> set[str]:
    return {json.loads(line)["messages"][-1]["content"] for line in path.read_text().splitlines()}


def test_sums_held_out_problems_are_never_trained_on(tmp_path):
    # Issue 37: the held-out rows were drawn from the same 171 problems as the 2,000 training rows, so every
    # held-out problem had been trained on and the held-out reward measured memorisation as much as learning.
    race = _race()
    for seed in (0, 1):
        train, _ = race.race_prompts("sums", seed, tmp_path)
        held_out = race.task_spec("sums", seed, tmp_path, train)["dataset"]["eval"]["path"]
        trained, evaluated = _problems(train), _problems(tmp_path / held_out)
        assert len(evaluated) == race.HELD_OUT and not trained & evaluated
        assert len(trained) > 90  # most of the other 107 problems appear among 2,000 draws


def test_trl_reads_the_rows_in_the_order_grpolora_draws_them(tmp_path):
    # grpo-lora shuffles a dataset file by its seed (tasks/dataset.epoch_order); TRL is given that order with its
    # own shuffling off, so both sides' step k trains on the same prompts.
    race = _race()
    train, in_order = race.race_prompts("sums", 3, tmp_path)
    rows, ordered = train.read_text().splitlines(), in_order.read_text().splitlines()
    assert ordered == [rows[i] for i in epoch_order(3, 0, len(rows))]
