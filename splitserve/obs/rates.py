"""Event rates over a sliding window (the routers' accepted / dispatched / refused per second, per tenant)."""

from __future__ import annotations

from collections import deque


class EventRate:
    """Events per second over the last ``window_s`` (or since the first event, when that is more recent: a
    tenant that started sending 2 s ago is read at its rate, not at a fifth of it; at least 1 s, so the first
    event alone does not read as a burst)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._t: deque[float] = deque()
        self._first: float | None = None

    def add(self, now: float) -> None:
        if self._first is None:
            self._first = now
        self._t.append(now)
        if len(self._t) > 64 and self._t[0] < now - self.window_s:
            self.per_s(now)  # drop what left the window: nobody may ask for a while (only reports do)

    def per_s(self, now: float) -> float:
        while self._t and self._t[0] < now - self.window_s:
            self._t.popleft()
        if not self._t or self._first is None:
            return 0.0
        return len(self._t) / max(1.0, min(self.window_s, now - self._first))
