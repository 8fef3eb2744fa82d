"""Workloads for the simulator: the public traces and synthetic mixes, as arrival-ordered requests.

Loaders (files under ``../shared/data/traces/``, see that folder's README):

* :func:`load_mooncake` - Mooncake jsonl (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``: one id per 512-token block, prefix-chained). The ids become the router's chained block hashes
  (:func:`splitserve.cache.hashing.mooncake_block_hashes`), so prefix reuse in the trace is real reuse in the
  simulated caches and in the live :class:`~splitserve.cache.index.PrefixIndex`;
* :func:`load_azure` - Azure LLM inference 2023 csv (``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``);
  every prompt is unique (no hashes: nothing is reusable);
* :func:`load_sharegpt` - ShareGPT lengths (sarathi-serve's csv, llama2 tokenizer): lengths only, so arrivals
  are Poisson at a given rate (``seed``-ed);
* :func:`synthetic` - a seeded mix (optionally with shared prefixes as real token ids, which is what the
  live-router equivalence test uses) and :func:`rag_mix` - long-context RAG prompts beside short chat streams.

Several models and LoRA adapters: :func:`assign_models` gives requests a served model by a seeded mix,
:func:`assign_adapters` a LoRA adapter of Zipf popularity (or the base model). A request's prefix cache is then
scoped to (model, adapter) by the salt the live router uses (:func:`scoped_salt`), so no prompt hits another
model's or adapter's blocks.

:func:`scale_rate` multiplies the arrival rate (divides inter-arrival times). Bad files and rows raise
:class:`WorkloadError` naming the file and line.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from splitserve.cache.hashing import MOONCAKE_BLOCK_TOKENS, hash_token_blocks, mooncake_block_hashes, root_hash
from splitserve.tenancy.config import TenantsConfig

# The salts of a cluster without a tenants file (per tenant name): what the live router gives each request.
_OPEN = TenantsConfig.open_mode()

__all__ = [
    "DATA_DIR",
    "TRACES_DIR",
    "TRACE_FILES",
    "SimRequest",
    "WorkloadError",
    "adapter_name",
    "assign_adapters",
    "assign_models",
    "load_azure",
    "load_mooncake",
    "load_sharegpt",
    "load_trace",
    "poisson_arrivals",
    "rag_mix",
    "scale_rate",
    "scoped_salt",
    "synthetic",
    "zipf_weights",
]

# ``../shared/data`` beside the checkout (the project's layout; CI has the same copy); overridable.
DATA_DIR = Path(os.environ.get("SPLITSERVE_SHARED_DATA") or Path(__file__).resolve().parents[3] / "shared" / "data")
TRACES_DIR = DATA_DIR / "traces"
TRACE_FILES = {
    "mooncake": "mooncake_synthetic_trace.jsonl",
    "mooncake-arxiv20": "mooncake_arxiv_head20_from_dynamo_test.jsonl",
    "azure-conv": "AzureLLMInferenceTrace_conv_2023.csv",
    "azure-code": "AzureLLMInferenceTrace_code_2023.csv",
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
}


class WorkloadError(ValueError):
    """A trace file or workload setting that cannot be used (the message names the file and row)."""


@dataclass(slots=True)
class SimRequest:
    """One request: arrival (s from the start), lengths, tenant, and what identifies its prefix.

    ``hash_ids`` (Mooncake) or ``token_ids`` (synthetic) give the prompt's block hashes; with neither the
    prompt is unique. ``hashes(block_size)`` computes them once per block size. Token prompts are hashed under
    their tenant's cache salt, as the live router does without a tenants file (tenants never share cached
    prefixes); Mooncake rows have no tenant of their own (all "default") and keep the trace's id space.

    ``cache_scope`` (None: as just said) is the cache salt the live router would give the request under a tenants
    file (``TenantsConfig.cache_salt``): it roots both kinds of prompt, so tenants (or cache groups) never share
    blocks, Mooncake rows included (the what-if sets it: :mod:`.whatif`).

    ``model`` (None: the cluster's default) and ``lora`` (None: the base model) say what serves it. The cluster
    passes ``hashes`` the model to scope the prefix cache to (model, ``lora``) when the live router would (several
    models, or an adapter); unscoped hashes are those of a single-model cluster."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    tenant: str = "default"
    session: str | None = None
    hash_ids: tuple[int, ...] = ()
    token_ids: list[int] | None = None
    kind: str = ""  # a label for reports (e.g. "long" / "short" in the RAG mix)
    model: str | None = None
    lora: str | None = None
    cache_scope: str | None = None
    _hashes: list[int] | None = field(default=None, repr=False)
    _hash_bs: int = field(default=0, repr=False)
    _hash_scope: str | None = field(default=None, repr=False)

    def hashes(self, block_size: int, scope_model: str | None = None) -> list[int]:
        """The prompt's block hashes; ``scope_model``: scoped to that model and this request's adapter (as the live
        router salts a request when it serves several models or the request names an adapter)."""
        if self._hashes is not None and self._hash_bs == block_size and self._hash_scope == scope_model:
            return self._hashes
        if self.token_ids is not None:
            salt = self.cache_scope or _OPEN.cache_salt(self.tenant)
            if scope_model is not None:
                salt = scoped_salt(salt, scope_model, self.lora)
            out = hash_token_blocks(self.token_ids, block_size, cache_salt=salt)
        elif self.hash_ids:
            if MOONCAKE_BLOCK_TOKENS % block_size:
                raise WorkloadError(f"block size {block_size} does not divide the Mooncake block (512 tokens)")
            full = self.prompt_tokens // block_size  # a trailing partial block is never hashed
            per = MOONCAKE_BLOCK_TOKENS // block_size
            # the trace's own chain root, scoped the way a token prompt's salt is
            # (and under ``cache_scope``, the tenant's salt, when one is set)
            base = self.cache_scope or "mooncake"
            if scope_model is not None:
                parent: int | None = root_hash(scoped_salt(base, scope_model, self.lora))
            else:
                parent = None if self.cache_scope is None else root_hash(base)
            out = mooncake_block_hashes(self.hash_ids[: -(-full // per)], block_size, parent=parent)[:full]
        else:
            out = []
        self._hashes, self._hash_bs, self._hash_scope = out, block_size, scope_model
        return out

    def drop_hashes(self) -> None:
        self._hashes = None


def scoped_salt(salt: str, model: str, lora: str | None) -> str:
    """A cache salt scoped to (model, adapter), as the live router's ``_cache_salt`` writes it: ``|m:`` and 12 hex
    digits of the SHA-256 of both (a tenant's salt holds no ``|``), so no prompt hits another model's or adapter's
    blocks."""
    scope = f"{model}\0{lora or ''}".encode("utf-8", "surrogatepass")
    return f"{salt}|m:{hashlib.sha256(scope).hexdigest()[:12]}"


def _path(name_or_path: str | Path) -> Path:
    s = str(name_or_path)
    if s in TRACE_FILES:
        return TRACES_DIR / TRACE_FILES[s]
    p = Path(s)
    if not p.exists():
        raise WorkloadError(f"no trace {s!r}: give a file or one of {', '.join(TRACE_FILES)}")
    return p


def load_mooncake(path: str | Path = "mooncake", limit: int | None = None) -> list[SimRequest]:
    p = _path(path)
    out: list[SimRequest] = []
    t0: float | None = None
    with open(p) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                t = float(d["timestamp"]) / 1000.0
                n_in, n_out = int(d["input_length"]), int(d["output_length"])
                ids = tuple(int(h) for h in d.get("hash_ids") or ())
            except (ValueError, KeyError, TypeError) as exc:
                raise WorkloadError(f"{p}:{line_no}: not a Mooncake row ({exc!r})") from exc
            if n_in < 1 or n_out < 0:
                raise WorkloadError(f"{p}:{line_no}: input_length must be >= 1 and output_length >= 0")
            t0 = t if t0 is None else t0
            out.append(SimRequest(f"mc{len(out)}", t - t0, n_in, max(1, n_out), hash_ids=ids))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival_s)
    return out


def _azure_time(stamp: str) -> datetime:
    head, _, frac = stamp.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if frac else head)


def load_azure(path: str | Path = "azure-conv", limit: int | None = None) -> list[SimRequest]:
    p = _path(path)
    out: list[SimRequest] = []
    t0: datetime | None = None
    with open(p, newline="") as f:
        for row_no, row in enumerate(csv.DictReader(f), 2):
            try:
                t = _azure_time(row["TIMESTAMP"])
                n_in, n_out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, KeyError, TypeError) as exc:
                raise WorkloadError(f"{p}:{row_no}: not an Azure trace row ({exc!r})") from exc
            t0 = t0 or t
            out.append(SimRequest(f"az{len(out)}", (t - t0).total_seconds(), max(1, n_in), max(1, n_out)))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival_s)
    return out


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    if rate <= 0:
        raise WorkloadError("rate must be positive")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def load_sharegpt(
    path: str | Path = "sharegpt", limit: int | None = None, *, rate: float = 1.0, seed: int = 0,
    max_total_tokens: int | None = None, sample: bool = True,
) -> list[SimRequest]:
    """ShareGPT lengths with Poisson arrivals at ``rate`` req/s. ``max_total_tokens`` drops conversations
    longer than a model's context (OPT's 2,048); ``sample``: a seeded random sample of ``limit`` rows
    rather than the first ones."""
    p = _path(path)
    rows: list[tuple[int, int]] = []
    with open(p, newline="") as f:
        for row_no, row in enumerate(csv.DictReader(f), 2):
            try:
                n_in, n_out = int(row["num_prefill_tokens"]), int(row["num_decode_tokens"])
            except (ValueError, KeyError, TypeError) as exc:
                raise WorkloadError(f"{p}:{row_no}: not a ShareGPT lengths row ({exc!r})") from exc
            if max_total_tokens is not None and n_in + n_out > max_total_tokens:
                continue
            rows.append((max(1, n_in), max(1, n_out)))
    if limit is not None and limit < len(rows):
        rows = random.Random(seed).sample(rows, limit) if sample else rows[:limit]
    times = poisson_arrivals(len(rows), rate, seed + 1)
    return [SimRequest(f"sg{i}", t, a, b) for i, (t, (a, b)) in enumerate(zip(times, rows, strict=True))]


