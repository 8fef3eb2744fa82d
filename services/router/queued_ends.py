"""Requests that end while still queued: cancelled (``ss.cancel.{tenant}``), or past their deadline. Every
router hears the cancel and any may hold the request's queue message: the one whose compare-and-set moves
the record from queued to ended sends the final, and dispatch drops the message when it comes up.
"""

from __future__ import annotations

import heapq

from nats.aio.msg import Msg

from splitserve import proto
from splitserve.proto import (
    CancelRequest,
    RequestFinished,
    Route,
    StreamFinal,
    Subjects,
    Usage,
    now_ms,
)
from splitserve.services.router.core import RouterCore


class QueuedEnds(RouterCore):
    """Cancels and deadlines of requests that have not left the queue."""

    async def on_cancel(self, c: CancelRequest, _: Msg) -> None:
        # A dispatched request is stopped by its worker; one still waiting in the queue is ended here, now,
        # and skipped when it reaches dispatch.
        # c.tenant is the tenant the cancel's subject names (the bus refused a body that disagrees): a request
        # of any other tenant is not touched, whatever its id.
        inf = self.inflight.get(c.key)
        if inf is not None:
            inf.cancelled = True  # its worker ends it; a migration in between ends it instead of moving it
            return
        if not self.use_queue:
            if c.key in self._accepted_meta:
                await self._end_queued(c.key, "cancelled", c.reason)
            return
        # Every router hears the cancel and any may hold the request's queue message: the one whose
        # compare-and-set moves the record from queued to ended sends the final; dispatch can no longer win it.
        await self._end_if_queued(c.tenant, c.request_id, "cancelled", c.reason)

    async def _end_if_queued(self, tenant: str, rid: str, reason: str, why: str) -> None:
        try:
            got = await self.requests.get(tenant, rid)
            while got is not None and got[0].state == "queued":
                rec, rev = got
                ended = rec.model_copy(update={"state": "ended", "status": reason,
                                               "used_tokens": rec.prompt_tokens})
                if await self.requests.cas(ended, rev) is not None:
                    self._accepted_meta[rec.key] = (rec.tenant, rec.stream_subject, rec.prompt_tokens)
                    await self._end_queued(rec.key, reason, why)
                    if self.quota.has_dynamic_limits(rec.tenant):
                        await self.shared_quota.finish(rec.tenant, rid, rec.prompt_tokens)
                    return
                got = await self.requests.get(tenant, rid)
        except Exception as exc:
            self.log.warning("end_queued_failed", request_id=rid, reason=reason, error=str(exc))

    async def _expire_queued(self) -> None:
        now = now_ms()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, tenant, rid = heapq.heappop(self._deadlines)
            key = proto.request_key(tenant, rid)
            if key in self._accepted_meta and key not in self.inflight:
                why = "the deadline passed while the request waited in the queue"
                if self.use_queue:
                    self.b.spawn(self._end_if_queued(tenant, rid, "expired", why))
                else:
                    await self._end_queued(key, "expired", why)

    async def _end_queued(self, key: str, reason: str, why: str) -> None:
        tenant, stream_subject, prompt_tokens = self._accepted_meta.pop(key)
        rid = key[len(tenant) + 1:]
        self._drop_queue_message(key)
        self.log.info("queued_request_ended", request_id=rid, tenant=tenant, reason=reason, why=why)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0)
        await self.b.publish(stream_subject, StreamFinal(
            request_id=rid, seq=0, token_ids=[], text="", finish_reason=reason,  # type: ignore[arg-type]
            usage=usage, route=Route.DIRECT, prefill_worker=None, decode_worker="",
            decision={"ended_in_queue": True, "reason": why}))
        await self.b.publish(Subjects.finished(tenant, rid), RequestFinished(
            request_id=rid, tenant=tenant, worker_id=self.worker_id, status=reason,  # type: ignore[arg-type]
            usage=usage))
