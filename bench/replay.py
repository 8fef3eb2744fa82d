"""Replay a real request trace through the front door (or the NATS client) at a chosen speed-up.

Traces (``../shared/data/traces/``, see that folder's README):

* ``azure-conv`` / ``azure-code``: Azure LLM inference 2023 (``TIMESTAMP``, ``ContextTokens``,
  ``GeneratedTokens``). Every prompt is unique (no prefix sharing in the trace).
* ``mooncake``: Mooncake synthetic trace (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``, one id per 512-token block). Every hash id maps to one deterministic block of token ids, so
  requests that share leading hash ids share identical leading tokens and the prefix cache can hit.

The traces were recorded on far bigger models; scaling to SmolLM2-135M on CPU is explicit:

* ``--prompt-scale`` multiplies Azure prompt lengths; ``--block-tokens`` is the size a 512-token Mooncake
  block becomes (the prompt is the concatenation of its blocks, cut at ``input_length * block_tokens/512``);
* ``--max-prompt`` caps every prompt (tokens), ``--output-scale`` / ``--max-output`` scale and cap outputs;
* ``--speedup`` divides the trace's inter-arrival times; ``--limit`` / ``--skip`` pick the rows.

Prompts are sent as token-id lists (``/v1/completions`` accepts them, as does ``Client.generate``) so the
lengths and the shared prefixes are exact, not at the mercy of a tokenizer's merges at block boundaries.
Ids are drawn from an ordinary-token range (``TOKEN_LO``..``TOKEN_HI``) with a per-run ``--salt``, so a
second run against the same stack does not hit the cache left by the first one.

Each request is sent at its (sped-up) timestamp, independent of how far behind earlier ones are (open loop).
TTFT is send -> first non-empty delta, ITL the gaps between later deltas, e2e send -> end of stream.
Generation may stop early at EOS (this replay does not send ``ignore_eos``, which the front door now honours):
completion tokens are reported.

    python -m bench.replay --trace mooncake --limit 40 --speedup 2 [--via http|nats] [--http-url H] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.stats import fmt, summary
from bench.workload import traces_dir

TRACE_NAMES = {
    "azure-conv": "AzureLLMInferenceTrace_conv_2023.csv",
    "azure-code": "AzureLLMInferenceTrace_code_2023.csv",
    "mooncake": "mooncake_synthetic_trace.jsonl",
}
TRACES_DIR = traces_dir()  # ../shared/data/traces beside a checkout, else $SPLITSERVE_TRACES_DIR / --traces-dir
TRACE_FILES = {name: TRACES_DIR / file for name, file in TRACE_NAMES.items()}
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake trace
# Token ids for synthetic prompts: clear of SmolLM2's special tokens (0..16) and of the vocab's far end.
TOKEN_LO, TOKEN_HI = 1000, 40000


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One trace row as recorded: arrival offset from the first row (s), lengths, and Mooncake block ids."""

    t_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ScaledRequest:
    """One request ready to send: when (s after start, sped up), the exact prompt token ids, max tokens."""

    index: int
    send_at_s: float
    prompt: list[int]
    max_tokens: int
    source: TraceRecord
    block_tokens: int = 0  # Mooncake: tokens per hash id in ``prompt`` (0: no blocks)


@dataclass(frozen=True, slots=True)
class Scaling:
    speedup: float = 1.0
    prompt_scale: float = 1.0  # Azure: prompt length multiplier
    block_tokens: int = 16  # Mooncake: tokens per 512-token block after scaling
    max_prompt: int = 2000
    output_scale: float = 1.0
    max_output: int = 32
    salt: int = 0


