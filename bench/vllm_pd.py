"""vLLM engine, direct vs disaggregated (NixlConnector), one run, one stack.

Starts ``splitserve up --engine vllm`` (1 prefill + 1 decode worker, each its own vLLM) and measures, on
fresh ~``--tokens``-token prompts (no prefix cache can help):

* TTFT and ITL p50/p99 on the direct path (the decoder's vLLM prefills) and the disaggregated path (the
  prefiller's vLLM prefills with max_tokens=1, the decoder's vLLM pulls the KV over NIXL and decodes);
* the KV transfer per disaggregated request, two ways: vLLM's own NIXL telemetry (transfer duration and
  bytes, logged by the decoder per request), and ``timings.transfer_ms``, the decoder's time from receiving
  the prefiller's kv_transfer_params to its first output (the pull, its bookkeeping and one decode step).

    python -m bench.vllm_pd [--runs 3] [--tokens 1000] [--max-tokens 32] [--nixl-delay-us N] [--json]

``--nixl-delay-us 0`` runs NIXL's stock busy-polling progress thread (the "before" of the idle-spin fix).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from bench.e2e import long_prompt
from bench.stats import fmt, summary

KV_BYTES_PER_TOKEN = 46_080  # SmolLM2-135M, fp32


def nixl_transfers(log: str, runs: int) -> dict[str, Any]:
    """vLLM's own NIXL telemetry for the last ``runs`` disaggregated requests, from the decoder's log."""
    per_request: list[dict[str, Any]] = []
    for line in log.splitlines():
        if '"nixl_transfers"' not in line:
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        per_request.append({"ms": ev.get("total_ms"), "bytes": ev.get("total_bytes"), "transfers": len(ev["ms"])})
    per_request = per_request[-runs:]
    out: dict[str, Any] = {"per_request": per_request}
    if per_request:
        out["ms"] = summary([float(r["ms"]) for r in per_request])
        gbps = [r["bytes"] / 1e9 / (r["ms"] / 1000) for r in per_request if r["ms"]]
        out["gb_per_s_median"] = sorted(gbps)[len(gbps) // 2] if gbps else None
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--nixl-delay-us", type=int, default=None,
                    help="NIXL progress-thread delay in every vLLM process (default 10000; 0 = stock busy poll)")
    ap.add_argument("--nats-url", default=None, help="use a running `splitserve up --engine vllm` stack")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from splitserve.stackproc import start_stack

    if args.nixl_delay_us is not None:
        os.environ["SPLITSERVE_NIXL_PROGRESS_DELAY_US"] = str(args.nixl_delay_us)
    stack = None
    url = args.nats_url
    if url is None:
        state = Path(tempfile.mkdtemp(prefix="bench-vllm-pd-"))
        stack = start_stack(state, "--engine", "vllm", "--prefill", "1", "--decode", "1",
                            "--disagg-threshold", "512", timeout=900)
        url = stack.nats_url
    try:
        res: dict[str, Any] = {"engine": "vllm", "connector": "nixl",
                               "nixl_delay_us": os.environ.get("SPLITSERVE_NIXL_PROGRESS_DELAY_US", "10000")}
        # Warm both paths (first NIXL handshake between the two vLLMs, first-use allocations).
        asyncio.run(long_prompt(url, "disaggregated", 1, 64, 2, seed=99))
        asyncio.run(long_prompt(url, "direct", 1, 64, 2, seed=98))
        res["direct"] = asyncio.run(long_prompt(url, "direct", args.runs, args.tokens, args.max_tokens, seed=1))
        res["disaggregated"] = asyncio.run(long_prompt(url, "disaggregated", args.runs, args.tokens,
                                                       args.max_tokens, seed=2))
        if stack is not None:
            res["disaggregated"]["nixl"] = nixl_transfers(stack.logs("decode-0"), args.runs)
    finally:
        if stack is not None:
            stack.stop(timeout=60)
    d = res["disaggregated"]
    itl = d["itl_ms"]["p50"] or 0.0
    d["kv_bytes_per_request"] = [t * KV_BYTES_PER_TOKEN for t in d["prompt_tokens"]]
    xfer = d["kv_transfer_ms"]["p50"]
    d["kv_pull_ms_est_p50"] = None if xfer is None else max(0.0, xfer - itl)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"vLLM (CPU build) ~{args.tokens}-token prompts, {args.runs} runs, {args.max_tokens} new tokens, "
          f"KV over NixlConnector (progress delay {res['nixl_delay_us']} us)")
    print(f"{'path':<15}{'TTFT p50':>12}{'TTFT p99':>12}{'ITL p50':>11}{'ITL p99':>11}{'prefill p50':>13}"
          f"{'KV xfer p50':>13}")
    for route in ("direct", "disaggregated"):
        r = res[route]
        print(f"{route:<15}{fmt(r['ttft_ms']['p50']):>12}{fmt(r['ttft_ms']['p99']):>12}"
              f"{fmt(r['itl_ms']['p50']):>11}{fmt(r['itl_ms']['p99']):>11}{fmt(r['prefill_ms']['p50']):>13}"
              f"{fmt(r['kv_transfer_ms']['p50']):>13}")
    mb = sum(d["kv_bytes_per_request"]) / max(1, len(d["kv_bytes_per_request"])) / 1e6
    print(f"\nKV transfer per disaggregated request: {fmt(xfer)} (decoder: params received -> first output = "
          f"NIXL pull + one step); pull alone ~{fmt(d['kv_pull_ms_est_p50'])}; {mb:,.1f} MB per request")
    nx = d.get("nixl") or {}
    if nx.get("per_request"):
        r0 = nx["per_request"][-1]
        print(f"vLLM's NIXL telemetry (decoder): transfer p50 {fmt(nx['ms']['p50'])} for "
              f"{r0['bytes'] / 1e6:,.1f} MB in {r0['transfers']} transfer(s), "
              f"{nx['gb_per_s_median'] or 0:.2f} GB/s median")
    print("\n" + json.dumps(res))


if __name__ == "__main__":
    main()