def load_trace(name: str, limit: int | None = None, **kw: object) -> list[SimRequest]:
    """A trace by name (``mooncake``, ``azure-conv``, ``azure-code``, ``sharegpt``) or by file path."""
    s = str(name)
    if s.startswith("mooncake") or s.endswith(".jsonl"):
        return load_mooncake(s, limit)
    if s == "sharegpt" or "sharegpt" in Path(s).name:
        return load_sharegpt(s, limit, **kw)  # type: ignore[arg-type]
    if s.startswith("azure") or s.endswith(".csv"):
        return load_azure(s, limit)
    raise WorkloadError(f"unknown trace {name!r}: give one of {', '.join(TRACE_FILES)} or a .jsonl/.csv file")


def scale_rate(requests: Sequence[SimRequest], factor: float) -> list[SimRequest]:
    """The same requests arriving ``factor`` times as fast (inter-arrival times divided by ``factor``)."""
    if factor <= 0 or not math.isfinite(factor):
        raise WorkloadError("the rate factor must be a positive number")
    return [replace(r, arrival_s=r.arrival_s / factor, _hashes=None, _hash_bs=0) for r in requests]


def synthetic(
    n: int, rate: float, *, prompt: tuple[int, int] = (64, 512), output: tuple[int, int] = (8, 64),
    prefix_groups: int = 0, prefix_tokens: int = 0, tenants: Sequence[str] = ("default",), seed: int = 0,
    with_tokens: bool = False,
) -> list[SimRequest]:
    """``n`` Poisson arrivals at ``rate`` req/s with uniform lengths in the given ranges. With
    ``prefix_groups`` each request starts with one of that many shared ``prefix_tokens``-token prefixes;
    ``with_tokens`` gives every request real token ids (what the live router would hash)."""
    rng = random.Random(seed)
    times = poisson_arrivals(n, rate, seed + 1)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(prefix_tokens)] for _ in range(prefix_groups)]
    out = []
    for i, t in enumerate(times):
        p = rng.randint(*prompt)
        o = rng.randint(*output)
        tenant = tenants[i % len(tenants)]
        toks = None
        if with_tokens or prefixes:
            head = rng.choice(prefixes) if prefixes else []
            toks = head[:p] + [rng.randrange(1000, 40000) for _ in range(max(0, p - len(head)))]
            p = len(toks)
        out.append(SimRequest(f"syn{i}", t, p, o, tenant=tenant, token_ids=toks))
    return out


