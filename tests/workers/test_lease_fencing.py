"""Fencing of generation (issue 36, "A stale trainer cannot publish"): two incarnations of one job's trainer (a
restart whose old pod still runs, a zombie behind a partition) against one replica, with real senders over gloo,
the real inference API, adapter book and sync receiver, and the trainer's rollout client; vLLM is stood in for by
MarkingEngine, whose completions say whose weights made them.

A replica refuses the rollouts of an incarnation older than the newest it has seen, as it refuses its joins and
rounds, and never serves a version number under weights another incarnation published."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from grpolora.workers.inference.adapter_book import VersionUnavailable
from grpolora.workers.sync.control import HttpMember, StaleIncarnation
from grpolora.workers.trainer.rollout import RolloutClient, RolloutError, Sampling
from tests.workers.fakeengine import TOKEN, FakeServer, MarkingBook, marked
from tests.workers.syncfakes import gloo_sender

TIMEOUT = 5.0
SAMPLING = Sampling(n=1, temperature=1.0, top_p=1.0, max_tokens=1)
WAIT_SECONDS = 1.0  # the replica's version wait (adapterWaitSeconds)


class Trainer:
    """One trainer incarnation's rank 0: its sender (own store) and its rollout client."""

    def __init__(self, replica: FakeServer, incarnation: int) -> None:
        self.sender = gloo_sender(
            [HttpMember(0, replica.url, TOKEN)], token=TOKEN, timeout_seconds=TIMEOUT, incarnation=incarnation
        )
        self.rollouts = RolloutClient([replica.url], TOKEN, timeout_seconds=10, incarnation=incarnation)

    def generate(self, version: int) -> list[tuple[int, int]]:
        """(the version that served, the mark of the weights that did) of each completion."""
        groups = self.rollouts.generate([[1], [2]], SAMPLING, version=version, replicas=[0])
        return [(c.version, c.token_ids[0]) for group in groups for c in group]

    def close(self) -> None:
        self.sender.close()
        self.rollouts.close()


@pytest.fixture
def replica() -> Iterator[FakeServer]:
    with FakeServer(book=MarkingBook(), version_wait_seconds=WAIT_SECONDS) as served:
        yield served


@pytest.fixture
def trainers(replica):
    made: list[Trainer] = []

    def make(incarnation: int) -> Trainer:
        made.append(Trainer(replica, incarnation))
        return made[-1]

    yield make
    for trainer in made:
        trainer.close()


def test_a_stale_trainers_rollouts_are_refused_once_a_newer_one_joined(trainers):
    """The zombie could sample on and train on what it sampled; refused with the sync plane's StaleIncarnation, it
    stops as it would at its next round."""
    old = trainers(1)
    old.sender.form_group()
    old.sender.send(marked(11), {})
    assert old.generate(1) == [(1, 11), (1, 11)]
    new = trainers(2)
    new.sender.form_group()  # joins the replica: it follows incarnation 2 from now on
    for version in (1, 0):  # its own version, and the base model alike
        with pytest.raises(StaleIncarnation, match=r"trainer incarnation 1 refused.*follows incarnation 2"):
            old.generate(version)
    new.sender.send(marked(22), {})
    assert new.generate(2) == [(2, 22), (2, 22)]


def test_a_newer_trainer_is_not_served_another_incarnations_weights_under_its_version_number(trainers):
    """The replica holds version 1 of incarnation 1 live when incarnation 2 asks for its own version 1 (a restart
    numbering from a checkpoint, a replica it counted as caught up): same number, other weights. It waits for its
    version as for one not yet live, then is told it is unavailable, and is served once its own version is live."""
    old = trainers(1)
    old.sender.form_group()
    old.sender.send(marked(11), {})
    new = trainers(2)
    new.sender.form_group()
    with pytest.raises(RolloutError, match="409 adapter version 1 of trainer incarnation 2 is not live"):
        new.generate(1)
    assert new.generate(0) == [(0, 0), (0, 0)]  # the base model is every incarnation's
    new.sender.send(marked(22), {})
    assert new.generate(2) == [(2, 22), (2, 22)]