def read_azure(path: Path, limit: int | None = None, skip: int = 0) -> list[TraceRecord]:
    """Azure 2023 CSV rows -> records with arrival offsets (s) from the first row kept."""
    out: list[TraceRecord] = []
    t0: datetime | None = None
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < skip:
                continue
            # Seven fractional digits: datetime takes six.
            stamp = row["TIMESTAMP"].strip()
            head, _, frac = stamp.partition(".")
            t = datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if frac else head)
            t0 = t0 or t
            out.append(TraceRecord((t - t0).total_seconds(), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            if limit is not None and len(out) >= limit:
                break
    return out


def read_mooncake(path: Path, limit: int | None = None, skip: int = 0) -> list[TraceRecord]:
    """Mooncake JSONL rows -> records (timestamps are ms; offsets from the first row kept)."""
    out: list[TraceRecord] = []
    t0: int | None = None
    with open(path) as f:
        for i, line in enumerate(x for x in f if x.strip()):
            if i < skip:
                continue
            d = json.loads(line)
            t0 = int(d["timestamp"]) if t0 is None else t0
            out.append(TraceRecord((int(d["timestamp"]) - t0) / 1000.0, int(d["input_length"]),
                                   int(d["output_length"]), tuple(int(h) for h in d["hash_ids"])))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.t_s)
    return out


def read_trace(name: str, limit: int | None = None, skip: int = 0, traces: Path | None = None) -> list[TraceRecord]:
    path = (traces / TRACE_NAMES[name]) if traces is not None else TRACE_FILES[name]
    if not path.is_file():
        raise SystemExit(f"trace file {path} not found: pass --traces-dir DIR or set $SPLITSERVE_TRACES_DIR")
    return read_mooncake(path, limit, skip) if name == "mooncake" else read_azure(path, limit, skip)


def _ids(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def block_ids(hash_id: int, block_tokens: int, salt: int = 0) -> list[int]:
    """The token ids one Mooncake hash id stands for: the same id always gives the same block."""
    return _ids(f"mc:{salt}:{hash_id}", block_tokens)


def scaled_output(r: TraceRecord, s: Scaling) -> int:
    return max(1, min(s.max_output, round(r.output_tokens * s.output_scale)))


def scale(records: list[TraceRecord], s: Scaling) -> list[ScaledRequest]:
    """Records -> requests with exact prompts: Mooncake prompts are their blocks' ids concatenated (shared
    leading hash ids -> shared leading tokens), Azure prompts are unique ids of the scaled length."""
    out: list[ScaledRequest] = []
    for i, r in enumerate(records):
        if r.hash_ids:
            n = max(1, min(s.max_prompt, math.ceil(r.input_tokens * s.block_tokens / MOONCAKE_BLOCK)))
            prompt: list[int] = []
            for h in r.hash_ids:
                if len(prompt) >= n:
                    break
                prompt += block_ids(h, s.block_tokens, s.salt)
            prompt = prompt[:n]
        else:
            n = max(1, min(s.max_prompt, round(r.input_tokens * s.prompt_scale)))
            prompt = _ids(f"az:{s.salt}:{i}", n)
        out.append(ScaledRequest(i, r.t_s / s.speedup, prompt, scaled_output(r, s), r,
                                 s.block_tokens if r.hash_ids else 0))
    return out


def shared_prefix_tokens(requests: list[ScaledRequest]) -> int:
    """Prompt tokens in blocks whose whole hash-id chain occurred in an earlier request: what a perfect,
    unbounded prefix cache at the trace's block granularity could reuse (a ceiling for the measured share)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for r in requests:
        chain: tuple[int, ...] = ()
        for k, h in enumerate(r.source.hash_ids):
            lo = k * r.block_tokens
            if lo >= len(r.prompt):
                break
            chain = (*chain, h)
            if chain in seen:
                total += min(len(r.prompt), lo + r.block_tokens) - lo
            seen.add(chain)
    return total


# ---------------------------------------------------------------------------------------------- sending


@dataclass
class Outcome:
    index: int
    target_s: float
    sent_s: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def _send_http(client: Any, model: str, req: ScaledRequest, out: Outcome) -> None:
    t0 = time.perf_counter()
    last: float | None = None
    stream = await client.completions.create(model=model, prompt=req.prompt, max_tokens=req.max_tokens,
                                             temperature=0.0, stream=True,
                                             stream_options={"include_usage": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            if last is None:
                out.ttft_ms = (now - t0) * 1000
            else:
                out.itl_ms.append((now - last) * 1000)
            last = now
        if chunk.usage is not None:
            out.prompt_tokens = chunk.usage.prompt_tokens
            out.completion_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            out.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
    out.e2e_ms = (time.perf_counter() - t0) * 1000


async def _send_nats(client: Any, req: ScaledRequest, out: Outcome) -> None:
    t0 = time.perf_counter()
    last: float | None = None
    gen = client.generate(req.prompt, max_tokens=req.max_tokens, temperature=0.0)
    async for d in gen:
        now = time.perf_counter()
        if d.text:
            if last is None:
                out.ttft_ms = (now - t0) * 1000
            else:
                out.itl_ms.append((now - last) * 1000)
            last = now
    out.e2e_ms = (time.perf_counter() - t0) * 1000
    u = gen.result.usage
    out.prompt_tokens, out.completion_tokens, out.cached_tokens = u.prompt_tokens, u.completion_tokens, \
        u.cached_tokens


async def replay(requests: list[ScaledRequest], via: str, nats_url: str | None, http_url: str | None,
                 model: str | None, timeout: float) -> tuple[list[Outcome], float, str]:
    """Send every request at its time (open loop); return outcomes, wall seconds, and the model name."""
    outcomes = [Outcome(r.index, r.send_at_s) for r in requests]
    if via == "http":
        from openai import AsyncOpenAI  # its default pool allows 1,000 connections: enough for open loop

        assert http_url
        client: Any = AsyncOpenAI(base_url=http_url.rstrip("/") + "/v1", api_key="unused", timeout=timeout,
                                  max_retries=0)
        if model is None:
            model = (await client.models.list()).data[0].id
    else:
        from splitserve.client import Client

        client = Client(nats_url, tenant="replay")
        await client.connect()
        model = model or "-"

    async def one(req: ScaledRequest, out: Outcome, start: float) -> None:
        delay = start + req.send_at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        out.sent_s = time.perf_counter() - start
        try:
            coro = _send_http(client, model, req, out) if via == "http" else _send_nats(client, req, out)
            await asyncio.wait_for(coro, timeout)
        except Exception as exc:  # noqa: BLE001 - every failure is a counted, reported error
            out.error = f"{type(exc).__name__}: {str(exc)[:160]}"

    try:
        start = time.perf_counter()
        await asyncio.gather(*(one(r, o, start) for r, o in zip(requests, outcomes, strict=True)))
        wall = time.perf_counter() - start
    finally:
        await client.close()
    return outcomes, wall, model


def results(requests: list[ScaledRequest], outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None]
    span = requests[-1].send_at_s - requests[0].send_at_s if len(requests) > 1 else 0.0
    sent_span = max(o.sent_s for o in outcomes) - min(o.sent_s for o in outcomes) if len(outcomes) > 1 else 0.0
    lag = [max(0.0, o.sent_s - o.target_s) * 1000 for o in outcomes]
    prompt_tok = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    out_tok = sum(o.completion_tokens for o in ok)
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    tpot = [(o.e2e_ms - o.ttft_ms) / (o.completion_tokens - 1) for o in ok
            if o.ttft_ms is not None and o.e2e_ms is not None and o.completion_tokens > 1]
    return {
        "requests": len(requests), "ok": len(ok), "errors": sum(errors.values()), "error_kinds": errors,
        "target_rate_rps": (len(requests) - 1) / span if span > 0 else None,
        "achieved_send_rate_rps": (len(outcomes) - 1) / sent_span if sent_span > 0 else None,
        "send_lag_ms": summary(lag), "wall_s": wall_s,
        "completed_rps": len(ok) / wall_s if wall_s > 0 else None,
        "output_tok_per_s": out_tok / wall_s if wall_s > 0 else None,
        "total_tok_per_s": (out_tok + prompt_tok) / wall_s if wall_s > 0 else None,
        "prompt_tokens": prompt_tok, "completion_tokens": out_tok, "cached_tokens": cached,
        "cached_share": cached / prompt_tok if prompt_tok else None,
        "ttft_ms": summary([o.ttft_ms for o in ok if o.ttft_ms is not None]),
        "itl_ms": summary([x for o in ok for x in o.itl_ms]),
        "tpot_ms": summary(tpot),
        "e2e_ms": summary([o.e2e_ms for o in ok if o.e2e_ms is not None]),
    }


def report(res: dict[str, Any]) -> None:
    a = res["args"]
    print(f"\nreplay {a['trace']} rows {a['skip']}..{a['skip'] + res['requests']} via {a['via']} "
          f"(model {res['model']}), speed-up x{a['speedup']}, prompt cap {a['max_prompt']}, "
          f"output cap {a['max_output']}" + (f", block {a['block_tokens']} tok" if a["trace"] == "mooncake" else
                                             f", prompt scale {a['prompt_scale']}"))
    sp = res["scaled"]
    print(f"scaled prompts p50/p90/max {sp['prompt']['p50']:.0f}/{sp['prompt']['p90']:.0f}/{sp['prompt']['max']:.0f} "
          f"tok, outputs p50 {sp['output']['p50']:.0f} tok; block-level prefix reuse ceiling "
          f"{sp['reuse_ceiling']:.1%}")
    tr = res["target_rate_rps"]
    ar = res["achieved_send_rate_rps"]
    print(f"rate: target {tr or 0:.2f} req/s, achieved send {ar or 0:.2f} req/s (send lag p99 "
          f"{fmt(res['send_lag_ms']['p99'])}); completed {res['ok']}/{res['requests']}, errors {res['errors']}")
    for kind, n in res["error_kinds"].items():
        print(f"  error x{n}: {kind}")
    print(f"throughput: {res['completed_rps'] or 0:.2f} req/s, {res['output_tok_per_s'] or 0:.1f} output tok/s, "
          f"{res['total_tok_per_s'] or 0:.1f} total tok/s over {res['wall_s']:.1f} s")
    share = res["cached_share"]
    print(f"cached tokens: {res['cached_tokens']:,} of {res['prompt_tokens']:,} prompt tokens "
          f"({'-' if share is None else f'{share:.1%}'}); completion tokens {res['completion_tokens']:,}")
    print(f"{'':<8}{'p50':>14}{'p90':>14}{'p99':>14}{'n':>7}")
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "e2e")):
        s = res[key]
        print(f"{label:<8}{fmt(s['p50']):>14}{fmt(s['p90']):>14}{fmt(s['p99']):>14}{s['n']:>7}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", choices=sorted(TRACE_FILES), default="mooncake")
    ap.add_argument("--traces-dir", type=Path, default=None,
                    help="folder of the trace files (default: $SPLITSERVE_TRACES_DIR, else ../shared/data/traces)")
    ap.add_argument("--limit", type=int, default=40, help="rows to replay")
    ap.add_argument("--skip", type=int, default=0, help="rows to skip first")
    ap.add_argument("--speedup", type=float, default=1.0, help="divide inter-arrival times by this")
    ap.add_argument("--prompt-scale", type=float, default=1.0, help="Azure: prompt length multiplier")
    ap.add_argument("--block-tokens", type=int, default=16, help="Mooncake: tokens per 512-token block")
    ap.add_argument("--max-prompt", type=int, default=2000, help="prompt cap (tokens)")
    ap.add_argument("--output-scale", type=float, default=1.0)
    ap.add_argument("--max-output", type=int, default=32, help="output cap (tokens)")
    ap.add_argument("--salt", type=int, default=None, help="prompt id salt (default: from the clock)")
    ap.add_argument("--via", choices=("http", "nats"), default="http")
    ap.add_argument("--http-url", default=None, help="a running front door, e.g. http://127.0.0.1:8000")
    ap.add_argument("--nats-url", default=None, help="a running stack's NATS (for --via nats)")
    ap.add_argument("--model", default=None, help="served model name (default: the first of GET /v1/models)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    salt = args.salt if args.salt is not None else int(time.time())
    sc = Scaling(args.speedup, args.prompt_scale, args.block_tokens, args.max_prompt, args.output_scale,
                 args.max_output, salt)
    requests = scale(read_trace(args.trace, args.limit, args.skip, args.traces_dir), sc)
    if not requests:
        raise SystemExit("no rows selected")

    stack = None
    nats_url, http_url = args.nats_url, args.http_url
    need_stack = http_url is None if args.via == "http" else nats_url is None
    if need_stack:
        from splitserve.stackproc import start_stack

        stack = start_stack(Path(tempfile.mkdtemp(prefix="bench-replay-")), "--http-port", "0")
        nats_url, http_url = stack.nats_url, stack.http_url
    try:
        outcomes, wall, model = asyncio.run(replay(requests, args.via, nats_url, http_url, args.model,
                                                   args.timeout))
    finally:
        if stack is not None:
            stack.stop()
    res = results(requests, outcomes, wall)
    prompts = [len(r.prompt) for r in requests]
    res["model"] = model
    res["scaled"] = {"prompt": summary(prompts), "output": summary([r.max_tokens for r in requests]),
                     "reuse_ceiling": reuse_ceiling(requests)}
    res["args"] = {**vars(args), "salt": salt}
    if args.json:
        print(json.dumps(res, indent=2))
        return
    report(res)
    print("\n" + json.dumps(res))


def reuse_ceiling(requests: list[ScaledRequest]) -> float:
    total = sum(len(r.prompt) for r in requests)
    return shared_prefix_tokens(requests) / total if total else 0.0


def iter_prefix_pairs(requests: list[ScaledRequest]) -> Iterator[tuple[ScaledRequest, ScaledRequest, int]]:
    """Pairs (a, b, k) of Mooncake requests whose first k hash ids are equal (k >= 1), a before b."""
    for i, a in enumerate(requests):
        for b in requests[i + 1:]:
            k = 0
            for x, y in zip(a.source.hash_ids, b.source.hash_ids, strict=False):
                if x != y:
                    break
                k += 1
            if k:
                yield a, b, k


if __name__ == "__main__":
    main()
