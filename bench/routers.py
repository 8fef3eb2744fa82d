"""Throughput with 1, 2 and 3 router replicas behind one queue, measured in one run (mock engine).

Starts a nats-server (JetStream) and decode workers running the ``mock`` engine (the control plane is what is
measured: the mock sleeps a fixed time per batched step and moves no real model), then for N in ``--routers``
(default 1,2,3) starts N routers sharing the queue, the request registry and the quota buckets, drives the
same closed-loop workload through them (``--concurrency`` requests outstanding over ``--tenants`` tenants) and
stops them. One router is the baseline every row is compared with. ``--limits`` runs the tenants with
``max_inflight`` and ``tokens_per_minute`` set high enough never to refuse, so every request also pays for the
global quota's compare-and-set (the default runs without limits: no quota state at all).

    python -m bench.routers [--routers 1,2,3] [--requests 1500] [--concurrency 128] [--decoders 2]
                           [--max-batch 32] [--step-ms 1] [--limits] [--json]

On a small machine the routers, the decoders, nats-server and the load generator share the same cores, so
more routers cannot add cores: the figure to read is what the shared state costs and that N routers do not
serve less, not a scale-out factor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from splitserve.client import Client
from splitserve.natsserver import start_nats
from splitserve.stackproc import spawn_service, wait_ready


async def _throughput(url: str, n: int, concurrency: int, tenants: int, tag: str) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    clients = [Client(url, tenant=f"tp{i}") for i in range(tenants)]
    for c in clients:
        await c.connect()
    errors: list[str] = []
    routers: dict[str, int] = {}

    async def one(i: int) -> None:
        async with sem:
            try:
                r = await clients[i % tenants].complete(f"{tag} {i}", max_tokens=2)
                rid = str(r.decision.get("router"))
                routers[rid] = routers.get(rid, 0) + 1
            except Exception as exc:
                errors.append(type(exc).__name__)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    took = time.perf_counter() - t0
    for c in clients:
        await c.close()
    return {"requests": n, "seconds": took, "requests_per_s": (n - len(errors)) / took, "errors": len(errors),
            "dispatched_by": routers}


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 60.0) -> None:
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", default="1,2,3")
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--decoders", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=1.0, help="the mock engine's time per batched step")
    ap.add_argument("--limits", action="store_true", help="tenants with (never binding) global quotas")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    counts = [int(x) for x in a.routers.split(",")]

    work = Path(tempfile.mkdtemp(prefix="ss-routers-bench-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", SPLITSERVE_MOCK_STEP_MS=str(a.step_ms),
               SPLITSERVE_HOME=str(work / "home"))
    tenants_args: list[str] = []
    if a.limits:
        tf = work / "tenants.yaml"
        tf.write_text("defaults: {max_inflight: 100000, tokens_per_minute: 1000000000}\ntenants:\n"
                      + "".join(f"  tp{i}: {{}}\n" for i in range(a.tenants)))
        tenants_args = ["--tenants", str(tf)]
    nats = start_nats(work / "nats")
    url = nats.url
    dec_ids = [f"decode-b{i}" for i in range(a.decoders)]
    decoders = [spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp", "--max-batch",
                              str(a.max_batch), nats_url=url, worker_id=w, log_dir=work / "logs", env=env)
                for w in dec_ids]
    results: dict[str, Any] = {"config": vars(a), "machine": f"{os.cpu_count()} cpus", "runs": {}}
    try:
        asyncio.run(wait_ready(url, dec_ids, timeout=240))
        for n in counts:
            ids = [f"router-n{n}-{i}" for i in range(n)]
            routers: list[subprocess.Popen[bytes]] = [
                spawn_service("splitserve.services.router", "--disagg-threshold", "1000000000", "--strategy",
                              "roundrobin",
                              *tenants_args, nats_url=url, worker_id=w, log_dir=work / "logs", env=env)
                for w in ids]
            try:
                asyncio.run(wait_ready(url, ids, timeout=240))
                time.sleep(2.0)  # the routers' dispatch warm-up (each hears every worker first)
                asyncio.run(_throughput(url, 100, a.concurrency, a.tenants, f"warm{n}"))
                results["runs"][str(n)] = asyncio.run(_throughput(url, a.requests, a.concurrency, a.tenants,
                                                                  f"n{n}"))
                r = results["runs"][str(n)]
                print(f"  {n} router(s): {r['requests_per_s']:.0f} req/s, {r['errors']} errors", file=sys.stderr)
            finally:
                _stop(routers)
    finally:
        _stop(decoders)
        nats.stop()

    base = results["runs"][str(counts[0])]["requests_per_s"]
    for r in results["runs"].values():
        r["vs_baseline"] = r["requests_per_s"] / base
    if a.json:
        print(json.dumps(results, indent=2))
        return
    print(f"routed requests/s with N routers behind one queue; mock engine ({a.step_ms} ms/step), {a.decoders} "
          f"decoders x {a.max_batch} slots, {a.requests} requests, {a.concurrency} outstanding, {a.tenants} tenants"
          f"{', global quotas on' if a.limits else ''}; {os.cpu_count()} cpus; logs in {work / 'logs'}")
    print(f"{'routers':>8} {'req/s':>9} {'vs ' + str(counts[0]) + ' router':>12} {'errors':>7}  dispatched by")
    for n in counts:
        r = results["runs"][str(n)]
        print(f"{n:>8} {r['requests_per_s']:>9.0f} {r['vs_baseline']:>11.2f}x {r['errors']:>7}  "
              f"{dict(sorted(r['dispatched_by'].items()))}")


if __name__ == "__main__":
    main()
