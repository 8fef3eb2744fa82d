"""A tenant's queue lane (its durable consumer on SS_QUEUE, made on its first request) against a real
nats-server: a request the queue stored is accepted even when the lane cannot be made at that moment.

On a 3-node cluster with the stream's leader just killed, one consumer create in a dozen went unanswered for
nats-py's default 5 s (then a timeout) while the new leader was elected. The router used to wait those 5 s in
intake, then answer ``busy`` for a request the queue had already stored (and would run anyway)."""

from __future__ import annotations

from typing import Any

from nats.errors import TimeoutError as NatsTimeout

from splitserve import proto
from splitserve.natsserver import NatsServer
from splitserve.proto import GenerateRequest, QueuedRequest, SamplingParams
from splitserve.runtime.bus import Bus
from splitserve.runtime.workqueue import LANE_CREATE_TIMEOUT_S, WorkQueue


def _queued(tenant: str, rid: str) -> QueuedRequest:
    req = GenerateRequest(request_id=rid, tenant=tenant, prompt="hello", sampling=SamplingParams(max_tokens=4),
                          stream_subject=proto.Subjects.stream(tenant, rid))
    return QueuedRequest(request=req, prompt_token_ids=[1, 2, 3], router_id="router-t")


async def test_a_stored_request_is_accepted_when_its_lane_cannot_be_made_yet(fresh_nats: NatsServer) -> None:
    bus = await Bus.connect(fresh_nats.url, "router-t")
    try:
        wq = WorkQueue(bus, ack_wait_s=30.0)
        await wq.setup()
        real = wq.js.add_consumer
        timeouts: list[Any] = []

        async def unanswered_once(*args: Any, **kw: Any) -> Any:
            timeouts.append(kw.get("timeout"))
            if len(timeouts) == 1:
                raise NatsTimeout  # as while the stream's leader is elected: no answer
            return await real(*args, **kw)

        wq.js.add_consumer = unanswered_once  # type: ignore[method-assign]
        assert await wq.enqueue(_queued("acme", "r1"), "m-1") is True  # stored: accepted
        assert [(lane.tenant, lane.klass) for lane in wq.lanes()] == []
        await wq.refresh()  # the dispatch loop's next pass makes the lane from the stored message
        msgs = await wq.fetch("acme", 1, "m-1")
        assert [proto.decode(m.data, QueuedRequest).request.request_id for m in msgs] == ["r1"]
        assert timeouts == [LANE_CREATE_TIMEOUT_S, LANE_CREATE_TIMEOUT_S]  # never nats-py's 5 s default
        # the same request id re-sent is still a duplicate of the stored one, not a second request
        assert await wq.enqueue(_queued("acme", "r1"), "m-1") is False
    finally:
        await bus.close()


async def test_each_model_pool_has_lanes_of_its_own(fresh_nats: NatsServer) -> None:
    """A model's requests wait in its own lanes: dispatch pulls one model's only while that model has free
    decode slots, so a model whose decoders are full holds none of another model's back."""
    bus = await Bus.connect(fresh_nats.url, "router-t")
    other = await Bus.connect(fresh_nats.url, "router-u")
    try:
        wq = WorkQueue(bus, ack_wait_s=30.0)
        await wq.setup()
        for i in range(3):
            assert await wq.enqueue(_queued("acme", f"a{i}"), "alpha-1")
        assert await wq.enqueue(_queued("acme", "b0"), "beta-2")
        assert wq.pending_by_tenant("alpha-1") == {"acme": 3} and wq.pending_by_tenant("beta-2") == {"acme": 1}
        assert wq.pending_by_tenant() == {"acme": 4} and wq.pools_waiting() == {"alpha-1", "beta-2"}
        got = await wq.fetch("acme", 10, "beta-2")
        assert [proto.decode(m.data, QueuedRequest).request.request_id for m in got] == ["b0"]
        assert await wq.fetch("acme", 10, "gamma-3") == []
        # another router (or one restarted) finds every pool's lanes from the stored messages
        wq2 = WorkQueue(other, ack_wait_s=30.0)
        await wq2.setup()
        assert wq2.pending_by_tenant("alpha-1") == {"acme": 3}
        assert {(lane.tenant, lane.pool, lane.klass) for lane in wq2.lanes()} == {
            ("acme", "alpha-1", 0), ("acme", "beta-2", 0)}
    finally:
        await bus.close()
        await other.close()
