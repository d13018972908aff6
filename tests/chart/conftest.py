from __future__ import annotations

from pathlib import Path

import pytest

from tests.chart.chart import Chart
from tests.chart.tools import helm_or_skip


@pytest.fixture(scope="session")
def helm() -> Path:
    return helm_or_skip()


@pytest.fixture(scope="session")
def chart(helm: Path) -> Chart:
    return Chart(helm)
