"""`grpolora run`'s progress on the terminal: a bar per job (a line per step where stderr is not a terminal), and a
line with the first sample of each step that logs samples."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpolora.api.status import TrainerStatus


def sample_line(row: Mapping[str, Any], width: int) -> str:
    """One line of `grpolora run`'s progress for a row of samples.jsonl, at most `width` columns:
    `step 10 sample: "<prompt>" -> "<completion>" (reward 1.100, adv +0.817)`, with an episode's turns (", 3
    turns") where the row is one (spec.environment). Newlines and other control characters
    are escaped; the completion gets at least two thirds of the room for the texts, and each text is shortened with
    `…` when it does not fit."""
    head = f"step {row['step']} sample: "
    turns = f", {row['turns']} turns{', truncated' if row.get('truncated') else ''}" if "turns" in row else ""
    reward = "none" if row["reward"] is None else f"{row['reward']:.3f}"
    tail = f" (reward {reward}, adv {row['advantage']:+.3f}{turns})"
    prompt, completion = _escape(row["prompt"]), _escape(row["completion"])
    room = width - len(head) - len(tail) - len('"" -> ""')
    prompt_room = min(len(prompt), max(room // 3, room - len(completion), 1))
    text = f'"{_shorten(prompt, prompt_room)}" -> "{_shorten(completion, room - prompt_room)}"'
    return _shorten(head + text + tail, width)


def _escape(text: str) -> str:
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _shorten(text: str, room: int) -> str:
    if len(text) <= room:
        return text
    return text[: room - 1] + "…" if room > 0 else ""


class SampleTail:
    """New rows of the run's samples.jsonl (those written after it was opened), read as the trainer appends them;
    a line still being written is read on a later call."""

    def __init__(self, path: Path):
        self._path = path
        self._offset = path.stat().st_size if path.exists() else 0

    def new_rows(self) -> list[dict[str, Any]]:
        try:
            with self._path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        rows = []
        for line in complete.splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
        return rows


class Progress:
    """A progress bar on a terminal; one line per step otherwise (CI logs, files). Each step with sample
    completions (tracking.samplesEverySteps) adds a line with its first sample (`sample_line`). With several jobs
    in a run, each has its own: `label` (the job's name) starts its lines, `position` is its bar's row."""

    def __init__(self, total: int, *, enabled: bool, samples: Path | None = None, label: str = "", position: int = 0):
        self._bar = None
        self._enabled = enabled
        self._prefix = f"{label}: " if label else ""
        self._last_line: tuple | None = None
        self._samples = SampleTail(samples) if enabled and samples is not None else None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=label or "GRPO", unit="step", dynamic_ncols=True, position=position, leave=True
            )

    def update(self, status: TrainerStatus, restarts: int = 0) -> None:
        self._update(status, restarts)
        self._show_samples()

    def _show_samples(self) -> None:
        if self._samples is None:
            return
        shown: set[int] = set()
        for row in self._samples.new_rows():
            if row.get("step") not in shown:  # the first sample of each step: its first prompt's first completion
                shown.add(row.get("step"))
                with contextlib.suppress(KeyError, TypeError, ValueError):  # a row not in the documented shape
                    width = shutil.get_terminal_size().columns - len(self._prefix)
                    self.note(self._prefix + sample_line(row, width))

    def _update(self, status: TrainerStatus, restarts: int) -> None:
        replicas = f"{len(status.sync_members)} replica(s) in sync"
        if self._bar is None:
            if self._enabled and (status.phase, status.step, restarts) != self._last_line:
                self._last_line = (status.phase, status.step, restarts)
                reward = "" if status.reward_mean is None else f" reward {status.reward_mean:.3f}"
                kl = "" if status.kl is None else f" kl {status.kl:.4f}"
                kl += "" if status.entropy is None else f" entropy {status.entropy:.2f}"
                sync = "" if status.last_sync_seconds is None else f" sync {status.last_sync_seconds * 1000:.0f} ms"
                lost = f" {replicas}, inference restarts {restarts}" if restarts else ""
                print(
                    f"{self._prefix}[{status.phase}] step {status.step}/{status.total_steps}{reward}{kl}{sync}{lost}",
                    file=sys.stderr,
                )
            return
        self._bar.n = status.step
        postfix = {"phase": status.phase}
        if status.reward_mean is not None:
            postfix |= {"reward": f"{status.reward_mean:.3f}", "kl": f"{status.kl or 0:.4f}"}
        if status.entropy is not None:
            postfix |= {"entropy": f"{status.entropy:.2f}"}
        if status.last_sync_seconds is not None:
            postfix |= {"sync": f"{status.last_sync_seconds * 1000:.0f}ms", "round": status.sync_round}
        if restarts:
            postfix |= {"in sync": len(status.sync_members), "restarts": restarts}
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.refresh()

    def note(self, message: str) -> None:
        """A line that stays above the bar (or in the log)."""
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)

    def close(self, status: TrainerStatus | None) -> None:
        self._show_samples()  # the last step's, written just before the trainer exits
        if self._bar is not None:
            if status is not None:
                self.update(status)
            self._bar.close()
            self._bar = None
