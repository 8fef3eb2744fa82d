"""Next-token selection from logits: greedy, or temperature + top-p with a per-position seeded draw.

Why per position: the first token of a request is sampled by a prefill worker and the rest by a decode worker
in another process. If the random draw for the token at absolute position p depends only on (seed, p) -- never
on how many draws a process has made before -- the split run yields exactly the tokens one process would.

The draw is a counter-based generator (SplitMix64 keyed by seed, then by position) rather than a
torch.Generator: it is plain integer arithmetic, so it is identical across processes, machines, torch versions
and engines (a future vllm or mock engine can reproduce it), and costs nothing to "seed" per row.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from torch import Tensor

from splitserve.engines.base import Sampling, TokenLogprobs

_MASK64 = (1 << 64) - 1
_os_random = random.SystemRandom()


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int | None, position: int) -> float:
    """Uniform [0, 1) draw for the token at `position`: fixed by (seed, position); random if no seed."""
    if seed is None:
        return _os_random.random()
    key = _splitmix64(seed & _MASK64)
    return (_splitmix64(key ^ (position & _MASK64)) >> 11) * (1.0 / (1 << 53))


def sample_rows(logits: Tensor, temperature: Tensor, top_p: Tensor, uniforms: Tensor) -> Tensor:
    """Vectorised temperature + top-p sampling by inverse CDF: one row per sequence.

    logits [B, V]; temperature, top_p, uniforms [B] (temperature > 0). Returns token ids [B] (int64).
    """
    probs = torch.softmax(logits.float() / temperature.unsqueeze(1), dim=-1)
    # stable sort: identical probabilities must order identically in every process
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the top token is always kept)
    keep = (cumulative - sorted_probs) < top_p.unsqueeze(1)
    kept = sorted_probs * keep
    kept_cumulative = kept.cumsum(dim=-1)
    targets = uniforms * kept_cumulative[:, -1]
    choice = torch.searchsorted(kept_cumulative, targets.unsqueeze(1), right=True).squeeze(1)
    # float rounding can land the target just past the last kept token
    choice = torch.minimum(choice, keep.sum(dim=-1) - 1)
    return order.gather(1, choice.unsqueeze(1)).squeeze(1)


def sample(logits: Tensor, samplings: Sequence[Sampling], positions: Sequence[int]) -> list[int]:
    """Pick one token per row of logits [B, V].

    positions[i] is the absolute position the sampled token will occupy in sequence i (= tokens before it).
    """
    return sample_logprobs(logits, samplings, positions)[0]


def sample_logprobs(logits: Tensor, samplings: Sequence[Sampling],
                    positions: Sequence[int]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """:func:`sample`, plus each row's log-probabilities when its Sampling asks for them.

    Log-probabilities are the raw model distribution (log-softmax of the logits before temperature, top-p and
    the min_tokens EOS mask), as vLLM reports by default; a greedy row's chosen token is its top entry.
    """
    if logits.dim() != 2 or logits.shape[0] != len(samplings) or len(samplings) != len(positions):
        raise ValueError("need logits [B, V] with one Sampling and one position per row")
    raw = logits
    masked = [i for i, s in enumerate(samplings) if s.suppress_ids and positions[i] < s.suppress_before]
    if masked:
        logits = logits.clone()
        for i in masked:
            logits[i, list(samplings[i].suppress_ids)] = float("-inf")
    tokens = _pick(logits, samplings, positions)
    out: list[TokenLogprobs | None] = [None] * len(samplings)
    wanted = [i for i, s in enumerate(samplings) if s.logprobs is not None]
    if wanted:
        lp = torch.log_softmax(raw[wanted].float(), dim=-1)
        k = max(samplings[i].logprobs or 0 for i in wanted)
        top_v, top_i = torch.topk(lp, k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        for row, i in enumerate(wanted):
            n = samplings[i].logprobs or 0
            top = tuple((int(t), float(v)) for t, v in zip(top_i[row, :n].tolist(), top_v[row, :n].tolist(),
                                                              strict=True))
            out[i] = TokenLogprobs(tokens[i], float(lp[row, tokens[i]]), top)
    return tokens, out


def _pick(logits: Tensor, samplings: Sequence[Sampling], positions: Sequence[int]) -> list[int]:
    tokens = torch.argmax(logits, dim=-1)  # greedy rows, and a placeholder for the others
    rows = [i for i, s in enumerate(samplings) if not s.greedy]
    if rows:
        device = logits.device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        temperature = torch.tensor([samplings[i].temperature for i in rows], device=device)
        top_p = torch.tensor([samplings[i].top_p for i in rows], device=device)
        uniforms = torch.tensor([position_uniform(samplings[i].seed, positions[i]) for i in rows], device=device)
        tokens[index] = sample_rows(logits[index], temperature, top_p, uniforms)
    return [int(t) for t in tokens.tolist()]
