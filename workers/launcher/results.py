"""What a run leaves behind, read back: metrics.jsonl, the plot of it and the summary `grpolora run` ends with."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(records: Sequence[dict], out: Path) -> None:
    """reward, KL, the policy's entropy, sync time and the trainer-vs-vLLM logprob figures per step, one panel
    each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    figure, axes = plt.subplots(5, 1, figsize=(7, 12), sharex=True)
    series = (
        ("reward (mean ± std)", [r["reward_mean"] for r in records], [r["reward_std"] for r in records]),
        ("KL to reference (k3)", [r["kl"] for r in records], None),
        # NaN where a record has none (a run before the figure existed): a gap, not a zero.
        ("policy entropy (nats/token)", [r.get("entropy", math.nan) for r in records], None),
        ("adapter sync (ms)", [r["seconds"]["sync"] * 1000 for r in records], None),
    )
    # Trainer vs vLLM: numerics on on-policy steps, the policy's drift on off-policy ones (never one line).
    agreement = axes[4]
    for key, label, marker in (("mismatch", "mismatch (on-policy)", "o"), ("policy_drift", "policy drift", "x")):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            agreement.plot(*zip(*points, strict=True), marker=marker, linestyle="none", label=label)
    agreement.set_ylabel("trainer vs vLLM\nexp|Δlogp| - 1")
    if agreement.lines:
        agreement.set_yscale("symlog", linthresh=1e-6)  # an exact 0 stays on the plot
        agreement.legend(loc="best")
    agreement.grid(alpha=0.3)
    evaluated = [(r["step"], r["eval_reward"]) for r in records if "eval_reward" in r]
    if evaluated:
        axes[0].plot(*zip(*evaluated, strict=True), marker="s", color="tab:green", label="eval reward (held out)")
        axes[0].legend(loc="best")
    for axis, (label, values, spread) in zip(axes[:4], series, strict=True):
        axis.plot(steps, values, marker="o", markersize=3)
        if spread is not None:
            low = [v - s for v, s in zip(values, spread, strict=True)]
            high = [v + s for v, s in zip(values, spread, strict=True)]
            axis.fill_between(steps, low, high, alpha=0.2)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    figure.suptitle("grpo-lora run")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


def summarize(records: Sequence[dict], window: int = 5) -> str:
    if not records:
        return "no steps recorded"
    first = [r["reward_mean"] for r in records[:window]]
    last = [r["reward_mean"] for r in records[-window:]]
    # Numerics where the trainer's weights were the sampled version; the policy's drift apart (docs/status.md).
    mismatch = [r["mismatch"] for r in records if r.get("mismatch") is not None]
    drift = [r["policy_drift"] for r in records if r.get("policy_drift") is not None]
    agreement = (
        f"largest trainer-vs-vLLM mismatch {max(mismatch):.2e} over {len(mismatch)} on-policy steps"
        if mismatch
        else "no on-policy step to measure the trainer-vs-vLLM mismatch on"
    )
    if drift:
        agreement += f"; policy drift of {len(drift)} off-policy steps up to {max(drift):.2e}"
    return (
        f"mean reward, first {len(first)} steps: {sum(first) / len(first):.3f}; "
        f"last {len(last)} steps: {sum(last) / len(last):.3f}\n"
        f"sync rounds: {records[-1]['sync_round']}, median sync "
        f"{sorted(r['seconds']['sync'] for r in records)[len(records) // 2] * 1000:.0f} ms, {agreement}"
    )
