"""The rollout buffer between the generating replicas and the trainer (grpo.maxStaleness = k).

A producer thread on trainer rank 0 generates groups (a prompt and its completions) continuously on the live adapter
version and puts them here in prompt-stream order; the trainer takes one step's groups at a time. Three rules:

- Bounded: the producer may hold (buffered + in flight) only what the trainer's `allowance` says: k steps' groups
  while a step trains, k + 1 while the trainer waits, never more than the steps left need. A group reserved while
  the trainer is at version V is therefore trained at V + k at the latest (one sync per step).
- Fresh: `take` first drops every group whose version is more than k behind the trainer's (counted), then hands out
  the oldest remaining groups (stream order: whatever is left is within k by the rule above, and taking in order
  keeps the resume position exact). It waits for generation only when fewer than a step's groups are buffered.
- Exact accounting: `consumed()` is the stream position of the first prompt neither trained on nor dropped, the
  count a checkpoint records, so that a resumed run generates the buffered-but-untrained groups again.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from grpolora.workers.tasks import Prompt
from grpolora.workers.trainer.rollout import Completion


@dataclass(frozen=True)
class Group:
    position: int
    """The prompt's index in the run's prompt stream (numbers its sampling seed)."""
    prompt: Prompt
    prompt_ids: list[int]
    completions: list[Completion]
    seconds: float
    """Wall time of the generation round that produced it."""

    @property
    def version(self) -> int:
        """The adapter version that generated it (the oldest, should a retry have mixed versions)."""
        return min(c.version for c in self.completions)


class BufferClosed(Exception):
    """The buffer was closed: the producer stops."""


class RolloutBuffer:
    def __init__(self, staleness: int, next_position: int):
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.staleness = staleness
        self._groups: deque[Group] = deque()
        self._cond = threading.Condition()
        self._allowance = 0
        self._in_flight = 0  # groups reserved and not yet delivered
        self._in_flight_from: int | None = None  # stream position of the first prompt of the round in flight
        self._next_position = next_position  # where the producer draws next
        self._error: BaseException | None = None
        self._closed = False
        self.dropped = 0  # groups dropped as too stale, since the start

    # ---- producer side ---------------------------------------------------------------------------------------

    def reserve(self, most: int) -> tuple[int, int]:
        """Wait until the allowance leaves room, then reserve up to `most` groups; returns (count, the stream
        position to draw from). Raises BufferClosed once closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._room() > 0)
            if self._closed:
                raise BufferClosed
            count = min(most, self._room())
            self._in_flight += count
            self._in_flight_from = self._next_position
            return count, self._next_position

    def deliver(self, groups: list[Group], *, reserved: int, next_position: int) -> None:
        """The round reserved with `reserve` is done: its groups (fewer than reserved only if the stream ended)
        and the stream position after the last prompt drawn for it (skipped prompts included)."""
        with self._cond:
            self._groups.extend(sorted(groups, key=lambda g: g.position))
            self._in_flight -= reserved
            self._in_flight_from = None
            self._next_position = next_position
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The producer died: `take` raises this instead of waiting for ever."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    # ---- trainer side ----------------------------------------------------------------------------------------

    def allow(self, groups: int) -> None:
        """How many groups the producer may hold (buffered and in flight together)."""
        with self._cond:
            self._allowance = groups
            self._cond.notify_all()

    def take(self, count: int, version: int, *, then_allow: int) -> tuple[list[Group], int]:
        """The oldest `count` groups within `staleness` versions of `version` (the trainer's), after dropping the
        older ones; waits for generation only while fewer are buffered. Returns (groups, groups dropped now).

        `then_allow` becomes the allowance (see `allow`) in the same critical section: set after `take` returned,
        the producer could reserve on the allowance of the wait in between (at k = 0, a round generated during the
        step on the weights it is about to change)."""
        dropped = 0
        with self._cond:
            while True:
                # Every group is checked, not only the oldest: a retried share can come back on a newer version.
                stale = [g for g in self._groups if g.version < version - self.staleness]
                for group in stale:
                    self._groups.remove(group)
                dropped += len(stale)
                if dropped:
                    self._cond.notify_all()  # drops free room for the producer
                if len(self._groups) >= count:
                    taken = [self._groups.popleft() for _ in range(count)]
                    self.dropped += dropped
                    self._allowance = then_allow
                    self._cond.notify_all()
                    return taken, dropped
                if self._error is not None:
                    # The producer's own exception, so that its type still decides the exit (a TaskError from a
                    # bad dataset row fails the job at once; a RolloutError is retried by a restart).
                    raise self._error
                self._cond.wait()

    def consumed(self) -> int:
        """Stream position of the first prompt not yet trained on nor dropped (a checkpoint's prompts_consumed)."""
        with self._cond:
            if self._groups:
                return self._groups[0].position
            if self._in_flight_from is not None:
                return self._in_flight_from
            return self._next_position

    def held(self) -> int:
        with self._cond:
            return len(self._groups) + self._in_flight

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _room(self) -> int:
        return self._allowance - len(self._groups) - self._in_flight
