"""What the OpenAI-compatible HTTP front door adds on top of the NATS client path, one run, one stack.

Starts ``splitserve up`` (or uses a running stack), then sends the same kind of short streaming request
(plain prompt, greedy, a few tokens) down both paths and prints them side by side:

* NATS client: ``splitserve.client.Client.generate`` straight onto the request subject (the baseline);
* HTTP front door: ``POST /v1/completions`` with ``stream: true`` over a keep-alive HTTP connection.

TTFT is request sent -> first token text received; total is request sent -> end of stream. Sequential
requests alternate the order of the two paths every iteration so that drift on a shared machine hits both
alike; concurrent rounds send M requests at once down one path, then M down the other. Every prompt is
unique, so neither path gets a prefix-cache hit the other did not. The last column splits the added TTFT:
"HTTP only" is the HTTP TTFT minus the front door's own NATS-measured TTFT of the same request (reported
in the stream's ``splitserve.ttft_ms``), i.e. the HTTP/SSE hop alone; GET /healthz gives the floor of any
HTTP round trip on the same machine under the same load.

    python -m bench.frontdoor [--n 40] [--m 8] [--rounds 3] [--max-tokens 8] [--nats-url U --http-url H] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2

from bench.stats import fmt, summary
from splitserve.client import Client


@dataclass
class Sample:
    ttft_ms: float
    total_ms: float
    inner_ttft_ms: float | None = None  # the front door's own NATS TTFT (HTTP path only)


@dataclass
class Series:
    name: str
    samples: list[Sample] = field(default_factory=list)


def prompt(tag: str, i: int) -> str:
    return f"Note {tag}-{i}: the quick brown fox jumps over the lazy dog. Then"


async def via_nats(c: Client, text: str, max_tokens: int) -> Sample:
    t0 = time.perf_counter()
    first: float | None = None
    async for d in c.generate(text, max_tokens=max_tokens, temperature=0.0):
        if first is None and d.text:
            first = time.perf_counter()
    end = time.perf_counter()
    return Sample(ttft_ms=((first or end) - t0) * 1000, total_ms=(end - t0) * 1000)


async def via_http(http: httpx2.AsyncClient, text: str, max_tokens: int) -> Sample:
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first: float | None = None
    inner: float | None = None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
            if "splitserve" in chunk:
                inner = chunk["splitserve"]["ttft_ms"]
    end = time.perf_counter()
    return Sample(ttft_ms=((first or end) - t0) * 1000, total_ms=(end - t0) * 1000, inner_ttft_ms=inner)


async def run(nats_url: str, http_url: str, n: int, m: int, rounds: int, max_tokens: int) -> dict[str, Any]:
    limits = httpx2.Limits(max_connections=max(m, 1) * 2, max_keepalive_connections=max(m, 1) * 2)
    async with Client(nats_url, tenant="bench") as c, \
            httpx2.AsyncClient(base_url=http_url, timeout=300, limits=limits) as http:
        # Warm both paths (connections, first-use allocations, the model's first steps).
        for i in range(3):
            await via_nats(c, prompt("warm-n", i), max_tokens)
            await via_http(http, prompt("warm-h", i), max_tokens)
        # The floor of any HTTP round trip on this machine under the same load: GET /healthz (no NATS).
        floor: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter()
            (await http.get("/healthz")).raise_for_status()
            floor.append((time.perf_counter() - t0) * 1000)
        seq_n, seq_h = Series("nats"), Series("http")
        for i in range(n):
            order = [("n", seq_n), ("h", seq_h)] if i % 2 == 0 else [("h", seq_h), ("n", seq_n)]
            for tag, path in order:
                fn = via_nats(c, prompt(f"s{tag}", i), max_tokens) if tag == "n" else \
                    via_http(http, prompt(f"s{tag}", i), max_tokens)
                path.samples.append(await fn)
        con_n, con_h = Series("nats"), Series("http")
        for r in range(rounds):
            for tag, path in ([("n", con_n), ("h", con_h)] if r % 2 == 0 else [("h", con_h), ("n", con_n)]):
                if tag == "n":
                    batch = [via_nats(c, prompt(f"c{tag}{r}", j), max_tokens) for j in range(m)]
                else:
                    batch = [via_http(http, prompt(f"c{tag}{r}", j), max_tokens) for j in range(m)]
                path.samples += await asyncio.gather(*batch)

    def stats(p: Series) -> dict[str, Any]:
        out = {"ttft_ms": summary([s.ttft_ms for s in p.samples]),
               "total_ms": summary([s.total_ms for s in p.samples])}
        hop = [s.ttft_ms - s.inner_ttft_ms for s in p.samples if s.inner_ttft_ms is not None]
        if hop:
            out["http_hop_ttft_ms"] = summary(hop)
        return out

    return {"n": n, "m": m, "rounds": rounds, "max_tokens": max_tokens, "healthz_ms": summary(floor),
            "sequential": {"nats": stats(seq_n), "http": stats(seq_h)},
            "concurrent": {"nats": stats(con_n), "http": stats(con_h)}}


def _delta(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{b - a:+,.1f} ms"


def report(res: dict[str, Any]) -> None:
    print(f"\nfront door vs NATS client: /v1/completions stream vs Client.generate, {res['max_tokens']} tokens, "
          f"greedy; sequential n={res['n']} per path, concurrent {res['m']} at once x {res['rounds']} rounds")
    print(f"{'':<28}{'NATS client':>14}{'HTTP front door':>17}{'added':>13}{'HTTP only':>13}")
    for mode in ("sequential", "concurrent"):
        nats_, http_ = res[mode]["nats"], res[mode]["http"]
        for metric in ("ttft_ms", "total_ms"):
            for q in ("p50", "p99"):
                a, b = nats_[metric][q], http_[metric][q]
                hop = http_.get("http_hop_ttft_ms", {}).get(q) if metric == "ttft_ms" else None
                label = f"{mode} {'TTFT' if metric == 'ttft_ms' else 'total'} {q}"
                print(f"{label:<28}{fmt(a):>14}{fmt(b):>17}{_delta(a, b):>13}{fmt(hop):>13}")
    h = res["healthz_ms"]
    print(f"HTTP floor (GET /healthz, same machine and load): p50 {fmt(h['p50'])}  p99 {fmt(h['p99'])}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40, help="sequential requests per path")
    ap.add_argument("--m", type=int, default=8, help="concurrent requests per round")
    ap.add_argument("--rounds", type=int, default=3, help="concurrent rounds per path")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--nats-url", default=None, help="use a running stack (with --http-url) instead of starting one")
    ap.add_argument("--http-url", default=None, help="the running stack's front door, e.g. http://127.0.0.1:8000")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from splitserve.stackproc import start_stack

    stack = None
    nats_url, http_url = args.nats_url, args.http_url
    if nats_url is None or http_url is None:
        stack = start_stack(Path(tempfile.mkdtemp(prefix="bench-frontdoor-")), "--http-port", "0")
        nats_url, http_url = stack.nats_url, stack.http_url
        assert http_url, "the stack printed no OpenAI API URL"
    try:
        res = asyncio.run(run(nats_url, http_url, args.n, args.m, args.rounds, args.max_tokens))
    finally:
        if stack is not None:
            stack.stop()
    if args.json:
        print(json.dumps(res, indent=2))
        return
    report(res)
    print("\n" + json.dumps(res))


if __name__ == "__main__":
    main()
