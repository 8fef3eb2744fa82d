"""Strategy registry: names -> constructors, so config files and CLIs pick strategies by name.

``make_strategy("kvaware", index=idx, temperature=0.1)``: keyword arguments that belong to the shared
cost (:class:`~splitserve.routing.cost.CostConfig` fields) build the strategy's :class:`CostModel`; the
rest go to the strategy's constructor. New strategies register with :func:`register`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from splitserve.routing.base import Strategy
from splitserve.routing.cost import CostConfig, CostModel
from splitserve.routing.kvaware import KvAwareStrategy
from splitserve.routing.prefixaware import PrefixAwareStrategy
from splitserve.routing.roundrobin import RoundRobinStrategy
from splitserve.routing.session import SessionStrategy
from splitserve.routing.slo import SloStrategy

__all__ = ["available", "make_strategy", "register"]

_COST_FIELDS = frozenset(f.name for f in fields(CostConfig))
_REGISTRY: dict[str, Callable[..., Strategy]] = {}
_TAKES_COST: set[str] = set()


def register(name: str, factory: Callable[..., Strategy], *, takes_cost: bool = True) -> None:
    if name in _REGISTRY:
        raise ValueError(f"strategy {name!r} is already registered")
    _REGISTRY[name] = factory
    if takes_cost:
        _TAKES_COST.add(name)


def available() -> list[str]:
    return sorted(_REGISTRY)


def make_strategy(name: str, **cfg: Any) -> Strategy:
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown routing strategy {name!r}; available: {', '.join(available())}")
    cost_cfg = {k: cfg.pop(k) for k in list(cfg) if k in _COST_FIELDS}
    if name in _TAKES_COST:
        if "cost" not in cfg:
            cfg["cost"] = CostModel(CostConfig(**cost_cfg))
        elif cost_cfg:
            raise ValueError("give either cost=CostModel(...) or cost fields, not both")
    elif cost_cfg:
        raise ValueError(f"strategy {name!r} takes no cost settings: {sorted(cost_cfg)}")
    return factory(**cfg)


register("roundrobin", RoundRobinStrategy, takes_cost=False)
register("session", SessionStrategy)
register("prefixaware", PrefixAwareStrategy)
register("kvaware", KvAwareStrategy)
register("slo", SloStrategy)
