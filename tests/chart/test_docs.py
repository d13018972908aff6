"""Docs that state facts the code owns (printer columns, the CRDs the chart installs, the inference pods' env, the
files the design names) agree with the code."""

from __future__ import annotations

import re
import subprocess
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
    lines = text[text.index(title) + len(title) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = lines[start : next(i for i, line in enumerate(lines) if i > start and not line.startswith("|"))]
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
def test_the_chart_speaks_of_its_crds_not_one(path):
    """The chart installs four CRDs (jobs, pools, both runtime kinds); text about "the CRD" leaves the others out."""
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


CONTRACT = ROOT / "docs" / "contract.md"
POD_KINDS = ("trainer pods", "a job's inference servers", "a RolloutPool's servers")


def documented_env() -> dict[str, dict[str, str]]:
    """docs/contract.md's table of which pods get which variable: {pod kind: {variable: cell}}."""
    text = CONTRACT.read_text()
    title = "| variable | " + " | ".join(POD_KINDS) + " |"
    rows = table_after(text, "## Which pods get which")
    assert title in text
    table: dict[str, dict[str, str]] = {kind: {} for kind in POD_KINDS}
    for variable, *cells in rows:
        for kind, cell in zip(POD_KINDS, cells, strict=True):
            table[kind][variable.strip("`")] = cell
    return table


def rendered_env(objects: list[dict[str, Any]]) -> dict[str, set[str]]:
    result = {}
    for obj in objects:
        if obj["kind"] in ("Job", "StatefulSet"):
            if obj["metadata"]["name"].endswith("-env"):
                continue  # the environment server's pods: no column here (contract.md's Endpoints table)
            (container,) = obj["spec"]["template"]["spec"]["containers"]
            kind = POD_KINDS[0] if obj["kind"] == "Job" else POD_KINDS[2 if "rollout-pool" in str(obj) else 1]
            result[kind] = {e["name"] for e in container["env"]}
    return result


def test_the_contract_says_which_variables_each_pod_gets():
    from grpolora.api import contract
    from grpolora.api.load import parse_job, parse_pool
    from grpolora.api.plan import plan, plan_pool
    from grpolora.api.pool import Attachments
    from grpolora.operator.builders import build_children, build_pool_children
    from tests.helpers import job_doc

    table = documented_env()
    for kind in POD_KINDS:
        assert sorted(table[kind]) == sorted(contract.ALL), kind

    def job_env(doc: dict[str, Any]) -> dict[str, set[str]]:
        return rendered_env(build_children(plan(parse_job(doc)), owner_uid="u", token="t"))

    plain = job_env(job_doc())
    hub_token = {"secretName": "hf", "key": "token"}
    conditional = job_env(
        job_doc(
            model={"name": "Qwen/Qwen3-0.6B", "tokenFrom": hub_token},
            task={
                "dataset": {"pvc": {"claimName": "prompts"}, "path": "train.parquet"},
                "reward": [{"url": "http://reward.rl.svc:8000/score", "headersFrom": {"secretName": "reward-auth"}}],
                "chatTemplateFrom": {"name": "templates", "key": "qwen3.jinja"},
            },
            environment={"builtin": "calculator", "server": {}},
        )
    )
    pool_doc = yaml.safe_load((ROOT / "examples" / "pool" / "qwen3-shared-pool.yaml").read_text())

    def pool_env(doc: dict[str, Any]) -> dict[str, set[str]]:
        pool = parse_pool(doc)
        return rendered_env(
            build_pool_children(plan_pool(pool), owner_uid="u", attachments=Attachments(pool="p", jobs=[]))
        )

    plain |= pool_env(pool_doc)
    pool_doc["spec"]["model"]["tokenFrom"] = hub_token
    conditional |= pool_env(pool_doc)
    assert sorted(plain) == sorted(conditional) == sorted(POD_KINDS)
    for kind in POD_KINDS:
        always = {v for v, cell in table[kind].items() if cell == "yes"}
        sometimes = {v for v, cell in table[kind].items() if cell.startswith(("with ", "when "))}
        assert plain[kind] == always, kind
        assert conditional[kind] == always | sometimes, kind


def test_the_design_notes_name_only_files_of_this_repository():
    """A reader of docs/design.md has this repository, nothing else: every file it names must be here (commands in
    backticks, whose file names are the reader's own, aside)."""
    text = re.sub(
        r"`([^`\n]*)`", lambda m: "" if " " in m[1] else f" {m[1]} ", (ROOT / "docs" / "design.md").read_text()
    )
    named = set(re.findall(r"[\w./-]+\.(?:md|py|yaml|yml|sh|toml)\b", text))
    assert len(named) > 10, "the pattern finds no file names any more"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in named:
        # A path from the root, or a bare file name that one tracked file ends with.
        assert name in tracked or any(path.endswith(f"/{name}") for path in tracked), name


# ---- the CRDs the chart ships, named in full wherever the docs list them ------------------------------------

INSTALL_DOCS = [
    ROOT / "README.md",
    CHART / "README.md",
    CHART / "values.yaml",
    CHART / "templates" / "NOTES.txt",
    ROOT / "docs" / "operator.md",
    ROOT / "docs" / "operations.md",
]
NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def shipped_crds(chart) -> dict[str, str]:
    """{kind: CRD name} of every CRD of ours the chart installs, as `helm template` renders them."""
    return {o["spec"]["names"]["kind"]: o["metadata"]["name"] for o in chart.render()
            if o["kind"] == "CustomResourceDefinition" and o["spec"]["group"] == "grpolora.dev"}  # fmt: skip


def commands(text: str) -> list[str]:
    """Shell commands of a text: the lines of code blocks (continuation lines joined) and inline `code` (which may
    wrap across lines of prose)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    inline = [re.sub(r"\s+", " ", code) for code in re.findall(r"`([^`]+)`", joined)]
    return [line for line in joined.splitlines() if "`" not in line] + inline


def test_the_chart_ships_every_crd_of_the_api(chart):
    from grpolora.api.crd import CRD_FILES

    assert sorted(shipped_crds(chart).values()) == sorted(name.removesuffix(".yaml") for name in CRD_FILES.values())


@pytest.mark.parametrize("path", INSTALL_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_crd_recipe_in_the_docs_names_every_crd_the_chart_ships(path, chart):
    """The adoption (label, annotate), apply and uninstall (delete) recipes: one left out fails its step, or leaves
    runtimes behind."""
    names = shipped_crds(chart).values()
    text = path.read_text()
    recipes = [c for c in commands(text) if re.search(r"kubectl (delete|label|annotate|get) crds?\b", c)
               and any(n in c for n in names)]  # fmt: skip
    for recipe in recipes:
        missing = [n for n in names if n not in recipe]
        assert missing == [], f"{path.name}: `{recipe.strip()}` leaves out {missing}"


@pytest.mark.parametrize("path", INSTALL_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_count_the_crds_the_chart_ships(path, chart):
    """ "The two CRDs, GRPOLoraJob and RolloutPool" was true once; a count or a list of our kinds before "CRD" must
    hold them all (the Kopf peering CRDs are counted apart)."""
    kinds = shipped_crds(chart)
    text = re.sub(r"\s+", " ", path.read_text())
    counts = re.findall(r"\b(one|two|three|four|five|six|both) (?!Kopf)(?:[\w-]+ )?CRDs\b", text)
    assert {c for c in counts if c != NUMBERS[len(kinds)]} == set(), path.name
    listed = re.findall(r"((?:GRPOLoraJob|RolloutPool|GRPOLoraRuntime|ClusterGRPOLoraRuntime)"
                        r"(?:(?:,| and| or|, and) (?:GRPOLoraJob|RolloutPool|GRPOLoraRuntime|ClusterGRPOLoraRuntime))*"
                        r")(?: custom resources)? CRDs?\b", text)  # fmt: skip
    for listing in listed:
        assert all(kind in listing for kind in kinds) or listing in kinds, f"{path.name}: `{listing} CRD`"


# ---- the startup deadline's default, said where users read it --------------------------------------------------


def test_the_operator_guide_states_the_startup_deadlines_default_and_how_to_turn_it_off():
    """The default lives in the spec (grpolora/api/spec.py SchedulingSpec); the guide says the same value and action,
    and that 0 turns it off."""
    from grpolora.api.spec import SchedulingSpec

    default = SchedulingSpec()
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "operator.md").read_text())
    section = text[text.index("## Partial admission and the startup deadline") :]
    section = section[: section.index(" ## ")]
    minutes = default.startup_deadline_seconds // 60
    assert f"by default {minutes} minutes (`startupDeadlineSeconds: {default.startup_deadline_seconds}`)" in section
    assert f"`onStartupDeadline: {default.on_startup_deadline}` by default" in section
    assert "`startupDeadlineSeconds: 0` turns it off" in section
    assert "waits for ever, as before" not in section
