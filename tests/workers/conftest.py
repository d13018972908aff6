"""Fixtures shared by several test files under tests/workers/."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.multiprocessing as mp

from grpolora.testing.servers import free_port
from tests.workers.ranks import sharded_rank


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test` runs the tests without engines on two pytest-xdist workers, where a session fixture is made once
    per worker: the tests that read the two ranks' folder go to one worker (`--dist loadgroup`), so that the ~30 s
    of their two spawned ranks are paid once."""
    for item in items:
        if "two_ranks" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("two-ranks"))


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> Path:
    """The folder where two FSDP2 gloo ranks left what they saw (see tests/workers/ranks.py)."""
    out = tmp_path_factory.mktemp("two-ranks")
    mp.start_processes(sharded_rank, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn")
    return out
