"""Fixtures shared by several test files under tests/workers/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from filelock import FileLock

from grpolora.testing.servers import free_port
from tests.workers.ranks import sharded_rank

DONE = "done"  # written once both ranks have left their files


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> Path:
    """The folder where two FSDP2 gloo ranks left what they saw (see tests/workers/ranks.py). `make test` runs these
    tests on two pytest-xdist workers, each a session of its own: the folder is made once, under the base folder the
    workers share, by whichever asks first (the other waits on the lock), so the ~30 s of the two ranks are paid
    once."""
    base = tmp_path_factory.getbasetemp()
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "two-ranks"
    with FileLock(f"{out}.lock"):
        if not (out / DONE).exists():
            out.mkdir(exist_ok=True)
            mp.start_processes(sharded_rank, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn")
            (out / DONE).touch()
    return out
