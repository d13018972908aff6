"""The progress watchdog of a sync round, on the sender and on each receiver.

A collective blocks until it completes or its timeout (`sync.timeoutSeconds`, 600 s by default) passes: a receiver
that hangs (a stuck NCCL peer, a node gone without closing its sockets) held the sender, and with it the trainer,
for that long. The watchdog cuts a round that stopped moving: when no piece of it has completed for
`sync.progressTimeoutSeconds`, it closes the round's transport (NCCL: abort; gloo's collectives also carry that
timeout each, see gloo.py), so the collective waited on fails at once and the round is abandoned. NeMo-RL guards
its refit step the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

from grpolora.workers.sync.transport import TransportError


class Watchdog:
    """Calls `on_stall` once, from a thread of its own, if `progress` was not called for `seconds` (None: never)."""

    def __init__(self, seconds: float | None, on_stall: Callable[[], None], *, what: str = "round"):
        self.seconds = seconds
        self.what = what
        self.stalled = False
        self._on_stall = on_stall
        self._last = time.monotonic()
        self._window = seconds  # until the next progress: `seconds`, or a longer one given for one piece
        self._done = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        if seconds is not None:
            self._thread = threading.Thread(target=self._watch, name="sync-watchdog", daemon=True)
            self._thread.start()

    def progress(self, within: float | None = None) -> None:
        """A piece completed: the round moves. `within`: the next piece may take this long (if longer than the
        watchdog's own bound), as the closing status, which waits for every replica's activation."""
        with self._changed:
            self._last = time.monotonic()
            if self.seconds is not None:
                self._window = max(self.seconds, within or 0.0)
                self._changed.notify_all()

    def _watch(self) -> None:
        assert self.seconds is not None
        with self._changed:
            while not self._done:
                left = self._last + self._window - time.monotonic()
                if left <= 0:
                    self.stalled = True
                    break
                self._changed.wait(left)
        if self.stalled:
            self._on_stall()

    def stop(self) -> None:
        with self._changed:
            self._done = True
            self._changed.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def explain(self, error: TransportError) -> TransportError:
        """`error` as raised by a collective the watchdog cut (its own message otherwise)."""
        if not self.stalled:
            return error
        return TransportError(f"no progress in the {self.what} for {self._window:g}s; abandoned ({error})")

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
