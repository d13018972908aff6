"""Render the Helm chart with a real helm binary and hand the tests plain objects."""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.helpers import ROOT

CHART = ROOT / "charts" / "grpo-lora-operator"
RELEASE = "grpo-lora"
NAMESPACE = "grpo-lora-system"
KUBE_VERSION = "1.33.0"

# Value combinations every rendering test runs over: the default, listed namespaces, monitoring on, peering
# on in both scopes, two replicas (active/standby), the operator's
# NetworkPolicy in both scopes, the CRD managed elsewhere, a digest-pinned image with placement.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "namespaces": {"watch": {"namespaces": ["team-a", "team-b"]}},
    "monitoring": {
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "workers": {"podMonitor": {"enabled": True}},
        },
        "dashboards": {"enabled": True, "namespace": "monitoring"},
    },
    "peering-cluster": {"peering": {"enabled": True}},
    "peering-namespaces": {"peering": {"enabled": True, "name": "rl"}, "watch": {"namespaces": ["team-a"]}},
    "ha": {"replicaCount": 2, "peering": {"enabled": True}},
    "network-policy": {"networkPolicy": {"enabled": True}},
    "network-policy-namespaces": {
        "watch": {"namespaces": ["team-a", "team-b"]},
        "networkPolicy": {
            "enabled": True,
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
            "healthFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
            "apiServer": {"cidrs": ["172.18.0.2/32"], "ports": [6443]},
        },
    },
    "namespaces-monitoring": {
        "watch": {"namespaces": ["team-a"]},
        "metrics": {"serviceMonitor": {"enabled": True}, "workers": {"podMonitor": {"enabled": True}}},
    },
    "no-crd-and-placement": {
        "crds": {"install": False},
        "image": {"digest": "sha256:" + "a" * 64},
        "logLevel": "debug",
        "nodeSelector": {"grpolora.dev/pool": "system"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}
                    ]
                }
            }
        },
        "priorityClassName": "system-cluster-critical",
        "imagePullSecrets": [{"name": "regcred"}],
        "workers": {
            "images": {"gpu": "registry.example.com/grpo/worker-gpu:0.1.0"},
            "imagePullSecrets": [{"name": "x"}],
        },
        "serviceAccount": {"annotations": {"example.com/role": "operator"}},
    },
}


class HelmFailed(Exception):
    pass


@dataclass
class Chart:
    helm: Path

    def run(self, *args: str, values: dict[str, Any] | None = None) -> str:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as values_file:
            yaml.safe_dump(values or {}, values_file)
            values_file.flush()
            result = subprocess.run(
                [str(self.helm), *args, "--values", values_file.name],
                capture_output=True,
                text=True,
                timeout=60,
            )
        if result.returncode != 0:
            raise HelmFailed(result.stderr.strip() or result.stdout.strip())
        return result.stdout

    def template_text(self, values: dict[str, Any] | None = None, *extra: str) -> str:
        return self.run(
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--kube-version",
            KUBE_VERSION,
            *extra,
            values=values,
        )

    def render(self, values: dict[str, Any] | None = None, *, include_crds: bool = True) -> list[dict[str, Any]]:
        text = self.template_text(values, *(["--include-crds"] if include_crds else []))
        return [doc for doc in yaml.safe_load_all(text) if doc]

    def lint(self, values: dict[str, Any] | None = None) -> str:
        return self.run("lint", "--strict", str(CHART), "--namespace", NAMESPACE, values=values)

    def notes(self, values: dict[str, Any] | None = None) -> str:
        """NOTES.txt as `helm install` prints it (a client-side dry run: no cluster needed)."""
        out = self.run(
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--dry-run=client",
            values=values,
        )
        return out.split("NOTES:", 1)[1] if "NOTES:" in out else ""


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None, namespace: str | None = None) -> dict:
    matches = [
        o
        for o in objects
        if o["kind"] == kind
        and (name is None or o["metadata"]["name"] == name)
        and (namespace is None or o["metadata"].get("namespace") == namespace)
    ]
    assert len(matches) == 1, f"expected one {kind} {namespace or ''}/{name or '*'}, found {len(matches)}"
    return matches[0]


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    return sorted(o["kind"] for o in objects)
