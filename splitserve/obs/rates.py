"""Event rates over a sliding window (the routers' accepted / dispatched / refused per second, per tenant)."""

from __future__ import annotations

from collections import deque


class EventRate:
    """Events per second over the last ``window_s``."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._t: deque[float] = deque()

    def add(self, now: float) -> None:
        self._t.append(now)
        if len(self._t) > 64 and self._t[0] < now - self.window_s:
            self.per_s(now)  # drop what left the window: nobody may ask for a while (only reports do)

    def per_s(self, now: float) -> float:
        while self._t and self._t[0] < now - self.window_s:
            self._t.popleft()
        return len(self._t) / self.window_s
