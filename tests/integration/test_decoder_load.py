"""What a decoder's heartbeat says about a request it is prefilling itself (real processes: nats-server, a
router, a mock-engine decoder with a slow prefill).

The heartbeat that lists the request makes the routers stop counting it as their own pending load, so from
then on the decoder's own numbers are all they see. A stream in its local prefill must be in them (as the
simulator's decoder counts its prefilling sequences): left out, the stall rule saw an idle decoder and sent the
next prompt straight to it, beside streams it could not see (a CI failure of the interference test).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import nats
import pytest

from splitserve import proto
from splitserve.client import Client
from splitserve.natsserver import NatsServer
from splitserve.proto import Heartbeat, Subjects
from tests.procs import spawn_service, stop, wait_ready

pytestmark = pytest.mark.slow


async def test_a_request_in_its_local_prefill_counts_as_a_stream_with_its_prefill_queued(
        fresh_nats: NatsServer, tmp_path: Path) -> None:
    url, logs = fresh_nats.url, tmp_path / "logs"
    # ~600 prompt tokens at 200 tokens/s: the local prefill takes ~3 s, several heartbeats (0.5 s apart)
    env = dict(os.environ, SPLITSERVE_MOCK_PREFILL_TPS="200", SPLITSERVE_MOCK_STEP_MS="10")
    procs = [spawn_service("splitserve.services.router", "--disagg-threshold", "1000000000", nats_url=url,
                           worker_id="router-l", log_dir=logs),
             spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp", nats_url=url,
                           worker_id="decode-l", log_dir=logs, env=env)]
    nc = await nats.connect(url)
    try:
        await wait_ready(url, ["router-l", "decode-l"], timeout=180)
        seen: list[Heartbeat] = []

        async def on_hb(msg: object) -> None:
            seen.append(proto.decode(msg.data, Heartbeat))  # type: ignore[attr-defined]

        await nc.subscribe(Subjects.heartbeat("decode", "decode-l"), cb=on_hb)
        async with Client(url, tenant="load", idle_timeout=60) as c:
            gen = c.generate(" ".join(["lorem ipsum dolor"] * 200), max_tokens=4)
            t0 = time.monotonic()
            result = await asyncio.wait_for(gen.collect(), 60)
            took = time.monotonic() - t0
        assert result.finish_reason == "length" and took > 1.5, took  # the prefill was as slow as set
        assert result.usage.prompt_tokens > 400
        listed = [hb for hb in seen if gen.request.key in hb.active_requests]
        assert len(listed) >= 2, [(hb.seq, hb.active_requests) for hb in seen]
        # A request is listed until its final is stored (the bus's unconfirmed terminals), so the last reports
        # may list it after it ended, in no load figure. Up to then, every report that lists it counts it:
        # queued (a moment), then a stream, its local prefill included.
        counts = [hb.load.active_seqs + hb.load.queued_requests for hb in listed]
        ended = next((i for i, n in enumerate(counts) if n == 0), len(counts))
        assert ended >= 2 and counts[:ended] == [1] * ended and not any(counts[ended:]), (
            counts, [hb.load for hb in listed])
        prefilling = [hb for hb in listed if hb.load.active_seqs == 1 and hb.load.queued_prefill_tokens > 0]
        assert prefilling, [hb.load for hb in listed]
        assert all(hb.load.queued_prefill_tokens == result.usage.prompt_tokens for hb in prefilling)
    finally:
        await nc.close()
        stop(*procs)
