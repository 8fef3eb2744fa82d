"""Priority preemption: when the contract gate would dispatch a request now but its model's decoders have no free
slot, the router may take one from a running request of a less urgent class that only burst funds (the victim
rule and its rate limit: :mod:`splitserve.tenancy.preemption`).

The steps, in this order so that the freed slot goes to the request that asked for it:

1. the waiting request is pulled and dispatched *pinned* to the victim's decoder, where it waits first in line
   (``DecodeJob.priority_class``: a decoder admits the most urgent class first);
2. the victim's attempt is revoked there (``RevokeJob`` with ``force``): the decoder drops the sequence, and
   the urgent job takes its place in the batch at once;
3. the victim is moved with the migration machinery (:meth:`~.migration.Migration._move_on`): routed again over
   prompt + tokens so far, its stream continuing at the next seq number (token-identical for greedy and seeded
   sampling). It waits for a slot like any moved request. A preemption is not a failure: it does not count
   against ``--max-migrations``; each request is preempted at most ``PreemptionLimits.max_per_request`` times.

Nothing is lost: a decoder that does not confirm the revoke keeps the victim (if it dropped it after all, the
request book's orphan check moves it). A router that dies between the revoke and the move leaves the victim's
queue message un-acked and its registry record ``dispatched`` by a dead owner: another router recovers it as any
request of a dead router (no worker lists it, so it is dispatched again from its prompt) and the registry's
compare-and-set still lets it end exactly once.

Only with contracts whose tenants' priority classes differ (``preempt_on``); ``--no-preempt`` turns it off.
The router keeps no Prometheus metrics: each preemption is a ``preempted`` log line, a ``router.preempt`` span
(under the victim's trace) and ``preemption.count``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import structlog
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry import trace

from splitserve import proto
from splitserve.obs import tracing
from splitserve.proto import ErrorCode, QueuedRequest, RevokeJob, RevokeReply, Subjects
from splitserve.services.router.core import Inflight
from splitserve.services.router.dispatch import Dispatch
from splitserve.services.router.migration import Migration
from splitserve.services.router.models import ServedModel
from splitserve.tenancy.contracts import Funding
from splitserve.tenancy.preemption import PreemptionGate, PreemptionLimits, Running

PREEMPTED = "preempted by a more urgent request"


class Preempt(Dispatch, Migration):
    """Dispatch that may preempt a less urgent, burst-funded request when a model's decoders are full."""

    def __init__(self, *args: Any, preempt: bool = True, preempt_limits: PreemptionLimits | None = None,
                 **kw: Any) -> None:
        super().__init__(*args, **kw)
        t = self.tenants
        classes = {t.priority(name) for name in t.tenants} | ({t.defaults.priority} if t.open else set())
        # Only where contracts are on and the classes differ: without them nothing here changes anything.
        self.preempt_on = preempt and self.contracts_on and len(classes) > 1
        self.preemption = PreemptionGate(preempt_limits or PreemptionLimits())

    async def _dispatch_some(self) -> bool:
        progressed = await super()._dispatch_some()
        if self.preempt_on:
            for m in self.models.models:
                if not self.draining and self.free_slots(self.clock(), m.name) <= 0 and await self._preempt_for(m):
                    progressed = True
        return progressed

    def _guaranteed_slots(self, tenant: str) -> int:
        c = self.tenants.contract(tenant)
        return c.decode_slots.guaranteed if c is not None and c.decode_slots is not None else 0

    def _preemptible(self) -> Iterator[Running]:
        """This router's flights that the victim rule may consider: movable ones (their job and tokens so far
        known exactly: a non-streaming request would restart from its prompt, so it is never preempted)."""
        for f in self.inflight.values():
            req = f.request
            if f.migrating or f.cancelled or not f.tracked or f.job is None or req is None or not req.stream:
                continue
            yield Running(key=f.key, tenant=f.tenant, priority=f.priority_class,
                          funding=Funding.GUARANTEED if f.guaranteed else Funding.BURST, decoder=f.decoder,
                          generated=len(f.tokens), remaining=req.sampling.max_tokens - len(f.tokens),
                          started_at=f.sent_at, decoding=f.started, preemptions=f.preemptions)

    async def _preempt_for(self, m: ServedModel) -> bool:
        """One preemption on ``m``'s decoders if the gate would dispatch a request now that a victim's slot can
        serve. Returns whether a request was dispatched."""
        now = self.clock()
        if not self.preemption.allows(now):
            return False
        pending = self.wq.pending_by_tenant(m.pool)
        if not any(n > 0 for n in pending.values()):
            return False
        # The request the gate would dispatch into one free slot (its bands, caps and reserved slots hold).
        picked = self.contracts.pick(pending, 1, self.fair.pick, now, functools.partial(self._allowed, model=m.name))
        if picked is None:
            return False
        tenant, funding = picked
        klass = self.tenants.priority(tenant)
        decoders = {hb.worker_id for hb in self._live("decode", m.name, now)}
        victim = self.preemption.victim(klass, decoders, self._preemptible(), self.contracts.running,
                                        self._guaranteed_slots, now)
        if victim is None:
            return False
        inf = self.inflight[victim.key]
        attempt, decoder = inf.attempt, inf.decoder
        qmsgs = await self.wq.fetch(tenant, 1, m.pool)
        if not qmsgs:
            return False
        try:
            key: str | None = proto.decode(qmsgs[0].data, QueuedRequest).request.key
        except proto.ProtocolError:
            key = None  # (_dispatch terminates it)
        await self._dispatch(qmsgs[0], funding is Funding.GUARANTEED, pin=decoder)
        by = self.inflight.get(key) if key is not None else None
        if by is None or by.decoder != decoder:
            return True  # not dispatched here (ended, another router's, no such decoder now): nobody preempted
        if self.inflight.get(inf.key) is not inf or inf.attempt != attempt or inf.migrating or not inf.started:
            return True  # the victim ended or moved meanwhile: its slot is free (or it is already on its way)
        self.preemption.record(inf.key, now)
        inf.migrating = True  # from now on the loss checks and other moves leave it to _preempt
        self.b.spawn(self._preempt(inf, attempt, by, klass))
        return True

    async def _preempt(self, inf: Inflight, attempt: int, by: Inflight, by_class: int) -> None:
        """Revoke the victim's attempt on its decoder and move it on (``inf.migrating`` is set by the caller)."""
        try:
            parent = trace.set_span_in_context(trace.NonRecordingSpan(inf.trace_ctx)) if inf.trace_ctx else None
            with tracing.tracer().start_as_current_span("router.preempt", context=parent) as sp, \
                    structlog.contextvars.bound_contextvars(request_id=inf.request_id, tenant=inf.tenant):
                tracing.set_attrs(sp, request_id=inf.request_id, tenant=inf.tenant, decoder=inf.decoder,
                                  priority_class=inf.priority_class, by_request=by.request_id, by_tenant=by.tenant,
                                  by_class=by_class, resumed_tokens=len(inf.tokens), start_seq=inf.next_seq)
                try:
                    reply = await self.b.request(Subjects.revoke(inf.decoder), RevokeJob(
                        request_id=inf.request_id, tenant=inf.tenant, attempt=attempt, force=True,
                        reason=f"preempted by {by.tenant}/{by.request_id}"), RevokeReply, timeout=1.0)
                except (NoRespondersError, NatsTimeout, TimeoutError):
                    reply = None
                if not (isinstance(reply, RevokeReply) and reply.revoked):
                    # Kept (its final message is being sent), or no answer: it stays where it is. (Had the decoder
                    # dropped it without a word, the book's orphan check moves it.)
                    tracing.set_attrs(sp, preempted=False)
                    self.log.info("preempt_not_done", request_id=inf.request_id, decoder=inf.decoder,
                                  answered=reply is not None)
                    return
                if self.inflight.get(inf.key) is not inf or inf.attempt != attempt:
                    return  # it ended as it was revoked
                inf.preemptions += 1
                tracing.set_attrs(sp, preempted=True, preemptions=inf.preemptions)
                self.log.warning("preempted", request_id=inf.request_id, tenant=inf.tenant,
                                 priority_class=inf.priority_class, by_request=by.request_id, by_tenant=by.tenant,
                                 by_class=by_class, decoder=inf.decoder, resumed_tokens=len(inf.tokens),
                                 preemptions=inf.preemptions)
                await self._move_on(inf, attempt, PREEMPTED, inf.decoder, sp)
        except Exception as exc:  # never leave the caller waiting on a bug here
            self.log.exception("preemption_failed", request_id=inf.request_id, error=str(exc))
            if self.inflight.get(inf.key) is inf:
                await self._fail(inf, ErrorCode.INTERNAL, f"{PREEMPTED}; moving the request failed: {exc}")
        finally:
            inf.migrating = False