def rag_mix(
    duration_s: float, *, long_rate: float, short_rate: float, long_tokens: tuple[int, int] = (16000, 32000),
    long_output: int = 200, short_tokens: tuple[int, int] = (200, 800), short_output: int = 300,
    docs: int = 0, seed: int = 0,
) -> list[SimRequest]:
    """A long-context RAG-like mix: long prompts (retrieved documents + question; ``docs`` > 0 makes them
    draw from that many shared documents, so prefix caching can help) beside short chat streams."""
    rng = random.Random(seed)
    out: list[SimRequest] = []
    for kind, rate in (("long", long_rate), ("short", short_rate)):
        if rate <= 0:
            continue
        t = rng.expovariate(rate)
        while t < duration_s:
            if kind == "long":
                n = rng.randint(*long_tokens)
                ids: tuple[int, ...] = ()
                if docs:
                    d = rng.randrange(docs)
                    shared = (n // MOONCAKE_BLOCK_TOKENS) * 3 // 4
                    ids = tuple(10_000_000 * (d + 1) + k for k in range(shared)) + tuple(
                        rng.randrange(1 << 40) for _ in range(-(-n // MOONCAKE_BLOCK_TOKENS) - shared))
                out.append(SimRequest("", t, n, long_output, hash_ids=ids, kind="long"))
            else:
                out.append(SimRequest("", t, rng.randint(*short_tokens), short_output, kind="short"))
            t += rng.expovariate(rate)
    out.sort(key=lambda r: r.arrival_s)
    for i, r in enumerate(out):
        r.request_id = f"{r.kind}{i}"
    return out


def zipf_weights(n: int, s: float) -> list[float]:
    """Zipf popularity of ``n`` items: the k-th (from 0) weighs 1 / (k + 1) ** s."""
    return [1.0 / (k + 1) ** s for k in range(n)]


def assign_models(requests: Sequence[SimRequest], mix: Mapping[str, float], seed: int = 0) -> list[SimRequest]:
    """The same requests, each given a served model drawn from ``mix`` (name -> weight; weights need not sum to
    1), seeded."""
    names = list(mix)
    weights = [float(mix[m]) for m in names]
    if not names or min(weights) < 0 or sum(weights) <= 0:
        raise WorkloadError("a model mix needs at least one model and non-negative weights that are not all 0")
    rng = random.Random(seed)
    picks = rng.choices(names, weights=weights, k=len(requests))
    return [replace(r, model=m, _hashes=None, _hash_bs=0, _hash_scope=None)
            for r, m in zip(requests, picks, strict=True)]


def adapter_name(model: str | None, k: int) -> str:
    """The ``k``-th adapter of ``model`` (None: the cluster's one model) as the workload names it."""
    return f"{model}/lora-{k:03d}" if model else f"lora-{k:03d}"


def assign_adapters(requests: Sequence[SimRequest], n_adapters: int, zipf_s: float = 1.1, share: float = 1.0,
                    seed: int = 0) -> list[SimRequest]:
    """The same requests, a ``share`` of them (seeded) for a LoRA adapter of their model, drawn among
    ``n_adapters`` per model with Zipf popularity (exponent ``zipf_s``); the rest for the base model. Adapters of
    different models are different adapters (:func:`adapter_name`)."""
    if n_adapters < 1:
        raise WorkloadError("the number of adapters must be >= 1")
    if not 0.0 <= share <= 1.0:
        raise WorkloadError("the adapter share must be within [0, 1]")
    rng = random.Random(seed)
    weights = zipf_weights(n_adapters, zipf_s)
    ranks = range(n_adapters)
    out = []
    for r in requests:
        use = rng.random() < share
        k = rng.choices(ranks, weights=weights)[0]  # drawn either way: the mix of one share is the other's
        out.append(replace(r, lora=adapter_name(r.model, k) if use else None, _hashes=None, _hash_bs=0,
                           _hash_scope=None))
    return out
