"""Inference engines behind one interface (`Engine`), and a registry to load them by name.

Backends are imported lazily: importing this package does not import torch, transformers or vllm. "mock" is not a
model: it fakes tokens for control-plane load tests (see splitserve.engines.mock).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.engines.base import (
        AdapterNotSupported,
        ContextFull,
        Engine,
        EngineError,
        KvSource,
        LayerHook,
        ModelInfo,
        PrefillRequest,
        PrefillResult,
        PromptTooLong,
        Sampling,
        TokenLogprobs,
        UnknownAdapter,
    )

# The interface's names come from ``base``, which imports torch (about 1 CPU-second): loaded on first use, so
# that what needs only a tokenizer or a model's files (the router, the CLI) never imports torch.
_BASE_NAMES = frozenset({"AdapterNotSupported", "ContextFull", "Engine", "EngineError", "KvSource", "LayerHook",
                         "ModelInfo", "PrefillRequest", "PrefillResult", "PromptTooLong", "Sampling",
                         "TokenLogprobs", "UnknownAdapter"})


def __getattr__(name: str) -> Any:
    if name in _BASE_NAMES:
        from splitserve.engines import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


EngineFactory = Callable[..., "Engine"]


def _load_hf(**opts: Any) -> Engine:
    from splitserve.engines.hf import HfEngine

    return HfEngine.load(**opts)


def _load_mock(**opts: Any) -> Engine:
    from splitserve.engines.mock import MockEngine

    return MockEngine.load(**opts)


_REGISTRY: dict[str, EngineFactory] = {"hf": _load_hf, "mock": _load_mock}


def register_engine(name: str, factory: EngineFactory) -> None:
    """Make `load_engine(name, **opts)` call factory(**opts) (for "mock", "vllm", or test doubles)."""
    _REGISTRY[name] = factory


def engine_names() -> list[str]:
    return sorted(_REGISTRY)


def load_engine(name: str, /, **opts: Any) -> Engine:
    """Load an engine by name; opts go to its loader (hf: model, dtype, num_threads, max_model_len, name;
    mock: the same plus step_ms, prefill_tokens_per_s, ignoring any other). `name` is positional-only so that
    the model's display name can be passed as the `name` option."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(engine_names())}") from None
    return factory(**opts)


__all__ = [
    "AdapterNotSupported",
    "ContextFull",
    "Engine",
    "EngineError",
    "EngineFactory",
    "KvSource",
    "LayerHook",
    "ModelInfo",
    "PrefillRequest",
    "PrefillResult",
    "PromptTooLong",
    "Sampling",
    "TokenLogprobs",
    "UnknownAdapter",
    "engine_names",
    "load_engine",
    "register_engine",
]
