"""Context pools: long-context sequences decode apart from the short streams.

A decode step reads every active sequence's KV once. One 3,000-token sequence in a batch of 100-token
streams adds its whole KV read (138 MB on the bundled model in fp32) to *every* step of *every* stream in
that batch: on one CPU core each step went from ~105 to ~140 ms (+33%) for as long as it decoded, and its
join added another 40-80 ms to one step. No scheduling inside a batch avoids that cost; keeping the
sequence out of the batch does. So decoders may be started as a ``long`` pool, and this rule sends a
request there when its prompt reaches ``long_prompt_tokens``:

* prompt >= ``long_prompt_tokens`` and a ``long`` decoder is live           -> the ``long`` decoders
* otherwise, when a ``general`` decoder is live                             -> the ``general`` decoders
* otherwise (only ``long`` decoders are live)                               -> them (degraded, not failed)

Without ``long`` decoders (the default) every request sees every decoder, as before. Short requests never
go to a ``long`` decoder while a general one is live: keeping it free is what lets a long prompt start
decoding at once, and where it shares cores with the prefill pool (2-core machines) its steps would slow
both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from splitserve.routing.base import WorkerView

__all__ = ["GENERAL", "LONG", "POOLS", "ContextPools"]

GENERAL: Final = "general"
LONG: Final = "long"
POOLS: Final = (GENERAL, LONG)


@dataclass(frozen=True, slots=True)
class ContextPools:
    long_prompt_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.long_prompt_tokens < 1:
            raise ValueError("long_prompt_tokens must be >= 1")

    def candidates(self, prompt_tokens: int, decoders: Sequence[WorkerView]) -> tuple[list[WorkerView], str]:
        """The decoders this request may use, and which pool that is (for the decision record)."""
        long = [d for d in decoders if d.pool == LONG]
        general = [d for d in decoders if d.pool != LONG] if long else list(decoders)  # no long pool: all general
        if long and prompt_tokens >= self.long_prompt_tokens:
            return long, LONG
        if general:
            return general, GENERAL
        return long, "long_only"
