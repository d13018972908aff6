"""Docs that state facts the code owns (printer columns, the CRDs the chart installs, the inference pods' env, the
files the design names) agree with the code."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.chart.chart import CHART
from tests.helpers import ROOT

OPERATIONS = ROOT / "docs" / "operations.md"
CRDS = {
    "glj": ROOT / "crds" / "grpolorajobs.grpolora.dev.yaml",
    "rpool": ROOT / "crds" / "rolloutpools.grpolora.dev.yaml",
}
TABLE_TITLES = {"glj": "GRPOLoraJob (`glj`):", "rpool": "RolloutPool (`rpool`):"}


def printer_columns(short_name: str) -> list[dict[str, Any]]:
    crd = yaml.safe_load(CRDS[short_name].read_text())
    assert short_name in crd["spec"]["names"]["shortNames"]
    (version,) = crd["spec"]["versions"]
    return version["additionalPrinterColumns"]


def table_after(text: str, title: str) -> list[list[str]]:
    """The body rows of the first Markdown table after `title`, as cells."""
    lines = text[text.index(title) + len(title) :].lstrip("\n").splitlines()
    table = [line for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("|"))]]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in table[2:]]


@pytest.mark.parametrize("short_name", list(CRDS))
def test_operations_guide_lists_the_printer_columns_of_the_crd(short_name):
    rows = table_after(OPERATIONS.read_text(), TABLE_TITLES[short_name])
    assert rows == [
        [col["name"], "yes" if col.get("priority", 0) else "", f"`{col['jsonPath']}`", col["description"]]
        for col in printer_columns(short_name)
    ]


def test_every_kubectl_get_header_in_the_operations_guide_is_what_kubectl_prints():
    headers = re.findall(r"kubectl get (glj|rpool)\b([^#\n]*)#\s*(NAME\b[^\n]*)", OPERATIONS.read_text())
    assert {short for short, _, _ in headers} == set(CRDS)
    for short_name, command, header in headers:
        wide = "-o wide" in command
        columns = [c["name"].upper() for c in printer_columns(short_name) if wide or not c.get("priority", 0)]
        assert header.split() == ["NAME", *columns], f"kubectl get {short_name}{command}"


@pytest.mark.parametrize(
    "path", [CHART / "values.yaml", CHART / "README.md", CHART / "templates" / "NOTES.txt"], ids=lambda p: p.name
)
def test_the_chart_speaks_of_its_two_crds_not_one(path):
    """The chart installs the GRPOLoraJob and the RolloutPool CRDs; text about "the CRD" leaves the second out."""
    singular = re.findall(r".{0,40}\b(?:[Tt]he|GRPOLoraJob|same) CRD\b.{0,40}", path.read_text())
    assert singular == []


def test_the_chart_readme_quick_start_warns_that_the_images_may_not_be_published():
    """As the main README does: the default images exist only once a release tag has run; before, the install
    pulls nothing (ImagePullBackOff) unless the user builds and pushes their own and points the chart at them."""
    readme = (CHART / "README.md").read_text()
    quick_start = readme[: readme.index("\n## ")]
    assert "nobody has published" in quick_start and "ImagePullBackOff" in quick_start
    assert quick_start.index("docker build --target operator") < quick_start.index("helm install")
    assert "--set image.repository=" in quick_start
    # Once published, the chart itself is beside the images (.github/workflows/release.yaml).
    registry = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yaml").read_text())["env"]["REGISTRY"]
    assert f"oci://{registry}/charts/grpo-lora-operator --version" in quick_start
