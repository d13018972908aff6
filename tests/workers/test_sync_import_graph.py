"""The shape of the data plane's code, read from the source (no import runs): no import circle among the workers'
modules (function-level imports included), and the modules of a replica's two processes apart: the HTTP process's
end of the sync members (member_link) and vLLM's worker's end (member_host) share only their messages
(member_messages), the shared-memory payload format (payload) and the sync protocol; and no chain of module-level
imports loads one process's modules into the other."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = "grpolora.workers"
# What runs only in an inference server's HTTP process, and what only in vLLM's worker.
HTTP_PROCESS = {"app", "server", "tenants", "adapter_book", "vllm_engine", "member_link", "metrics", "sessions"}
WORKER_PROCESS = {"member_host"}
# Imported by both: the messages between them, the payload format, the headroom arithmetic (pure), vllm_worker (vLLM's
# worker extension, whose lora_request the HTTP process names adapters with) and vllm_plugin (every vLLM process).
BOTH_PROCESSES = {"", "member_messages", "payload", "gpu_headroom", "vllm_worker", "vllm_plugin"}


def modules() -> dict[str, Path]:
    """Every module of grpolora.workers (the folder workers/, as pyproject's package-dir maps it)."""
    found = {}
    for path in (ROOT / "workers").rglob("*.py"):
        parts = path.relative_to(ROOT / "workers").with_suffix("").parts
        found[".".join((PACKAGE, *parts)).removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: set[str], *, top_level: bool = False) -> set[str]:
    """The modules of `known` that the file imports, anywhere in it; with `top_level`, only those it imports when
    it is imported (its module-level statements)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body if top_level else ast.walk(tree):
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


def reached(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in edges[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_every_inference_module_is_placed_in_its_process_and_imports_none_of_the_other_at_load():
    """Each module of the inference server is classified (a new one must be), and importing one of a process's
    modules loads none of the other's, through any chain of module-level imports (a lazy import inside a function,
    as vllm_worker's of member_host in vLLM's worker, loads nothing until that function runs there)."""
    known = modules()
    inference = f"{PACKAGE}.inference"
    placed = {name.removeprefix(inference).removeprefix(".") for name in known if name.startswith(inference)}
    assert placed == HTTP_PROCESS | WORKER_PROCESS | BOTH_PROCESSES
    assert not (HTTP_PROCESS & WORKER_PROCESS or HTTP_PROCESS & BOTH_PROCESSES or WORKER_PROCESS & BOTH_PROCESSES)
    edges = {name: imports(path, set(known), top_level=True) - {name} for name, path in known.items()}
    for mine, theirs, what in ((HTTP_PROCESS, WORKER_PROCESS, "vLLM's worker"), (WORKER_PROCESS, HTTP_PROCESS, "HTTP")):
        for name in mine:
            wrong = {m for m in reached(edges, f"{inference}.{name}") if m.removeprefix(f"{inference}.") in theirs}
            assert not wrong, f"importing {name} loads {wrong}, the {what} process's"
    for name in BOTH_PROCESSES - {""}:  # what both import loads neither side's own modules
        own = HTTP_PROCESS | WORKER_PROCESS
        wrong = {m for m in reached(edges, f"{inference}.{name}") if m.removeprefix(f"{inference}.") in own}
        assert not wrong, f"importing {name} (both processes) loads {wrong}"
