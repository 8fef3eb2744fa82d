"""The layering rule, as CI runs it: ruff (with its banned-import rule, TID251) is clean on the repo; the library
may import no service and no benchmark; nobody imports the design's folders by their top-level names (the wheel
installs only ``splitserve``: tests/e2e/test_wheel.py checks that side)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).parent / "ruff"

pytestmark = pytest.mark.skipif(not RUFF.exists(), reason="ruff is a dev dependency (make setup installs it)")


def _ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RUFF), "check", "--no-cache", "--output-format", "concise", *args], cwd=ROOT,
                          input=stdin, capture_output=True, text=True, timeout=120)


def test_ruff_is_clean_on_the_repo() -> None:
    cp = _ruff(".")
    assert cp.returncode == 0, cp.stdout[-4000:] + cp.stderr[-2000:]


@pytest.mark.parametrize(("path", "source", "banned"), [
    ("splitserve/_probe.py", "from splitserve.services.router import service\n", "splitserve.services"),
    ("splitserve/_probe.py", "import bench.stats\n", "bench"),
    ("services/_probe.py", "from bench import stats\n", "bench"),
    ("proto/_probe.py", "from splitserve.services.common import handoff\n", "splitserve.services"),
    ("services/_probe.py", "import proto\n", "proto"),
    ("tests/_probe.py", "from services.router import service\n", "services"),
])
def test_a_layering_violation_is_flagged(path: str, source: str, banned: str) -> None:
    cp = _ruff("--select", "TID251", "--stdin-filename", path, "-", stdin=source)
    assert cp.returncode == 1 and f"`{banned}` is banned" in cp.stdout, cp.stdout + cp.stderr


@pytest.mark.parametrize(("path", "source"), [
    ("services/_probe.py", "from splitserve.services.common import handoff\n"),  # services use each other
    ("tests/_probe.py", "from bench.stats import percentile\nfrom splitserve.services.router import service\n"),
    ("splitserve/_probe.py", "from splitserve.runtime.workqueue import WorkQueue\n"),
])
def test_what_each_layer_may_import_passes(path: str, source: str) -> None:
    cp = _ruff("--select", "TID251", "--stdin-filename", path, "-", stdin=source)
    assert cp.returncode == 0, cp.stdout + cp.stderr


def test_the_package_holds_the_design_folders_through_links() -> None:
    for name in ("proto", "services"):
        link = ROOT / "splitserve" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), link