def test_a_client_that_is_no_trainer_is_served_the_live_version_whoever_published_it(trainers, replica):
    """`grpolora eval`, a benchmark, a user: no incarnation, no fencing (they publish nothing)."""
    old = trainers(1)
    old.sender.form_group()
    old.sender.send(marked(11), {})
    trainers(2).sender.form_group()
    anyone = RolloutClient([replica.url], TOKEN, timeout_seconds=10)
    served = anyone.generate([[1]], SAMPLING, version=1, replicas=[0])
    anyone.close()
    assert [(c.version, c.token_ids[0]) for c in served[0]] == [(1, 11)]


# ---- the book's rules, one by one ----------------------------------------------------------------------------


async def _book_with(*published: tuple[int, int]) -> MarkingBook:
    """A started book on which each (version, incarnation) of `published` went live in turn."""
    book = MarkingBook()
    await book.start()
    for version, incarnation in published:
        await _activate(book, version, incarnation)
    return book


async def _activate(book: MarkingBook, version: int, incarnation: int) -> None:
    """As a sync member does it (from its own thread) for a round of `incarnation`."""
    await asyncio.to_thread(book.activate, version, marked(version * 10), {}, incarnation=incarnation)


async def _leased(book: MarkingBook, version: int | None, incarnation: int | None, wait: float = 0.2) -> int:
    async with book.lease(version, wait, incarnation=incarnation) as leased:
        return leased


def test_the_book_fences_leases_by_incarnation():
    async def scenario() -> None:
        book = await _book_with((1, 3))
        book.follow(5)  # incarnation 5 joined
        with pytest.raises(StaleIncarnation, match=r"trainer incarnation 3 refused.*follows incarnation 5"):
            await _leased(book, 1, 3)
        with pytest.raises(VersionUnavailable, match="adapter version 1 of trainer incarnation 5 is not live"):
            await _leased(book, 1, 5)
        # The live version, asked for as "whatever is live", is not this trainer's either.
        with pytest.raises(VersionUnavailable, match="live version 1 was published by trainer incarnation 3"):
            await _leased(book, None, 5)
        assert await _leased(book, 0, 5) == 0
        assert await _leased(book, 1, None) == 1  # no trainer: not fenced

        # Waiting for its version 2, incarnation 5 is served it as soon as it is live.
        waiting = asyncio.ensure_future(_leased(book, 2, 5, wait=5))
        await asyncio.sleep(0)
        assert not waiting.done()
        await _activate(book, 2, 5)
        assert await waiting == 2
        assert await _leased(book, None, 5) == 2
        # Incarnation 3's version 1, still loaded, is not incarnation 5's version 1.
        with pytest.raises(VersionUnavailable, match="adapter version 1 of trainer incarnation 5 is no longer"):
            await _leased(book, 1, 5)

    asyncio.run(scenario())


def test_a_fenced_trainer_exits_79_and_leaves_the_new_trainers_status_json_alone(trainers, tmp_path, monkeypatch):
    """Walked as it happens: trainer incarnation 1 syncs, incarnation 2 takes over the replica, and incarnation 1's
    next round is refused (StaleIncarnation). The old trainer exits contract.EXIT_FENCED with the refusal as its
    termination message (what the operator reads), and does not write "Failed" into the job's output folder: on a
    shared volume that status.json is the live trainer's."""
    from grpolora.api import contract
    from grpolora.api.status import TrainerStatus
    from grpolora.workers.trainer import main
    from grpolora.workers.trainer.status_server import StatusBoard

    old, new = trainers(1), trainers(2)
    old.sender.send(marked(11), {})
    new.sender.send(marked(22), {})
    live = tmp_path / "status.json"
    live.write_text('{"phase": "Running", "step": 7}')  # the new trainer's
    with pytest.raises(StaleIncarnation) as refused:
        old.sender.send(marked(12), {})
    messages: list[str] = []
    monkeypatch.setattr(contract, "write_termination_message", messages.append)
    board = StatusBoard(TrainerStatus(phase="Running", total_steps=10))
    assert main._record_failure(board, tmp_path, refused.value) == contract.EXIT_FENCED == 79
    assert live.read_text() == '{"phase": "Running", "step": 7}'
    assert board.get().phase == "Failed" and messages and "incarnation" in messages[0]
    # Any other failure still leaves its record there (and exits 1: restarted).
    assert main._record_failure(board, tmp_path, RuntimeError("lost")) == 1
    assert '"phase": "Failed"' in live.read_text()
