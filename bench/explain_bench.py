"""What a routing-explorer question costs the router: one dry run of every strategy
(``splitserve.routing.explain``) beside one live ``Router.decide`` (the baseline), on the router's loop.

    python -m bench.explain_bench [--decoders 16 --prefillers 4 --warm 2000 --prompt-tokens 1000]

The live router is warmed with ``--warm`` routed prompts (families of shared prefixes), so prefixaware's
tree and the kvaware index hold what a busy router's would; the dry run deep-copies the live strategy's
small state and shares those indexes, so its cost should stay near a handful of decisions.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from splitserve.cache import PrefixIndex, hash_token_blocks
from splitserve.routing import Router, RoutingRequest, WorkerView
from splitserve.routing.explain import explain


def _prompt(rng: random.Random, n: int, families: int = 50) -> list[int]:
    fam = rng.randrange(families)
    shared = n * 3 // 4
    return [fam * 100_000 + i for i in range(shared)] + [rng.randrange(1 << 30) for _ in range(n - shared)]


def _ms(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"p50 {statistics.median(xs) * 1e3:7.3f} ms  p99 {xs[int(len(xs) * 0.99) - 1] * 1e3:7.3f} ms"


def run(strategy: str, decoders: int, prefillers: int, warm: int, tokens: int, n: int) -> None:
    rng = random.Random(7)
    views = ([WorkerView(f"d{i:02d}", "decode", total_blocks=4096, free_blocks=4096) for i in range(decoders)]
             + [WorkerView(f"p{i:02d}", "prefill") for i in range(prefillers)])
    index = PrefixIndex()
    live = Router(strategy, index=index, disagg_threshold=512)
    for i in range(warm):
        toks = _prompt(rng, tokens)
        d = live.decide(RoutingRequest(f"w{i}", token_ids=toks), views, i * 0.01)
        index.store(d.decoder, hash_token_blocks(toks, live.block_size))  # what its KV events would report
        live.release(f"w{i}")
    prompts = [_prompt(rng, tokens) for _ in range(n)]
    t_decide, t_explain = [], []
    for i, toks in enumerate(prompts):
        now = warm * 0.01 + i * 0.01
        t0 = time.perf_counter()
        explain(live, RoutingRequest("x", token_ids=toks), views, now)
        t1 = time.perf_counter()
        live.decide(RoutingRequest(f"r{i}", token_ids=toks), views, now)
        t2 = time.perf_counter()
        live.release(f"r{i}")
        t_explain.append(t1 - t0)
        t_decide.append(t2 - t1)
    print(f"live {strategy:<11}  decide (baseline): {_ms(t_decide)}   explain all strategies: {_ms(t_explain)}"
          f"   ratio {statistics.median(t_explain) / statistics.median(t_decide):.1f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.explain_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--decoders", type=int, default=16)
    ap.add_argument("--prefillers", type=int, default=4)
    ap.add_argument("--warm", type=int, default=2000)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("-n", type=int, default=200)
    a = ap.parse_args(argv)
    print(f"{a.decoders} decoders + {a.prefillers} prefillers, {a.warm} warm-up prompts of {a.prompt_tokens} tokens, "
          f"{a.n} timed prompts")
    for s in ("kvaware", "prefixaware", "roundrobin", "session"):
        run(s, a.decoders, a.prefillers, a.warm, a.prompt_tokens, a.n)


if __name__ == "__main__":
    main()
