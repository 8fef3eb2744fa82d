"""A request's wire sampling parameters in an engine's terms, and engine log-probabilities in wire terms.

Shared by the prefill and decode workers (hf, mock and vLLM), so that the first token (sampled by a prefiller)
and the rest (by a decoder) follow the same rules: ``min_tokens`` masks the model's EOS ids for the first
``min_tokens`` positions after the prompt, ``logprobs`` asks the engine for each token's log-probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitserve.engines.base import Sampling, TokenLogprobs
from splitserve.proto import SamplingParams, TokenLogprob, TopLogprob


def engine_sampling(p: SamplingParams, prompt_tokens: int, eos_ids: Sequence[int]) -> Sampling:
    suppress = tuple(int(t) for t in eos_ids) if p.min_tokens and not p.ignore_eos else ()
    return Sampling(temperature=p.temperature, top_p=p.top_p, seed=p.seed, logprobs=p.logprobs,
                    suppress_ids=suppress, suppress_before=prompt_tokens + p.min_tokens if suppress else 0)


def _piece(engine: Any, token_id: int) -> str:
    return str(engine.decode([token_id], skip_special_tokens=False))


def wire_logprob(engine: Any, lp: TokenLogprobs | None) -> TokenLogprob | None:
    """Token strings are decoded one token at a time (as vLLM's server does); a token holding part of a
    multi-byte character decodes to U+FFFD."""
    if lp is None:
        return None
    return TokenLogprob(token_id=lp.token_id, token=_piece(engine, lp.token_id), logprob=lp.logprob,
                        top=[TopLogprob(token_id=t, token=_piece(engine, t), logprob=v) for t, v in lp.top])
