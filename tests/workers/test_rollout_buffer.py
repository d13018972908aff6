"""The rollout buffer of bounded-staleness GRPO: what the trainer takes, what it drops, how far the producer may run
ahead, and the resume position a checkpoint records. Real threads, no engines."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from grpolora.workers.tasks import Prompt
from grpolora.workers.trainer.buffer import BufferClosed, Group, RolloutBuffer
from grpolora.workers.trainer.rollout import Completion


def group(position: int, version: int) -> Group:
    completion = Completion(token_ids=[1], logprobs=[-0.1], text="x", finish_reason="stop", version=version)
    return Group(position, Prompt(text=f"p{position}"), [position], [completion, completion], seconds=0.1)


def test_take_drops_groups_more_than_k_versions_behind_and_keeps_stream_order():
    buffer = RolloutBuffer(staleness=2, next_position=0)
    buffer.allow(6)
    count, start = buffer.reserve(6)
    assert (count, start) == (6, 0)
    versions = [3, 3, 4, 5, 5, 6]  # positions 0..5
    buffer.deliver([group(p, v) for p, v in enumerate(versions)], reserved=6, next_position=6)
    # Trainer at version 6, k = 2: versions 4, 5, 6 are within k; the two groups of version 3 go.
    taken, dropped = buffer.take(2, version=6, then_allow=6)
    assert dropped == 2 and buffer.dropped == 2
    assert [(g.position, g.version) for g in taken] == [(2, 4), (3, 5)]
    # Resume position: the first group neither trained nor dropped.
    assert buffer.consumed() == 4
    taken, dropped = buffer.take(2, version=6, then_allow=6)
    assert dropped == 0 and [g.position for g in taken] == [4, 5]
    assert buffer.consumed() == 6


def test_a_stale_group_behind_a_fresh_one_is_dropped_too():
    buffer = RolloutBuffer(staleness=1, next_position=10)
    buffer.allow(3)
    buffer.reserve(3)
    buffer.deliver([group(10, 5), group(11, 3), group(12, 5)], reserved=3, next_position=13)
    taken, dropped = buffer.take(2, version=5, then_allow=3)
    assert dropped == 1 and [g.position for g in taken] == [10, 12]


def test_producer_cannot_run_past_its_allowance():
    buffer = RolloutBuffer(staleness=1, next_position=0)
    buffer.allow(4)
    assert buffer.reserve(8) == (4, 0)  # 4 groups of room, whatever the producer asks for
    reserved = threading.Event()

    def producer() -> None:
        buffer.reserve(4)
        reserved.set()

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    assert not reserved.wait(0.3), "reserved beyond the allowance"
    buffer.deliver([group(p, 0) for p in range(4)], reserved=4, next_position=4)
    assert not reserved.wait(0.2), "buffered groups count against the allowance too"
    buffer.take(2, version=0, then_allow=4)  # two groups leave: room for two
    assert reserved.wait(5)
    thread.join(5)
    assert buffer.held() == 4


def test_at_k0_the_producer_cannot_start_a_round_between_the_take_and_the_step():
    """k = 0: while the trainer waits it allows one step's groups, while it trains none. The allowance for the step
    is set inside take, with the groups: set after take returned, a producer waiting for room could reserve in
    between on the wait's allowance, and generate on the weights the step is about to change."""
    buffer = RolloutBuffer(staleness=0, next_position=0)
    buffer.allow(2)
    buffer.reserve(2)
    reserved = threading.Event()

    def producer() -> None:  # waits for room, as the producer thread does after delivering a round
        buffer.reserve(2)
        reserved.set()

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    buffer.deliver([group(0, 0), group(1, 0)], reserved=2, next_position=2)
    taken, _ = buffer.take(2, version=0, then_allow=0)
    assert [g.position for g in taken] == [0, 1]
    assert not reserved.wait(0.3), "the producer reserved between the take and the step"
    buffer.allow(2)  # the next wait
    assert reserved.wait(5)
    thread.join(5)


def test_take_waits_for_generation_only_when_the_buffer_is_short():
    buffer = RolloutBuffer(staleness=2, next_position=0)
    buffer.allow(4)
    buffer.reserve(2)
    buffer.deliver([group(0, 0), group(1, 0)], reserved=2, next_position=2)
    # Enough buffered: take returns without a delivery (no producer runs yet, so a wait would never end).
    with concurrent.futures.ThreadPoolExecutor(1) as threads:
        taken, _ = threads.submit(buffer.take, 2, version=0, then_allow=4).result(timeout=10)
    assert [g.position for g in taken] == [0, 1]

    def late_delivery() -> None:
        count, start = buffer.reserve(2)
        assert (count, start) == (2, 2)
        assert buffer.consumed() == 2  # in flight: not consumed
        time.sleep(0.3)
        buffer.deliver([group(2, 1), group(3, 1)], reserved=2, next_position=5)  # position 4 was skipped

    threading.Thread(target=late_delivery, daemon=True).start()
    started = time.perf_counter()
    taken, _ = buffer.take(2, version=1, then_allow=4)
    assert time.perf_counter() - started >= 0.25 and [g.position for g in taken] == [2, 3]
    assert buffer.consumed() == 5  # the skipped prompt counts as consumed


def test_a_failed_producer_fails_take_and_close_stops_the_producer():
    buffer = RolloutBuffer(staleness=1, next_position=0)
    buffer.fail(RuntimeError("every replica failed"))
    with pytest.raises(RuntimeError, match="every replica failed"):
        buffer.take(1, version=0, then_allow=1)
    buffer.close()
    with pytest.raises(BufferClosed):
        buffer.reserve(1)


def test_a_producer_error_reaches_the_trainer_as_itself():
    """A bad dataset row is found by the producer thread (it draws the prompts): the trainer must see the TaskError
    itself, which fails the job at once (EXIT_INVALID_DATA), not a RuntimeError the operator would restart."""
    from grpolora.workers.tasks.base import TaskError

    buffer = RolloutBuffer(staleness=1, next_position=0)
    buffer.fail(TaskError("spec.task.dataset", "train.jsonl line 7: missing field 'prompt'"))
    with pytest.raises(TaskError, match="line 7"):
        buffer.take(1, version=0, then_allow=1)
