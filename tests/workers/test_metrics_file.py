"""metrics.jsonl: each step once across an interrupted and resumed run, and figures named for what they measure."""

from __future__ import annotations

import json

from grpolora.workers.launcher.results import plot, summarize
from grpolora.workers.tracking import drop_records_after
from grpolora.workers.trainer.step import StepStats, logprob_agreement


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


# --- what the trainer-vs-vLLM figures measure ------------------------------------------------------------------------


def step_record(step: int, on_policy: bool, figure: float) -> dict:
    zero = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0, "gen_kl": 0.0}
    stats = StepStats(**zero, tokens=10, mismatch=figure, mismatch_max=2 * figure)
    return {
        "step": step,
        "reward_mean": 0.5,
        "reward_std": 0.1,
        "kl": 0.0,
        "sync_round": step,
        "seconds": {"sync": 0.1},
        "on_policy": on_policy,
        **logprob_agreement(stats, on_policy),
    }


def test_an_off_policy_step_reports_the_policys_drift_not_a_numeric_mismatch():
    """At maxStaleness 2 the trainer compares its logprobs with those of a version two steps older: that is how
    far the policy moved (9.24e-02 in a float32 run), not a disagreement of kernels, and the summary called it
    the "largest trainer-vs-vLLM mismatch"."""
    records = [step_record(1, True, 1.1e-05), step_record(2, False, 9.24e-02), step_record(3, False, 4e-02)]
    assert records[0]["mismatch"] == 1.1e-05 and records[0]["policy_drift"] is None
    assert records[1]["mismatch"] is None and records[1]["policy_drift_max_abs"] == 2 * 9.24e-02
    summary = summarize(records)
    assert "largest trainer-vs-vLLM mismatch 1.10e-05 over 1 on-policy steps" in summary, summary
    assert "policy drift of 2 off-policy steps up to 9.24e-02" in summary, summary
    only_off = summarize(records[1:])
    assert "no on-policy step" in only_off and "9.24e-02" in only_off


def test_the_plot_shows_both_figures_apart(tmp_path):
    out = tmp_path / "plot.png"
    plot([step_record(1, True, 0.0), step_record(2, False, 9.24e-02)], out)
    assert out.stat().st_size > 0


def test_the_plot_has_a_panel_for_the_policys_entropy(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure plot() made, to read its panels
    records = [step_record(1, True, 0.0) | {"entropy": 2.5}, step_record(2, True, 0.0) | {"entropy": 2.1}]
    plot([*records, step_record(3, True, 0.0)], tmp_path / "plot.png")  # a record of an older run has none
    [figure] = figures
    [panel] = [axis for axis in figure.axes if axis.get_ylabel().startswith("policy entropy")]
    assert list(panel.lines[0].get_ydata()[:2]) == [2.5, 2.1]


# --- no NaN or Infinity in metrics.jsonl; TRL's figures on the trainer's gauges (issue 47) ----------------------------


def test_a_non_finite_figure_is_written_as_null_and_said(caplog):
    """json.dumps writes NaN and Infinity, which are not JSON: jq, pandas' strict readers and the /status contract
    refuse them. The math keeps its figures finite (log-ratios clamped, tests/workers/test_grpo_math.py); should one
    still be non-finite, metrics.jsonl gets null and the log names the figure."""
    from grpolora.workers.tracking import metrics_line

    line = metrics_line({"step": 3, "loss": float("nan"), "seconds": {"train": float("inf")}, "on_policy": True})
    assert json.loads(line) == {"step": 3, "loss": None, "seconds": {"train": None}, "on_policy": True}
    assert "NaN" not in line and "Infinity" not in line and line.endswith("\n")
    assert "loss" in caplog.text and "seconds/train" in caplog.text and "step 3" in caplog.text
    assert json.loads(metrics_line({"step": 1, "kl": 0.5})) == {"step": 1, "kl": 0.5}


def test_the_trainer_exports_trls_first_figures_as_gauges():
    from grpolora.workers.trainer import metrics

    metrics.set_step_figures(
        {"frac_reward_zero_std": 0.25, "completions": {"mean_length": 31.25, "clipped_ratio": 0.15625}}
    )
    value = metrics.REGISTRY.get_sample_value
    assert value("grpolora_trainer_frac_reward_zero_std") == 0.25
    assert value("grpolora_trainer_completion_length_mean") == 31.25
    assert value("grpolora_trainer_completions_clipped_ratio") == 0.15625
