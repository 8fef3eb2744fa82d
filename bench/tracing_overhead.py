"""Tracing overhead: requests/s and TTFT of the same workload on a stack with tracing off, then on.

Each phase starts its own ``splitserve up`` (the services read ``SPLITSERVE_TRACING`` at start, so "off" is
passed in the stack's environment) and runs, after a warm-up, sequential requests (TTFT) and a concurrent
burst (requests/s), on the disaggregated path (every hop traced: router, prefill, KV push, decode) unless
``--direct``. Off runs first: this process's own client tracer can be installed but never removed.

    python -m bench.tracing_overhead [--requests 16] [--concurrency 4] [--max-tokens 8] [--json]
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


async def _workload(url: str, n: int, concurrency: int, max_tokens: int, route: str) -> dict[str, Any]:
    from splitserve.client import Client

    async with Client(url, tenant="bench") as c:
        for i in range(3):  # warm-up: model caches, connections, first-span setup
            await c.complete(f"{i} {PROMPT}", max_tokens=max_tokens, route=route)  # type: ignore[arg-type]
        ttfts: list[float] = []
        for i in range(n):
            # A distinct prefix per request so the prefix cache does not turn the prefill into a lookup.
            r = await c.complete(f"{i} seq {PROMPT}", max_tokens=max_tokens, route=route)  # type: ignore[arg-type]
            if r.ttft_ms is not None:
                ttfts.append(r.ttft_ms)
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                await c.complete(f"{i} burst {PROMPT}", max_tokens=max_tokens, route=route)  # type: ignore[arg-type]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        rps = n / (time.perf_counter() - t0)
    return {"ttft_ms": summary(ttfts), "requests_per_s": rps}


def _phase(tracing_on: bool, args: argparse.Namespace) -> dict[str, Any]:
    from splitserve.stackproc import start_stack

    old = os.environ.get("SPLITSERVE_TRACING")
    os.environ["SPLITSERVE_TRACING"] = "on" if tracing_on else "off"  # inherited by the stack and this client
    try:
        with tempfile.TemporaryDirectory(prefix="ss-trace-bench-") as d:
            stack = start_stack(Path(d), "--disagg-threshold", "32")
            try:
                return asyncio.run(_workload(stack.nats_url, args.requests, args.concurrency, args.max_tokens,
                                             "direct" if args.direct else "disaggregated"))
            finally:
                stack.stop()
    finally:
        if old is None:
            os.environ.pop("SPLITSERVE_TRACING", None)
        else:
            os.environ["SPLITSERVE_TRACING"] = old


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--direct", action="store_true", help="direct path instead of disaggregated")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    off = _phase(False, args)
    on = _phase(True, args)
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
