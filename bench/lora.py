"""Many LoRA adapters on a few decoders: adapter-affinity routing against round robin, same run.

Two stacks in turn, identical but for the routers' ``--lora-affinity`` (round robin: ``--no-lora-affinity``, every
decoder that may load an adapter is a candidate): the ``mock`` engine (a control-plane load test: no model; each
adapter load costs ``--load-ms`` in the engine, as a load from host memory does on a GPU), 4 decoders with room
for 4 adapters each (``--max-loras 4``), 16 adapters, requests drawn with Zipf popularity, a fixed concurrency.
Reported per arm: adapter loads per request (counted from the decoders' own ``adapter_loaded`` log lines),
TTFT p50/p99, requests per second.

    python -m bench.lora [--adapters 16] [--decoders 4] [--max-loras 4] [--requests 600] [--concurrency 16]
                         [--zipf 1.1] [--load-ms 60] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.stats import fmt, summary
from splitserve.client import Client
from splitserve.stackproc import start_stack


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


async def _drive(url: str, names: list[str], weights: list[float], requests: int, concurrency: int,
                 seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    picks = rng.choices(names, weights=weights, k=requests)
    ttft: list[float] = []
    errors: list[str] = []
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for i, name in enumerate(picks):
        queue.put_nowait((i, name))
    async with Client(url, tenant="bench") as c:
        async def worker() -> None:
            while not queue.empty():
                i, name = queue.get_nowait()
                try:
                    r = await c.complete(f"request {i} for {name}", model=name, max_tokens=16, ignore_eos=True)
                except Exception as exc:  # counted, never hidden
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if r.ttft_ms is not None:
                    ttft.append(r.ttft_ms)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"requests": requests, "errors": len(errors), "first_errors": errors[:3], "wall_s": round(wall, 2),
            "req_per_s": round((requests - len(errors)) / wall, 1), "ttft_ms": summary(ttft)}


def _loads(state: Path) -> int:
    return sum(p.read_text(errors="replace").count('"adapter_loaded"') for p in (state / "logs").glob("decode-*.log"))


def run_arm(affinity: bool, args: argparse.Namespace, names: list[str], weights: list[float]) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix=f"bench-lora-{'aff' if affinity else 'rr'}-"))
    loras = [a for n in names for a in ("--lora-modules", f"{n}=/adapters/{n}")]  # the mock reads no files
    env = dict(os.environ, SPLITSERVE_MOCK_LORA_LOAD_MS=str(args.load_ms), SPLITSERVE_MOCK_STEP_MS=str(args.step_ms))
    sp = start_stack(state, "--engine", "mock", "--transport", "tcp", "--prefill", "0", "--decode",
                     str(args.decoders), "--frontends", "1", "--max-loras", str(args.max_loras), *loras,
                     *([] if affinity else ["--no-lora-affinity"]), env=env)
    try:
        before = _loads(state)  # (none: nothing is loaded before its first request)
        out = asyncio.run(_drive(sp.nats_url, names, weights, args.requests, args.concurrency, args.seed))
        out["adapter_loads"] = _loads(state) - before
    finally:
        sp.stop()
    out["loads_per_request"] = round(out["adapter_loads"] / max(1, args.requests - out["errors"]), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--load-ms", type=float, default=60.0)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    names = [f"lora-{k:02d}" for k in range(args.adapters)]
    weights = zipf_weights(args.adapters, args.zipf)
    result = {"config": vars(args),
              "round_robin": run_arm(False, args, names, weights),
              "affinity": run_arm(True, args, names, weights)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.adapters} adapters (Zipf {args.zipf}), {args.decoders} decoders x {args.max_loras} slots, "
          f"{args.requests} requests at concurrency {args.concurrency}, {args.load_ms:g} ms per adapter load "
          "(mock engine)")
    print(f"{'routing':<12} {'loads/req':>10} {'TTFT p50':>10} {'TTFT p99':>10} {'req/s':>8} {'errors':>7}")
    for arm in ("round_robin", "affinity"):
        r = result[arm]
        print(f"{arm:<12} {r['loads_per_request']:>10} {fmt(r['ttft_ms'].get('p50')):>10} "
              f"{fmt(r['ttft_ms'].get('p99')):>10} {r['req_per_s']:>8} {r['errors']:>7}")
    rr, aff = result["round_robin"], result["affinity"]
    if rr["loads_per_request"]:
        print(f"affinity: {aff['loads_per_request'] / rr['loads_per_request']:.2f}x the adapter loads of round robin")


if __name__ == "__main__":
    main()
