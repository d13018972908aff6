"""The shape of the data plane's code, read from the source (no import runs): no import circle among the workers'
modules (function-level imports included), and the modules of a replica's two processes apart: the HTTP process's
end of the sync members (member_link) and vLLM's worker's end (member_host) share only their messages
(member_messages), the shared-memory payload format (payload) and the sync protocol."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = "grpolora.workers"
# What runs only in an inference server's HTTP process, and what only in vLLM's worker.
HTTP_PROCESS = {"app", "server", "tenants", "adapter_book", "vllm_engine", "member_link", "metrics"}
WORKER_PROCESS = {"member_host"}


def modules() -> dict[str, Path]:
    """Every module of grpolora.workers (the folder workers/, as pyproject's package-dir maps it)."""
    found = {}
    for path in (ROOT / "workers").rglob("*.py"):
        parts = path.relative_to(ROOT / "workers").with_suffix("").parts
        found[".".join((PACKAGE, *parts)).removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that the file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, set(known)) - {name} for name, path in known.items()}


def cycle_from(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle, if there is any (depth-first search)."""
    state: dict[str, str] = {}
    trail: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], trail[len(trail) :] = "open", [node]
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                return [*trail[trail.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = "done"
        trail.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_workers_modules_import_no_circle():
    assert cycle_from(graph()) is None, " -> ".join(cycle_from(graph()) or [])


def test_the_checker_finds_a_circle():
    assert cycle_from({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_from({"a": {"b"}, "b": set()}) is None


def test_a_replicas_two_processes_import_nothing_of_each_other():
    edges = graph()
    inference = f"{PACKAGE}.inference"
    for name in WORKER_PROCESS:
        wrong = {m for m in edges[f"{inference}.{name}"] if m.removeprefix(f"{inference}.") in HTTP_PROCESS}
        assert not wrong, f"{name} (vLLM's worker) imports {wrong} (the HTTP process's)"
    for name in HTTP_PROCESS:
        wrong = {m for m in edges[f"{inference}.{name}"] if m.removeprefix(f"{inference}.") in WORKER_PROCESS}
        assert not wrong, f"{name} (the HTTP process) imports {wrong} (vLLM's worker's)"
