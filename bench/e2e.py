"""End-to-end benchmark on the real model, one run, one stack.

Starts ``splitserve up`` (1 prefill + 1 decode, the chosen KV transport), then measures:

1. control-plane overhead: request publish -> job start at the worker (``timings.dispatch_ms``) and
   publish -> routed (``timings.queue_ms``), p50/p99, with 1-token direct requests on an idle stack;
2. TTFT and ITL p50/p99 of a ~2,000-token prompt on the direct path and on the disaggregated path
   (a fresh prompt each run so no cache can help);
3. KV push bandwidth of each transport beside a memcpy of the same bytes (the baseline ceiling).

    python -m bench.e2e [--runs 3] [--tokens 2000] [--transport nixl] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from bench.stats import fmt, summary
from splitserve.client import Client

# Common words that SmolLM2's tokenizer keeps as one token each (with the leading space).
WORDS = [
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school",
    "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company",
    "system", "program", "question", "work", "number", "night", "point", "home", "water", "room", "mother", "area",
    "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business",
    "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line",
    "end", "member", "law", "car", "city", "community", "name", "team", "minute", "idea", "body", "back",
    "parent", "face", "level", "office", "door", "health", "person", "art", "war", "history", "party", "result",
    "change", "morning", "reason", "girl", "moment", "air", "teacher", "force",
]


def make_prompt(tokens: int, rng: random.Random) -> str:
    # ~1 token per word; a random lead makes every prompt unique (no prefix cache can help).
    body = " ".join(rng.choice(WORDS) for _ in range(tokens))
    return f"Request {rng.randrange(10**9)}: {body}\nRepeat the first three words:"


async def control_plane(url: str, n: int) -> dict[str, Any]:
    dispatch, queue, ttft = [], [], []
    async with Client(url, tenant="bench") as c:
        for i in range(n):
            r = await c.complete(f"ping {i}", max_tokens=1, route="direct")
            if r.timings.dispatch_ms is not None:
                dispatch.append(r.timings.dispatch_ms)
            if r.timings.queue_ms is not None:
                queue.append(r.timings.queue_ms)
            if r.ttft_ms is not None:
                ttft.append(r.ttft_ms)
    return {"dispatch_ms": summary(dispatch), "publish_to_routed_ms": summary(queue), "ttft_ms": summary(ttft)}


async def long_prompt(
    url: str, route: Literal["direct", "disaggregated"], runs: int, tokens: int, max_tokens: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    ttfts, itls, prompt_tokens, prefill, transfer = [], [], [], [], []
    async with Client(url, tenant="bench", idle_timeout=600) as c:
        for _ in range(runs):
            gen = c.generate(make_prompt(tokens, rng), max_tokens=max_tokens, route=route)
            stamps = []
            async for _d in gen:
                stamps.append(time.perf_counter())
            r = gen.result
            assert r is not None and r.route == route, (r.route if r else None, route)
            ttfts.append(r.ttft_ms or 0.0)
            itls += [(b - a) * 1000 for a, b in zip(stamps, stamps[1:], strict=False)]
            prompt_tokens.append(r.usage.prompt_tokens)
            if r.timings.prefill_ms is not None:
                prefill.append(r.timings.prefill_ms)
            if r.timings.transfer_ms is not None:
                transfer.append(r.timings.transfer_ms)
    return {"route": route, "prompt_tokens": prompt_tokens, "ttft_ms": summary(ttfts), "itl_ms": summary(itls),
            "prefill_ms": summary(prefill), "kv_transfer_ms": summary(transfer)}


async def kv_bandwidth(tokens: int) -> dict[str, Any]:
    from splitserve.kv.bench import measure_push_bandwidth, memcpy_bandwidth

    nbytes = tokens * 46_080  # SmolLM2-135M fp32 KV per token
    out: dict[str, Any] = {"bytes": nbytes, "memcpy": memcpy_bandwidth(nbytes)}
    for t in ("tcp", "nixl"):
        try:
            out[t] = await measure_push_bandwidth(t, nbytes)
        except Exception as exc:  # report, don't hide: a transport that fails here is a finding
            out[t] = {"error": str(exc)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--control-n", type=int, default=40)
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--nats-url", default=None, help="use a running stack instead of starting one")
    ap.add_argument("--skip-bandwidth", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from splitserve.stackproc import start_stack

    stack = None
    url = args.nats_url
    if url is None:
        state = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
        stack = start_stack(state, "--transport", args.transport, "--disagg-threshold", "512")
        url = stack.nats_url
    try:
        res: dict[str, Any] = {"transport": args.transport}
        res["control_plane"] = asyncio.run(control_plane(url, args.control_n))
        # Warm both paths once (first-use allocations, NIXL peer setup) before measuring.
        asyncio.run(long_prompt(url, "disaggregated", 1, 64, 2, seed=99))
        asyncio.run(long_prompt(url, "direct", 1, 64, 2, seed=98))
        res["direct"] = asyncio.run(long_prompt(url, "direct", args.runs, args.tokens, args.max_tokens, seed=1))
        res["disaggregated"] = asyncio.run(long_prompt(url, "disaggregated", args.runs, args.tokens,
                                                       args.max_tokens, seed=2))
    finally:
        if stack is not None:
            stack.stop()
    if not args.skip_bandwidth:
        res["kv_bandwidth"] = asyncio.run(kv_bandwidth(args.tokens))
    if args.json:
        print(json.dumps(res, indent=2))
        return
    cp = res["control_plane"]
    print(f"control plane (publish -> job start at worker), n={cp['dispatch_ms']['n']}: "
          f"p50 {fmt(cp['dispatch_ms']['p50'])}  p99 {fmt(cp['dispatch_ms']['p99'])}; "
          f"publish -> routed p50 {fmt(cp['publish_to_routed_ms']['p50'])}")
    print(f"\n~{args.tokens}-token prompt, {args.runs} runs, {args.max_tokens} new tokens, transport {args.transport}")
    print(f"{'path':<15}{'TTFT p50':>14}{'TTFT p99':>14}{'ITL p50':>12}{'ITL p99':>12}{'prefill p50':>14}"
          f"{'KV xfer p50':>14}")
    for route in ("direct", "disaggregated"):
        r = res[route]
        print(f"{route:<15}{fmt(r['ttft_ms']['p50']):>14}{fmt(r['ttft_ms']['p99']):>14}"
              f"{fmt(r['itl_ms']['p50']):>12}{fmt(r['itl_ms']['p99']):>12}{fmt(r['prefill_ms']['p50']):>14}"
              f"{fmt(r['kv_transfer_ms']['p50']):>14}")
    if "kv_bandwidth" in res:
        bw = res["kv_bandwidth"]
        print(f"\nKV push of {bw['bytes'] / 1e6:,.1f} MB between two processes (baseline: memcpy of the same bytes)")
        for k in ("memcpy", "tcp", "nixl"):
            v = bw[k]
            if "gbps_median" in v:
                extra = f"  (setup {v['receiver_setup_s']:.2f}s)" if "receiver_setup_s" in v else ""
                print(f"  {k:<8} {v['gbps_median']:6.2f} GB/s median, {v['gbps_best']:6.2f} best{extra}")
            else:
                print(f"  {k:<8} failed: {v.get('error')}")
    print("\n" + json.dumps(res))


if __name__ == "__main__":
    main()
