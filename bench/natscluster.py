"""What a 3-node NATS JetStream cluster costs in latency, beside a single server measured in the same run.

Starts one nats-server (the baseline) and a 3-node cluster on loopback (``splitserve.natsserver``), and on each:

* ``request``: core request/reply, 1 KB, requester and responder on different nodes in the cluster (one route
  hop each way; on the single server both on it) — what a client's request to the router costs;
* ``publish``: core one-way publish throughput from one client (msgs/s, 1 KB), received on another node;
* ``js publish``: a JetStream publish awaiting its PubAck, 1 KB, into a file-stored stream: R1 on the single
  server, R3 on the cluster (the leader waits for a quorum of 2) — what storing a queued request or a request's
  end costs.

    python -m bench.natscluster [--n 2000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
from nats.js.api import StorageType, StreamConfig

from bench.stats import fmt, summary
from splitserve.natsserver import start_nats, start_nats_cluster
from splitserve.runtime.jetstream import ensure_stream

PAYLOAD = b"x" * 1024


async def _measure(req_url: str, resp_url: str, replicas: int, n: int) -> dict[str, Any]:
    a = await nats.connect(req_url)
    b = await nats.connect(resp_url)
    try:
        async def echo(msg: Any) -> None:
            await msg.respond(msg.data)

        await b.subscribe("bench.echo", cb=echo)
        await b.flush()
        rr: list[float] = []
        for i in range(n + 100):
            t0 = time.perf_counter()
            await a.request("bench.echo", PAYLOAD, timeout=5)
            if i >= 100:
                rr.append((time.perf_counter() - t0) * 1000)

        got = 0
        done = asyncio.Event()
        count = n * 10

        async def sink(_: Any) -> None:
            nonlocal got
            got += 1
            if got >= count:
                done.set()

        await b.subscribe("bench.sink", cb=sink)
        await b.flush()
        t0 = time.perf_counter()
        for _ in range(count):
            await a.publish("bench.sink", PAYLOAD)
        await a.flush()
        await asyncio.wait_for(done.wait(), 60)
        pub_rate = count / (time.perf_counter() - t0)

        js = a.jetstream(timeout=5)
        await ensure_stream(js, StreamConfig(name="BENCH", subjects=["bench.js.>"], storage=StorageType.FILE),
                            replicas)
        jp: list[float] = []
        for i in range(n + 100):
            t0 = time.perf_counter()
            await js.publish(f"bench.js.{i % 16}", PAYLOAD)
            if i >= 100:
                jp.append((time.perf_counter() - t0) * 1000)
        await js.delete_stream("BENCH")
        return {"request_ms": summary(rr), "publish_msgs_per_s": round(pub_rate), "js_publish_ms": summary(jp),
                "replicas": replicas}
    finally:
        await a.close()
        await b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="requests / JetStream publishes per measurement")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-natscluster-") as tmp:
        single = start_nats(Path(tmp) / "single", port=None)
        try:
            base = asyncio.run(_measure(single.url, single.url, 1, args.n))
        finally:
            single.stop()
        cluster = start_nats_cluster(Path(tmp) / "cluster", 3)
        try:
            clus = asyncio.run(_measure(cluster.urls[0], cluster.urls[1], 3, args.n))
        finally:
            cluster.stop()
    out = {"single_server": base, "cluster_3_nodes": clus}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{'':<28}{'single server (R1)':>22}{'3-node cluster (R3)':>24}")
    for label, key in (("request/reply p50", ("request_ms", "p50")), ("request/reply p99", ("request_ms", "p99")),
                       ("JetStream publish p50", ("js_publish_ms", "p50")),
                       ("JetStream publish p99", ("js_publish_ms", "p99"))):
        print(f"{label:<28}{fmt(base[key[0]][key[1]]):>22}{fmt(clus[key[0]][key[1]]):>24}")
    print(f"{'core publish, 1 client':<28}{base['publish_msgs_per_s']:>16,} msg/s"
          f"{clus['publish_msgs_per_s']:>18,} msg/s")


if __name__ == "__main__":
    main()
