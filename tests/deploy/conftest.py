"""Fixtures for the deploy/ checks: the real kubectl (Debian's kubernetes-client, or Google's kubectl
package), each overlay rendered once, and the Secrets `splitserve k8s secrets` makes for the example tenants."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve import k8s
from splitserve.tenancy import natsauth
from splitserve.tenancy.config import load_tenants

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu-dev", "gpu-efa")
EXAMPLE_TENANTS = K8S / "tenants.example.yaml"


def require_tool(name: str, package: str) -> str:
    """The tool's path; a missing one skips the test, except under CI=true, where it fails."""
    beside = Path(sys.executable).parent / name  # a tool a PyPI wheel put in the venv, which may not be on PATH
    path = os.environ.get(name.upper()) or (str(beside) if beside.exists() else None) or shutil.which(name)
    if path:
        return path
    msg = f"{name} not found: install the Debian package {package} (tools/apt-packages.txt, `make sysdeps`)"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def kubectl() -> str:
    return require_tool("kubectl", "kubernetes-client")


def kustomize(kubectl: str, path: Path) -> list[dict[str, Any]]:
    proc = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="session")
def rendered(kubectl: str) -> dict[str, list[dict[str, Any]]]:
    return {name: kustomize(kubectl, K8S / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="session")
def example_secrets(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    cfg = load_tenants(EXAMPLE_TENANTS)
    auth = natsauth.prepare_stack_auth(tmp_path_factory.mktemp("k8s-state"), cfg)
    return k8s.secret_manifests(cfg, auth, EXAMPLE_TENANTS.read_text(), namespace="splitserve")
