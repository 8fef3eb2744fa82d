"""Per-tenant intake byte budget: how many bytes of requests a tenant may make one router read per second.

A router decodes (JSON), validates and tokenizes what it reads; a tenant sending large messages as fast as NATS
carries them would spend the router's CPU on everyone's behalf before any quota applies (quotas count tokens,
which cost tokenizing to know). So a router first charges each message's size to its tenant (the tenant the
subject names, known without decoding) in a token bucket, and refuses what the bucket cannot pay with a
retryable ``busy`` and the time until it can. Every message costs at least ``MIN_COST`` bytes, so a flood of
tiny messages is bounded too.

Pure and deterministic (the caller passes the time); the buckets are capped at ``max_keys`` (least recently
used dropped: a dropped bucket starts full again, which only forgives), so invented tenant names cannot grow it.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_BYTES_PER_S = 16 * 1024 * 1024
MIN_COST = 1024


class IntakeBudget:
    def __init__(self, bytes_per_s: float = DEFAULT_BYTES_PER_S, burst_bytes: float | None = None,
                 max_keys: int = 4096) -> None:
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be > 0")
        self.rate = float(bytes_per_s)
        # Room for one message of the largest size NATS carries (8 MiB here) on top of a second's worth.
        self.burst = float(burst_bytes if burst_bytes is not None else self.rate + 8 * 1024 * 1024)
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (level, at)

    def take(self, key: str, nbytes: int, now: float, rate: float | None = None) -> float | None:
        """Charge ``nbytes`` to ``key``: None when paid, else the seconds until it could be (nothing is
        charged then). ``rate`` overrides the default rate for this key (a tenant's own limit)."""
        r = self.rate if rate is None else float(rate)
        burst = self.burst if rate is None else r + 8 * 1024 * 1024
        cost = float(max(nbytes, MIN_COST))
        level, at = self._buckets.pop(key, (burst, now))
        level = min(burst, level + max(0.0, now - at) * r)
        if cost <= level:
            self._store(key, level - cost, now)
            return None
        self._store(key, level, now)
        # A message larger than the whole bucket can never pass: say when the bucket is full, the best case.
        return (min(cost, burst) - level) / r

    def _store(self, key: str, level: float, now: float) -> None:
        self._buckets[key] = (level, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)

    def __len__(self) -> int:
        return len(self._buckets)
