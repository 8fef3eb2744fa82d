"""A worker's LoRA adapter slots as pure bookkeeping: which adapters are loaded, which one goes to make room.

The rule of ``--max-loras N``: at most N adapters are loaded at once; one is loaded when a sequence first needs
it, and the least recently used one that no running sequence holds is unloaded to make room. When every slot is
held by running sequences, the sequence waits (``can_admit`` is False) until one is released. Capacity 0 means no
limit: every adapter is loaded at start and stays (nothing is ever loaded on demand). The simulator's workers run
this class; a live worker's ``AdapterSlots`` (``services/common/adapters.py``) applies the same rule with its
engine as the judge of which adapters running sequences hold (only the engine knows): it asks the engine to unload
the least recently used and moves on to the next when the engine refuses.

Pure and synchronous (no engine, no asyncio, no clock): the caller says which adapters its running sequences hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

__all__ = ["AdapterLru"]


class AdapterLru:
    """Loaded adapters, least recently used first, with counters for reports."""

    __slots__ = ("capacity", "_loaded", "loads", "evictions", "peak")

    def __init__(self, capacity: int, loaded: Iterable[str] = ()) -> None:
        if capacity < 0:
            raise ValueError("the adapter capacity must be >= 0 (0: no limit)")
        self.capacity = capacity
        self._loaded: OrderedDict[str, None] = OrderedDict.fromkeys(loaded)
        self.loads = 0  # adapters loaded on demand
        self.evictions = 0
        self.peak = len(self._loaded)  # the most ever loaded at once (never above the capacity when bounded)

    @property
    def on_demand(self) -> bool:
        return self.capacity > 0

    def loaded(self) -> list[str]:
        """The loaded adapters, least recently used first."""
        return list(self._loaded)

    def __contains__(self, name: object) -> bool:
        return name in self._loaded

    def __len__(self) -> int:
        return len(self._loaded)

    def victim(self, held: Collection[str]) -> str | None:
        """The adapter that would be unloaded to make room: the least recently used one not in ``held``."""
        return next((a for a in self._loaded if a not in held), None)

    def can_admit(self, name: str | None, held: Collection[str]) -> bool:
        """Whether ``name`` can be ready without waiting: the base model (None), loaded already, no limit, a free
        slot, or a loaded one that no running sequence holds (``held``)."""
        if name is None or name in self._loaded or not self.on_demand:
            return True
        return len(self._loaded) < self.capacity or self.victim(held) is not None

    def admit(self, name: str | None, held: Collection[str]) -> bool:
        """Make ``name`` loaded (most recently used) for a sequence about to run; True when that took a load.
        Raises ``RuntimeError`` when it cannot without waiting (check ``can_admit`` first)."""
        if name is None:
            return False
        loaded = self._loaded
        if name in loaded:
            loaded.move_to_end(name)
            return False
        if self.on_demand and len(loaded) >= self.capacity:
            gone = self.victim(held)
            if gone is None:
                raise RuntimeError(f"all {self.capacity} adapter slots are held by running sequences")
            del loaded[gone]
            self.evictions += 1
        loaded[name] = None
        if self.on_demand:
            self.loads += 1
        if len(loaded) > self.peak:
            self.peak = len(loaded)
        return self.on_demand
