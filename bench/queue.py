"""Throughput of the durable request queue, and what it adds to latency, measured in one run.

Starts a nats-server (JetStream), decode workers running the ``mock`` engine (the control plane is what is
measured here: the mock says so, sleeps a fixed time per batched step, and moves no real model), then runs
the same workload through two routers in turn:

* ``direct``: ``--no-queue``, the router dispatches each request the moment it accepts it (the baseline: no
  durability, no fair share);
* ``queue``: the default, every accepted request is stored in its tenant's JetStream work queue
  (``Nats-Msg-Id`` dedupe) and pulled by the fair scheduler as decode slots free up; acked at finish.

For each it prints: accept latency (client send -> Accepted) and TTFT at low load (one request at a time),
and throughput (requests/s from the first send to the last final, ``--concurrency`` requests outstanding,
over ``--tenants`` tenants). The difference between the two rows is the cost of the durable queue.

Where the cores go during the throughput phase: the CPU time (user + system) of the router, nats-server, the
decoders together and this process (the load generator: the clients), each per routed request (µs/req) and
as a share of the phase's wall time (cores). The router's µs/req is its own cost per request, the figure to
compare between the two rows and between builds; on a small machine the others share its cores.
``--profile-router DIR`` records the router of each mode with py-spy over the throughput phase
(``DIR/router-{mode}.txt``, collapsed stacks: ``python -m bench.pyspy_top`` summarises them).

    python -m bench.queue [--requests 2000] [--concurrency 256] [--seq 100] [--decoders 2] [--max-batch 32]
                         [--step-ms 1] [--profile-router DIR] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.stats import cpu_seconds, fmt, summary
from splitserve.client import Client
from splitserve.natsserver import start_nats
from splitserve.runtime.service import loop_factory
from splitserve.stackproc import spawn_service, wait_ready


def _spawn(module: str, *args: str, url: str, wid: str, logs: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return spawn_service(module, *args, nats_url=url, worker_id=wid, log_dir=logs, env=env)


async def _wait_ready(url: str, wids: list[str], timeout: float = 240.0) -> None:
    await wait_ready(url, wids, timeout=timeout)


async def _low_load(url: str, n: int) -> dict[str, Any]:
    accept, ttft = [], []
    async with Client(url, tenant="lat") as c:
        for i in range(n + 5):
            t0 = time.perf_counter()
            g = c.generate(f"latency probe {i}", max_tokens=2)
            first = None
            async for _ in g:
                if first is None:
                    first = time.perf_counter()
            if i < 5:
                continue  # warm-up
            assert g.result is not None and first is not None
            ttft.append((first - t0) * 1000)
            # created -> dispatched to a worker: the router's share of the wait (intake, queue, pull)
            accept.append(g.result.timings.queue_ms or 0.0)
    return {"ttft": summary(ttft), "queue_ms": summary(accept)}


async def _throughput(url: str, n: int, concurrency: int, tenants: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    clients = [Client(url, tenant=f"tp{i}") for i in range(tenants)]
    for c in clients:
        await c.connect()
    errors = 0

    async def one(i: int) -> None:
        nonlocal errors
        async with sem:
            try:
                await clients[i % tenants].complete(f"throughput {i}", max_tokens=2)
            except Exception:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    took = time.perf_counter() - t0
    for c in clients:
        await c.close()
    return {"requests": n, "seconds": took, "requests_per_s": (n - errors) / took, "errors": errors}


async def _nats_floor(url: str, n: int = 4000) -> dict[str, float]:
    """What nats-py itself costs on this machine, in CPU of one process: a core message (with a traceparent
    header, ~300 bytes) published and delivered to a callback on the same connection, and an awaited
    JetStream publish (a round trip: the publish out, its ack in). The router's messages per request times
    these is the floor no change to the router's own logic can go below."""
    import nats

    nc = await nats.connect(url)
    try:
        got = 0
        done = asyncio.Event()

        async def cb(_: Any) -> None:
            nonlocal got
            got += 1
            if got == n:
                done.set()

        await nc.subscribe("bench.floor", cb=cb)
        payload, hdrs = b"x" * 300, {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
        c0 = time.process_time()
        for i in range(n):
            await nc.publish("bench.floor", payload, headers=hdrs)
            if i % 64 == 63:
                await asyncio.sleep(0)  # let deliveries in, as a service does between messages
        await asyncio.wait_for(done.wait(), 60)
        core_us = (time.process_time() - c0) / n * 1e6
        js = nc.jetstream()
        await js.add_stream(name="BENCH_FLOOR", subjects=["bench.floor.js"], storage="memory")
        m = n // 4
        c0 = time.process_time()
        for _ in range(m):
            await js.publish("bench.floor.js", payload, headers=hdrs)
        js_us = (time.process_time() - c0) / m * 1e6
        await js.delete_stream("BENCH_FLOOR")
    finally:
        await nc.close()
    return {"core_pub_and_deliver_us": core_us, "js_publish_us": js_us}


def _conn_msgs(nats: Any, name_part: str) -> tuple[int, int]:
    """Messages in and out of the connections whose name holds ``name_part``, as nats-server counts them (its
    ``in_msgs`` are what the client published, ``out_msgs`` what it delivered to the client)."""
    pub = got = 0
    for c in nats.connections():
        if name_part in str(c.get("name") or ""):
            pub += int(c.get("in_msgs") or 0)  # type: ignore[call-overload]
            got += int(c.get("out_msgs") or 0)  # type: ignore[call-overload]
    return pub, got


def _cpu_report(before: dict[str, float], after: dict[str, float], requests: int, wall_s: float) -> dict[str, Any]:
    return {name: {"cpu_s": after[name] - before[name], "us_per_req": (after[name] - before[name]) / requests * 1e6,
                   "cores": (after[name] - before[name]) / wall_s} for name in before}


def _profiler(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy on a running process until stopped (SIGINT), collapsed stacks into ``out``."""
    spy = Path(sys.executable).with_name("py-spy")
    return subprocess.Popen([str(spy), "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                             "--output", str(out), "--nonblocking"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--seq", type=int, default=100, help="sequential requests for the low-load latency")
    ap.add_argument("--decoders", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=1.0, help="the mock engine's time per batched step")
    ap.add_argument("--profile-router", type=Path, default=None, metavar="DIR",
                    help="record each router with py-spy over the throughput phase (collapsed stacks in DIR)")
    ap.add_argument("--modes", default="direct,queue", help="which routers to run, in order")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]

    work = Path(tempfile.mkdtemp(prefix="ss-queue-bench-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", SPLITSERVE_MOCK_STEP_MS=str(a.step_ms),
               SPLITSERVE_HOME=str(work / "home"))
    nats = start_nats(work / "nats", monitor=True)
    url = nats.url
    decoders = [_spawn("splitserve.services.decode", "--engine", "mock", "--transport", "tcp", "--max-batch",
                       str(a.max_batch), url=url, wid=f"decode-b{i}", logs=work / "logs", env=env)
                for i in range(a.decoders)]
    results: dict[str, Any] = {"config": vars(a), "machine": f"{os.cpu_count()} cpus"}
    try:
        asyncio.run(_wait_ready(url, [f"decode-b{i}" for i in range(a.decoders)]))
        # on the event loop the services run on (uvloop unless SPLITSERVE_EVENT_LOOP=asyncio)
        results["nats_floor"] = asyncio.Runner(loop_factory=loop_factory()).run(_nats_floor(url))
        for mode in modes:
            flags = ["--no-queue"] if mode == "direct" else []
            router = _spawn("splitserve.services.router", "--disagg-threshold", "1000000000", "--strategy",
                            "roundrobin",
                            *flags, url=url, wid=f"router-{mode}", logs=work / "logs", env=env)
            try:
                asyncio.run(_wait_ready(url, [f"router-{mode}"]))
                time.sleep(2.0)  # the router's dispatch warm-up (it hears every worker first)
                lat = asyncio.run(_low_load(url, a.seq))
                pids = {"router": [router.pid], "nats-server": [nats.proc.pid],
                        "decoders": [p.pid for p in decoders], "load generator": [os.getpid()]}
                spy = None
                if a.profile_router is not None:
                    a.profile_router.mkdir(parents=True, exist_ok=True)
                    spy = _profiler(router.pid, a.profile_router / f"router-{mode}.txt")
                    time.sleep(1.0)  # py-spy attaches
                cpu0, t0, msgs0 = cpu_seconds(pids), time.perf_counter(), _conn_msgs(nats, f"router-{mode}")
                tp = asyncio.run(_throughput(url, a.requests, a.concurrency, a.tenants))
                done = a.requests - tp["errors"] or 1
                cpu = _cpu_report(cpu0, cpu_seconds(pids), done, time.perf_counter() - t0)
                msgs1 = _conn_msgs(nats, f"router-{mode}")
                # (heartbeats and reports of the phase are counted too: a few per second, not per request)
                cpu["router"]["msgs_out_per_req"] = (msgs1[0] - msgs0[0]) / done
                cpu["router"]["msgs_in_per_req"] = (msgs1[1] - msgs0[1]) / done
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(timeout=60)
                results[mode] = {"low_load": lat, "throughput": tp, "cpu": cpu}
            finally:
                router.terminate()
                router.wait(timeout=30)
    finally:
        for p in decoders:
            p.terminate()
        for p in decoders:
            p.wait(timeout=30)
        nats.stop()

    both = "direct" in results and "queue" in results
    if both:
        d, q = results["direct"], results["queue"]
        added_ttft = (q["low_load"]["ttft"]["p50"] or 0) - (d["low_load"]["ttft"]["p50"] or 0)
        results["queue_added_ttft_p50_ms"] = added_ttft
        results["throughput_ratio"] = q["throughput"]["requests_per_s"] / d["throughput"]["requests_per_s"]
    if a.json:
        print(json.dumps(results, indent=2))
        return
    print(f"durable queue vs direct dispatch; mock engine ({a.step_ms} ms/step), {a.decoders} decoders x "
          f"{a.max_batch} slots, {os.cpu_count()} cpus; logs in {work / 'logs'}")
    print(f"{'mode':8} {'TTFT p50':>12} {'TTFT p99':>12} {'router queue p50':>17} {'throughput':>14} {'errors':>7}")
    for mode in modes:
        r = results[mode]
        lt, tp = r["low_load"], r["throughput"]
        print(f"{mode:8} {fmt(lt['ttft']['p50']):>12} {fmt(lt['ttft']['p99']):>12} "
              f"{fmt(lt['queue_ms']['p50']):>17} {tp['requests_per_s']:>9.0f} req/s {tp['errors']:>7}")
    print("CPU during the throughput phase, per routed request (and in cores):")
    for mode in modes:
        cpu = results[mode]["cpu"]
        print(f"{mode:8} " + "  ".join(f"{name} {c['us_per_req']:,.0f} µs ({c['cores']:.2f})"
                                       for name, c in cpu.items()))
    fl = results["nats_floor"]
    per_msg = fl["core_pub_and_deliver_us"] / 2
    print(f"nats-py alone, one process: a core message published and delivered {fl['core_pub_and_deliver_us']:,.0f}"
          f" µs; an awaited JetStream publish {fl['js_publish_us']:,.0f} µs")
    for mode in modes:
        rc = results[mode]["cpu"]["router"]
        n_msgs = rc["msgs_out_per_req"] + rc["msgs_in_per_req"]
        print(f"{mode:8} router NATS messages per request: {rc['msgs_out_per_req']:.1f} out, "
              f"{rc['msgs_in_per_req']:.1f} in; as core messages (~{per_msg:,.0f} µs each) {n_msgs * per_msg:,.0f} µs "
              f"of its {rc['us_per_req']:,.0f} µs, and each awaited JetStream write among them costs "
              f"~{fl['js_publish_us'] - fl['core_pub_and_deliver_us']:,.0f} µs more")
    if not both:
        return
    print(f"durable queue adds {added_ttft:+.1f} ms TTFT p50 at low load; throughput "
          f"{results['throughput_ratio']:.2f}x of direct ({a.requests} requests, {a.concurrency} outstanding, "
          f"{a.tenants} tenants)")


if __name__ == "__main__":
    main()
