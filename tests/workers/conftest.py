"""Fixtures shared by several test files under tests/workers/."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.multiprocessing as mp

from grpolora.testing.servers import free_port
from tests.workers.ranks import sharded_rank


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> Path:
    """The folder where two FSDP2 gloo ranks left what they saw (see tests/workers/ranks.py)."""
    out = tmp_path_factory.mktemp("two-ranks")
    mp.start_processes(sharded_rank, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn")
    return out
