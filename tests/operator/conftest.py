from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from grpolora.operator import rbac
from grpolora.testing.kube_emulator import Cluster, running_cluster
from tests.operator.harness import FakeTrainer, OperatorThread, fake_trainer, operator_options
from tests.operator.job_controller_double import JobController
from tests.operator.kueue_double import FakeKueue


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with running_cluster() as running:
        yield running
        # Every call the operator made in this test must be allowed by the RBAC rules the chart ships.
        denied = sorted(call for call in running.emulator.calls if not rbac.allowed(*call))
        assert not denied, f"calls that grpolora.operator.rbac.RULES does not allow (verb, group, resource): {denied}"


@pytest.fixture
async def trainer() -> AsyncIterator[FakeTrainer]:
    async with fake_trainer() as fake:
        yield fake


@pytest.fixture
async def operator(cluster: Cluster, trainer: FakeTrainer) -> AsyncIterator[OperatorThread]:
    running = await OperatorThread(cluster.url, operator_options()).start()
    yield running
    await running.stop()


@pytest.fixture
async def kueue(cluster: Cluster) -> AsyncIterator[FakeKueue]:
    """Kueue with the test as its scheduler: it admits and evicts when told (tests/operator/kueue_double.py)."""
    async with FakeKueue(cluster) as fake:
        yield fake


@pytest.fixture
async def jobs(cluster: Cluster) -> AsyncIterator[JobController]:
    """The batch/v1 Job controller, played (tests/operator/job_controller_double.py)."""
    async with JobController(cluster) as controller:
        yield controller
