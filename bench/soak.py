"""Soak: the whole control plane under steady load for a long time, watching for leaks.

    python -m bench.soak --minutes 20 [--engine mock] [--clients 4] [--sample-s 30] [--json]

Starts its own nats-server (with its monitoring port) and services (bench.chaos's set: 2 routers, 2 prefillers,
3 decoders, the cache index; mock engine by default, a control-plane load test), runs bench.chaos's load
(streaming and async requests from several tenants) with nothing killed, and every ``--sample-s`` records each
service's resident memory, the server's subscriptions and client connections (``/subsz``, ``/connz``) and the
queue stream's durable consumers; also with no client connected, before and after the load (what requests
leave behind shows there, whatever the load's own level). The baseline is the first sample after warm-up
(``--warmup-s``): the report gives each service's RSS then and at the end (growth in MiB and %), the largest
growth, and the counts then and at the end. A leak shows as growth that keeps going; the samples are in
``--json`` for a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import nats
import psutil

from bench import chaos
from splitserve.proto import Subjects
from splitserve.stackproc import wait_ready


def _monitor(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{path}", timeout=5) as r:
        return dict(json.load(r))


async def _sample(cluster: chaos.Cluster, nc: Any, t0: float) -> dict[str, Any]:
    rss: dict[str, float] = {}
    for name, p in [*cluster.procs.items(), ("nats-server", cluster.nats.proc)]:
        try:
            rss[name] = psutil.Process(p.pid).memory_info().rss / 2**20
        except psutil.Error:
            rss[name] = float("nan")
    port = cluster.nats.monitor_port
    assert port is not None
    subsz = await asyncio.to_thread(_monitor, port, "subsz")
    connz = await asyncio.to_thread(_monitor, port, "connz")
    consumers = len(await nc.jetstream().consumers_info(Subjects.QUEUE_STREAM))
    return {"t_s": round(time.monotonic() - t0, 1), "rss_mib": {k: round(v, 1) for k, v in rss.items()},
            "subscriptions": int(subsz.get("num_subscriptions", 0)),
            "connections": int(connz.get("num_connections", 0)), "consumers": consumers}


async def run(minutes: float, clients: int, engine: str, step_ms: int, sample_s: float, warmup_s: float,
              root: Path) -> dict[str, Any]:
    cluster = chaos.Cluster(root, engine, step_ms, monitor=True)
    for n in cluster.names:
        cluster.spawn(n)
    try:
        await wait_ready(cluster.url, cluster.names, timeout=300)
        nc = await nats.connect(cluster.url)
        # A short load first: each tenant's queue lane (a durable consumer and one pull subscription per router)
        # is made on its first request and stays; the idle counts compared below start after that.
        await chaos._load(cluster.url, 10.0, 8, {}, clients)
        await asyncio.sleep(5.0)
        out: dict[str, chaos.Outcome] = {}
        t0 = time.monotonic()
        await _sample(cluster, nc, t0)  # its first JetStream call adds this connection's reply subscription
        idle_before = await _sample(cluster, nc, t0)
        seconds = minutes * 60
        load = asyncio.ensure_future(chaos._load(cluster.url, seconds, 7, out, clients))
        samples: list[dict[str, Any]] = []
        while not load.done():
            await asyncio.sleep(sample_s)
            samples.append({**await _sample(cluster, nc, t0), "requests": len(out)})
            last = samples[-1]
            print(f"  t={last['t_s']:7.1f}s  rss MiB {json.dumps(last['rss_mib'])}  subs {last['subscriptions']}  "
                  f"conns {last['connections']}  consumers {last['consumers']}  requests {len(out)}", flush=True)
        await load
        samples.append({**await _sample(cluster, nc, t0), "requests": len(out)})
        await asyncio.sleep(5.0)  # every client gone, every request settled
        idle_after = await _sample(cluster, nc, t0)
        await nc.close()
        base = next((s for s in samples if s["t_s"] >= warmup_s), samples[0])
        end = samples[-1]
        # requests sent between the baseline sample and the end (each sample notes how many had been sent)
        per = max(1, end["requests"] - base["requests"])
        growth = {k: {"base_mib": base["rss_mib"][k], "end_mib": end["rss_mib"][k],
                      "growth_mib": round(end["rss_mib"][k] - base["rss_mib"][k], 1),
                      "growth_pct": round(100 * (end["rss_mib"][k] / base["rss_mib"][k] - 1), 1),
                      "bytes_per_request": round((end["rss_mib"][k] - base["rss_mib"][k]) * 2**20 / per)}
                  for k in base["rss_mib"]}
        accepted = [o for o in out.values() if o.accepted]
        return {"minutes": minutes, "engine": engine, "clients": clients, "requests": len(out),
                "accepted": len(accepted), "completed": sum(o.completed for o in accepted),
                "baseline_at_s": base["t_s"], "rss": growth,
                "max_growth_pct": max(g["growth_pct"] for g in growth.values()),
                "subscriptions": [base["subscriptions"], end["subscriptions"]],
                "connections": [base["connections"], end["connections"]],
                "consumers": [base["consumers"], end["consumers"]],
                # idle (no client connected) before the load and after it: subscriptions and connections a
                # request leaves behind show here, whatever the load's own level
                "idle_subscriptions": [idle_before["subscriptions"], idle_after["subscriptions"]],
                "idle_connections": [idle_before["connections"], idle_after["connections"]],
                "samples": samples}
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--engine", default="mock", help="mock | hf")
    ap.add_argument("--step-ms", type=int, default=10, help="mock engine decode step")
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=120.0, help="the baseline sample is the first after this")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--state-dir", default=None)
    a = ap.parse_args(argv)
    root = Path(a.state_dir or tempfile.mkdtemp(prefix="ss-soak-"))
    r = asyncio.run(run(a.minutes, a.clients, a.engine, a.step_ms, a.sample_s, a.warmup_s, root))
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{r['minutes']} min, {r['clients']} clients, engine {r['engine']}: {r['requests']} requests, "
          f"{r['accepted']} accepted, {r['completed']} completed")
    print(f"baseline after warm-up: t={r['baseline_at_s']} s")
    for name, g in r["rss"].items():
        print(f"  {name:<14} RSS {g['base_mib']:8.1f} -> {g['end_mib']:8.1f} MiB  ({g['growth_mib']:+.1f} MiB, "
              f"{g['growth_pct']:+.1f}%, {g['bytes_per_request']:+d} B/request)")
    print(f"under load: subscriptions {r['subscriptions'][0]} -> {r['subscriptions'][1]}, connections "
          f"{r['connections'][0]} -> {r['connections'][1]}, queue consumers {r['consumers'][0]} -> {r['consumers'][1]}")
    print(f"idle, before -> after the load: subscriptions {r['idle_subscriptions'][0]} -> "
          f"{r['idle_subscriptions'][1]}, connections {r['idle_connections'][0]} -> {r['idle_connections'][1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
