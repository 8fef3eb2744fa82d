"""Tracing overhead: requests/s and TTFT of the same workload on a stack with tracing off, then on.

Two stacks run side by side (``splitserve up`` each; the services read ``SPLITSERVE_TRACING`` at start, so
"off" is passed in one stack's environment). After a warm-up, rounds alternate between them: sequential
requests (TTFT), then a concurrent burst (requests/s), on the disaggregated path (every hop traced:
router, prefill, KV push, decode) unless ``--direct``. Alternating matters on a shared machine: anything
else running loads both sides alike. The benchmark's own client does not trace in either.

    python -m bench.tracing_overhead [--rounds 4] [--requests 6] [--concurrency 3] [--max-tokens 8] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.stats import fmt, summary

PROMPT = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
          "Constantinople. ") * 3 + "Summarise this in one sentence:"


async def _round(c: Any, tag: str, n: int, concurrency: int, max_tokens: int, route: str,
                 ttfts: list[float]) -> tuple[int, float]:
    """n sequential requests (TTFT), then a burst of n at ``concurrency``: (requests, burst seconds)."""
    for i in range(n):
        # A distinct prefix per request so the prefix cache does not turn the prefill into a lookup.
        r = await c.complete(f"{tag} {i} seq {PROMPT}", max_tokens=max_tokens, route=route)
        if r.ttft_ms is not None:
            ttfts.append(r.ttft_ms)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await c.complete(f"{tag} {i} burst {PROMPT}", max_tokens=max_tokens, route=route)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n, time.perf_counter() - t0


async def _measure(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    from splitserve.client import Client

    route = "direct" if args.direct else "disaggregated"
    ttfts: dict[str, list[float]] = {m: [] for m in urls}
    done = {m: 0 for m in urls}
    secs = {m: 0.0 for m in urls}
    clients = {m: await Client(u, tenant="bench").connect() for m, u in urls.items()}
    try:
        for c in clients.values():  # warm-up: model caches, connections, first-span setup
            for i in range(3):
                await c.complete(f"warm {i} {PROMPT}", max_tokens=args.max_tokens, route=route)
        # Alternate the two stacks round by round (and which goes first), so that load from anything else
        # on the machine lands on both alike.
        modes = list(urls)
        for rnd in range(args.rounds):
            for m in modes if rnd % 2 == 0 else modes[::-1]:
                n, dt = await _round(clients[m], f"r{rnd}", args.requests, args.concurrency, args.max_tokens,
                                     route, ttfts[m])
                done[m] += n
                secs[m] += dt
    finally:
        for c in clients.values():
            await c.close()
    return {m: {"ttft_ms": summary(ttfts[m]), "requests_per_s": done[m] / secs[m]} for m in urls}


def _start(tracing_on: bool, state: Path) -> Any:
    from splitserve.stackproc import start_stack

    os.environ["SPLITSERVE_TRACING"] = "on" if tracing_on else "off"  # inherited by the stack's services
    return start_stack(state, "--disagg-threshold", "32")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=6, help="per round: sequential, then as a burst")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--direct", action="store_true", help="direct path instead of disaggregated")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    old = os.environ.get("SPLITSERVE_TRACING")
    with tempfile.TemporaryDirectory(prefix="ss-trace-bench-") as d:
        stacks = {}
        try:
            stacks["off"] = _start(False, Path(d) / "off")
            stacks["on"] = _start(True, Path(d) / "on")
            # This process's client does not trace in either run: the comparison is the services' cost.
            os.environ["SPLITSERVE_TRACING"] = "off"
            res = asyncio.run(_measure({m: s.nats_url for m, s in stacks.items()}, args))
        finally:
            for sp in stacks.values():
                sp.stop()
            if old is None:
                os.environ.pop("SPLITSERVE_TRACING", None)
            else:
                os.environ["SPLITSERVE_TRACING"] = old
    off, on = res["off"], res["on"]
    p50_off, p50_on = off["ttft_ms"]["p50"], on["ttft_ms"]["p50"]
    out = {
        "off": off, "on": on,
        "rps_ratio_on_over_off": on["requests_per_s"] / off["requests_per_s"],
        "ttft_p50_ratio_on_over_off": (p50_on / p50_off) if p50_off and p50_on else None,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{'':14}{'tracing off':>16}{'tracing on':>16}{'on/off':>10}")
    print(f"{'requests/s':14}{off['requests_per_s']:>16.2f}{on['requests_per_s']:>16.2f}"
          f"{out['rps_ratio_on_over_off']:>10.3f}")
    for q in ("p50", "p90", "max"):
        a, b = off["ttft_ms"][q], on["ttft_ms"][q]
        ratio = f"{b / a:>10.3f}" if a and b else f"{'-':>10}"
        print(f"{'TTFT ' + q:14}{fmt(a):>16}{fmt(b):>16}{ratio}")
    cost = 1 - out["rps_ratio_on_over_off"]
    print(f"\nthroughput cost of tracing: {cost * 100:+.1f}% (target < 5%)")


if __name__ == "__main__":
    main()
