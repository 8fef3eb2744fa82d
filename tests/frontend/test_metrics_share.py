"""Several front doors share the counting of request ends: each RequestFinished is counted in the metrics of
exactly one of them (a NATS queue group), so a series summed over the front doors (as Prometheus sums it over
pods, and the shipped dashboard does) is the cluster's figure, not N times it; and every front door still keeps
the cluster's recent rates whole (the console). Real nats-server, two real front doors."""

from __future__ import annotations

import asyncio
import contextlib

import nats
from prometheus_client.parser import text_string_to_metric_families

from splitserve import proto
from splitserve.natsserver import NatsServer
from splitserve.proto import RequestFinished, Subjects
from splitserve.services.frontend.service import FrontendService
from tests.frontend.test_service import frontend, until

ENDS = 40


def _requests_total(svc: FrontendService) -> float:
    return sum(s.value for fam in text_string_to_metric_families(svc.metrics().decode()) for s in fam.samples
               if s.name == "splitserve_requests_total" and s.labels.get("tenant") == "acme")


def _seen(svc: FrontendService) -> float:
    rates = svc.cluster_metrics.snapshot()["tenants"].get("acme", {})
    return round(rates.get("requests_per_s", 0.0) * svc.cluster_metrics.window_s)


async def test_each_request_end_is_counted_by_one_front_door_and_seen_by_all(nats_server: NatsServer) -> None:
    async with contextlib.AsyncExitStack() as stack:
        svcs = [await stack.enter_async_context(frontend(nats_server.url, f"frontend-{i}")) for i in range(2)]
        # a plain connection: a Bus would also store each end in SS_USAGE (no such stream here) and, closing, wait
        # for JetStream to confirm what it never will
        nc = await nats.connect(nats_server.url)
        try:
            for i in range(ENDS):
                await nc.publish(Subjects.finished("acme", f"r{i}"), proto.encode(RequestFinished(
                    request_id=f"r{i}", tenant="acme", worker_id="decode-x", status="ok", route=proto.Route.DIRECT,
                    usage=proto.Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=0),
                    timings=proto.Timings(ttft_server_ms=3.0, total_ms=9.0), itl_ms=[2.0, 2.0, 2.0])))
            await until(lambda: sum(_requests_total(s) for s in svcs) >= ENDS and all(_seen(s) >= ENDS for s in svcs))
            await asyncio.sleep(0.3)  # nothing more arrives: no front door counted an end twice or late
            counts = [_requests_total(s) for s in svcs]
            assert sum(counts) == ENDS, counts  # before: every front door counted every end (2 x ENDS in all)
            assert all(0 < c < ENDS for c in counts), counts  # the work is shared (40 ends all to one: ~2e-12)
            assert [_seen(s) for s in svcs] == [ENDS, ENDS]  # the console's rates stay the cluster's, everywhere
            ratio = [fam for fam in text_string_to_metric_families(svcs[0].metrics().decode())
                     if fam.name == "splitserve_prefix_cache_hit_ratio"]
            assert ratio and ratio[0].samples[0].value == 0.0
        finally:
            await nc.close()
