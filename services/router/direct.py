"""The durable queue's fast path: a request intake has just stored is claimed and routed at once when nothing
waits in its model's lanes and one of its decoders has a free slot, instead of when the dispatch loop pulls it
(a loop wake-up and a pull's round trip less before its first token). Accepted still means stored: the request is
in the queue before its caller hears Accepted, and its queue message stays there; the loop pulls it later and
attaches it to the flight (kept alive, acked at the end), or acks it at once when the request already ended.
Only with no other live router, so no other dispatch loop pulls that message while the request runs here.
"""

from __future__ import annotations

import os

from splitserve.obs import tracing
from splitserve.proto import QueuedRequest, RequestRecord
from splitserve.services.router.core import RouterCore


class DirectDispatch(RouterCore):
    """Dispatch by intake, for a request that would not wait in the queue anyway."""

    # Requests intake has decided to dispatch and not yet put in the book: each holds a slot meanwhile (a burst
    # arriving at once would otherwise all see the same free slots).
    _direct_pending = 0

    def _direct_ok(self, pool: str, model: str) -> bool:
        """Whether intake may dispatch a request it has just stored (the queue's fast path): nothing waits in its
        model's lanes (as far as this router knows), one of its decoders has a free slot, and nothing else has a
        say: no contracts (their gate funds each pull), no other live router (its dispatch loop would pull the
        queue message and find the request held), not draining."""
        if self.draining or self.contracts_on:
            return False
        # cheapest first: under load the slots are taken, and the lanes are not scanned at all
        now = self.clock()
        if self.free_slots(now, model) <= self._direct_pending:
            return False
        if any(hb.worker_id != self.worker_id for hb in self.registry.live("router", now)):
            return False
        return pool not in self.wq.pools_waiting()

    async def _dispatch_direct(self, q: QueuedRequest, rec: RequestRecord, rev: int) -> bool:
        """Claim and route a request intake has just stored (its key in ``_claiming``), as the dispatch loop would
        on pulling it. Its queue message stays in the queue: the loop pulls it later and attaches it to the flight,
        or acks it at once when the request already ended (``dropped``). Returns False when the claim lost (the
        loop has it)."""
        req = q.request
        served = self.models.served(req.model)
        # the same router.dispatch span as the loop's (under router.request here): every trace has the same hops
        with tracing.tracer().start_as_current_span("router.dispatch", attributes={
                "request_id": req.request_id, "tenant": req.tenant, "direct": True, "queue_wait_ms": 0.0,
                "deliveries": 0}) as dsp:
            mine = rec.model_copy(update={"state": "dispatched", "owner": self.worker_id, "owner_pid": os.getpid()})
            new_rev = await self.requests.cas(mine, rev)
            if new_rev is None:
                dsp.set_attribute("claimed", False)
                return False
            self.wq.taken(req, served.pool)
            self._rate(req.tenant, "dispatched").add(self.clock())
            dsp.set_attributes(tracing.gen_ai_of(req, served.name))
            inf = await self._route(req, list(q.prompt_token_ids), None, dsp, record=(mine, new_rev))
        if inf is None:  # answered with a terminal error (and settled): its queue message is acked when pulled
            self._drop_queue_message(req.key)
        return True
