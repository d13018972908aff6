"""metrics.jsonl across an interrupted and resumed run: each step once."""

from __future__ import annotations

import json

from grpolora.workers.trainer.controller import drop_records_after


def test_a_resumed_run_drops_the_records_of_steps_it_redoes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # Interrupted at step 3 with a checkpoint at step 2 (the last line was cut off mid-write).
    path.write_text(
        "".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "rew'
    )
    assert drop_records_after(path, 2) == 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert drop_records_after(path, 2) == 0  # nothing to drop: the file is left as it is
    assert drop_records_after(tmp_path / "missing.jsonl", 0) == 0
