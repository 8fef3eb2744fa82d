"""The disaggregation decision: prefill on the chosen decoder ("direct") or through a prefiller.

It looks at the *uncached* part of the prompt on the chosen decoder - what that decoder would have to
compute itself - and at whether doing so would stall the streams the decoder is already serving. Rules,
first match wins (the name is the decision's ``reason``):

1. ``fully_cached``  - nothing to compute (or an empty prompt)                        -> direct
2. ``would_stall``   - ``max_stall_ms`` is set, the decoder has active streams and the local prefill would
                       take longer than that: one forward pass's fixed cost (the decoder's step time) plus
                       the uncached tokens at its prefill rate                          -> disaggregated
3. ``short_uncached`` / ``mostly_cached`` - the size rules say the prefill is cheap     -> direct:
      * absolute: uncached < ``min_uncached_tokens`` (512 suits CPU workers; Dynamo uses 2048 on GPUs)
      * relative: uncached / prompt < ``max_direct_fraction`` (off when None)
   ``combine="any"`` goes direct when either rule says so; ``combine="all"`` only when both do (Dynamo's
   newer rule: uncached < 2048 tokens *and* < 70% of the prompt, see :meth:`DisaggPolicy.dynamo`).
4. ``long_uncached`` - otherwise                                                        -> disaggregated

When a rule says "disaggregated" but no prefiller is live the answer is direct with reason
``no_prefillers`` (``values["wanted"]`` keeps the rule that wanted a prefiller): degraded, not failed.

Rule 2 is how "this decoder is busy streaming; a 3,000-token local prefill would freeze its streams for
seconds" is expressed (on 2 CPU cores that stall measured ~4.7 s; see DESIGN.md): it overrides the size
rules, so even a short prefill goes remote when the decoder is slow and busy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from splitserve.routing.base import DIRECT, DISAGGREGATED, WorkerView

__all__ = ["DisaggPolicy", "RouteChoice"]


@dataclass(frozen=True, slots=True)
class RouteChoice:
    route: str
    reason: str
    values: dict[str, Any]


@dataclass(frozen=True, slots=True)
class DisaggPolicy:
    min_uncached_tokens: int = 512
    max_direct_fraction: float | None = None
    combine: Literal["any", "all"] = "any"
    max_stall_ms: float | None = None
    decoder_prefill_tokens_per_s: float | None = None  # used when the decoder's view has no rate
    enabled: bool = True  # False: always direct (aggregated serving)

    def __post_init__(self) -> None:
        if self.combine not in ("any", "all"):
            raise ValueError("combine must be 'any' or 'all'")
        if self.min_uncached_tokens < 0:
            raise ValueError("min_uncached_tokens must be >= 0")
        if self.max_direct_fraction is not None and not 0.0 <= self.max_direct_fraction <= 1.0:
            raise ValueError("max_direct_fraction must be within [0, 1]")

    @classmethod
    def dynamo(cls) -> DisaggPolicy:
        """Dynamo's conditional disaggregation: prefill locally when < 2048 uncached and < 70% uncached."""
        return cls(min_uncached_tokens=2048, max_direct_fraction=0.7, combine="all")

    @classmethod
    def always(cls) -> DisaggPolicy:
        """Every prompt with anything to compute goes through a prefiller."""
        return cls(min_uncached_tokens=0)

    @classmethod
    def never(cls) -> DisaggPolicy:
        return cls(enabled=False)

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    def decide(
        self, prompt_tokens: int, uncached_tokens: int, decoder: WorkerView, prefillers_available: bool
    ) -> RouteChoice:
        uncached = max(0, min(uncached_tokens, prompt_tokens))
        fraction = uncached / prompt_tokens if prompt_tokens > 0 else 0.0
        values: dict[str, Any] = {
            "min_uncached_tokens": self.min_uncached_tokens,
            "max_direct_fraction": self.max_direct_fraction,
            "combine": self.combine,
            "uncached_tokens": uncached,
            "uncached_fraction": round(fraction, 4),
        }
        if not self.enabled:
            return RouteChoice(DIRECT, "disaggregation_off", values)
        if uncached == 0:
            return RouteChoice(DIRECT, "fully_cached", values)
        choice = self._by_rules(uncached, fraction, decoder, values)
        if choice.route == DISAGGREGATED and not prefillers_available:
            values["wanted"] = choice.reason
            return RouteChoice(DIRECT, "no_prefillers", values)
        return choice

    def _by_rules(
        self, uncached: int, fraction: float, decoder: WorkerView, values: dict[str, Any]
    ) -> RouteChoice:
        if self.max_stall_ms is not None:
            rate = decoder.prefill_tokens_per_s or self.decoder_prefill_tokens_per_s
            values["max_stall_ms"] = self.max_stall_ms
            values["decoder_active_seqs"] = decoder.active_seqs
            if rate:
                # The pause this prefill adds to the decoder's streams: a forward pass's fixed cost (reading
                # every weight once, measured as the decoder's step time) plus the prompt's own compute. On CPU
                # the fixed part dominates short prompts: 25 tokens paused 4 streams ~130 ms, not 31.
                fixed = decoder.step_ms or 0.0
                stall_ms = fixed + 1000.0 * uncached / rate
                values["decoder_prefill_tokens_per_s"] = rate
                values["decoder_step_ms"] = decoder.step_ms
                values["stall_ms"] = round(stall_ms, 2)
                if decoder.active_seqs > 0 and stall_ms > self.max_stall_ms:
                    return RouteChoice(DISAGGREGATED, "would_stall", values)
        short = uncached < self.min_uncached_tokens
        mostly_cached = self.max_direct_fraction is not None and fraction < self.max_direct_fraction
        if self.combine == "all":
            direct = short and (mostly_cached or self.max_direct_fraction is None)
        else:
            direct = short or mostly_cached
        if direct:
            return RouteChoice(DIRECT, "short_uncached" if short else "mostly_cached", values)
        return RouteChoice(DISAGGREGATED, "long_uncached", values)
