"""Extract grpolora/api/kubeschema.json from kubernetes-validate's Kubernetes 1.33 schemas (strict variant).

The job spec passes some Kubernetes core types through to the pods (resources, tolerations, affinity, env,
metricsFrom). grpolora.api.kubetypes validates them against these schemas without depending on
kubernetes-validate at run time; tests/unit/test_kubetypes.py keeps the file equal to a fresh extraction.
Regenerate with: PYTHONSAFEPATH=1 .venv/bin/python tests/kube_schema.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate

from grpolora.api.kubetypes import KUBERNETES_VERSION, ROOT_TYPES, SCHEMA_FILE

_REF = re.compile(r"#/\$defs/([\w.\-]+)")
_KEEP = ("type", "properties", "required", "items", "additionalProperties", "$ref", "oneOf", "enum", "format")


def extract() -> dict[str, Any]:
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    folder = schemas / f"v{KUBERNETES_VERSION}-local-strict"
    definitions = json.loads((folder / "_definitions.json").read_text())["$defs"]
    wanted: dict[str, Any] = {}

    def visit(name: str) -> None:
        if name in wanted:
            return
        wanted[name] = _trim(definitions[name])
        for ref in _REF.findall(json.dumps(definitions[name])):
            visit(ref)

    for name in ROOT_TYPES.values():
        visit(name)
    return {"kubernetesVersion": KUBERNETES_VERSION, "definitions": dict(sorted(wanted.items()))}


def _trim(node: Any) -> Any:
    """Only the keywords grpolora.api.kubetypes evaluates (descriptions and x-kubernetes-* hints dropped)."""
    if isinstance(node, list):
        return [_trim(item) for item in node]
    if not isinstance(node, dict):
        return node
    result = {}
    for key, value in node.items():
        if key == "properties":
            result[key] = {name: _trim(sub) for name, sub in value.items()}
        elif key in _KEEP:
            result[key] = _trim(value)
    return result


def render() -> str:
    return json.dumps(extract(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    SCHEMA_FILE.write_text(render())
    print(f"wrote {SCHEMA_FILE}")
