"""`make test` runs the tests without the `vllm` mark on two pytest-xdist workers at once and the marked ones one
at a time (Makefile). A test that starts vLLM engines or a `grpolora run` and is not marked would run beside other
tests: it wants both cores, and the end-to-end ones find their workers by job name among the machine's processes."""

from __future__ import annotations

import re

from tests.helpers import ROOT

# What starts engines or end-to-end runs in a test file.
STARTS_ENGINES = re.compile(
    r"ServerProcess\(|VllmEngine\(|\"grpolora\.cli\", \"(run|eval)\"|main\(\[\"run\"|grpolora_run\("
)
MARKED = re.compile(r"pytestmark = pytest\.mark\.vllm|@pytest\.mark\.vllm|^VLLM = pytest\.mark\.vllm", re.MULTILINE)


def test_every_file_that_starts_engines_or_runs_is_marked_vllm():
    texts = {path: path.read_text(encoding="utf-8") for path in sorted((ROOT / "tests").rglob("test_*.py"))}
    unmarked = [
        str(path.relative_to(ROOT))
        for path, text in texts.items()
        if STARTS_ENGINES.search(text) and not MARKED.search(text)
    ]
    assert not unmarked, f"mark the tests that start engines or runs with pytest.mark.vllm: {unmarked}"


def test_the_makefile_runs_the_unmarked_tests_on_workers_and_the_marked_ones_alone():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert '-m "not vllm" -n 2' in makefile and "-m vllm ||" in makefile
