"""The folder-to-package mapping in pyproject.toml lists every package, and the schema package is torch-free."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.helpers import ROOT


def test_every_python_package_folder_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = config["package-dir"]
    listed = set(config["packages"])
    found = set()
    for package, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *relative.parts]))
    assert found == listed, f"add to pyproject.toml: {sorted(found - listed)}; remove: {sorted(listed - found)}"


def test_schema_plan_and_builders_import_without_ml_or_kubernetes_libraries():
    code = (
        "import sys\n"
        "import grpolora.api.spec, grpolora.api.plan, grpolora.api.crd, grpolora.api.contract, grpolora.api.status\n"
        "import grpolora.operator.builders, grpolora.cli\n"
        "heavy = {'torch', 'vllm', 'ray', 'kopf', 'transformers', 'peft', 'kubernetes'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
