"""A repeated long prompt with 2 decode workers: ``kvaware`` vs ``roundrobin``, measured in one run.

For each strategy a fresh stack (1 prefill + 2 decode workers, the real model) gets the same ~2,000-token
prompt twice. kvaware should send the second to the decoder that holds the prompt's KV (reported by the
worker's own KV events), which then prefills only the uncached tail locally: ``cached_tokens`` > 0 and a
much lower TTFT. roundrobin sends it to the other decoder: the prompt goes through the prefiller again
(whose own cache may help) and its KV crosses the transport again.

    python -m bench.kvaware [--tokens 2000] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from bench.e2e import make_prompt
from splitserve.client import Client
from splitserve.stackproc import start_stack


async def _send(url: str, prompt: str, repeats: int) -> list[dict[str, Any]]:
    out = []
    async with Client(url, tenant="bench", idle_timeout=600) as c:
        for i in range(repeats):
            r = await c.complete(prompt, max_tokens=8)
            out.append({"attempt": i + 1, "decoder": r.decode_worker, "route": r.route,
                        "prefill_worker": r.prefill_worker, "cached_tokens": r.usage.cached_tokens,
                        "prompt_tokens": r.usage.prompt_tokens, "ttft_ms": r.ttft_ms,
                        "reason": r.decision.get("reason"), "token_ids": r.token_ids})
            await asyncio.sleep(1.0)  # let the KV events reach the router's index replica
    return out


def run(strategy: str, tokens: int, repeats: int, transport: str) -> list[dict[str, Any]]:
    state = Path(tempfile.mkdtemp(prefix=f"bench-{strategy}-"))
    stack = start_stack(state, "--decode", "2", "--prefill", "1", "--strategy", strategy,
                        "--disagg-threshold", "512", "--transport", transport)
    try:
        prompt = make_prompt(tokens, random.Random(7))
        return asyncio.run(_send(stack.nats_url, prompt, repeats))
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--strategies", default="kvaware,roundrobin")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = {s: run(s, args.tokens, args.repeats, args.transport) for s in args.strategies.split(",")}
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"same ~{args.tokens}-token prompt sent {args.repeats}x; 1 prefill + 2 decode workers; "
          f"transport {args.transport}")
    print(f"{'strategy':<12}{'try':>4}  {'decoder':<10}{'route':<15}{'prefiller':<11}{'cached':>8}"
          f"{'TTFT ms':>10}  reason")
    for s, rows in res.items():
        for r in rows:
            print(f"{s:<12}{r['attempt']:>4}  {r['decoder']:<10}{r['route']:<15}{str(r['prefill_worker']):<11}"
                  f"{r['cached_tokens']:>8}{r['ttft_ms']:>10.1f}  {r['reason']}")
    same = all(rows[0]["token_ids"] == r["token_ids"] for rows in res.values() for r in rows)
    print(f"greedy output identical across all attempts and strategies: {same}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
