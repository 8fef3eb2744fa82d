"""Dispatch from the durable queue: while the request book shows free decode slots, the fair scheduler picks
the tenant, the router pulls its next requests, claims each with one compare-and-set on its registry record,
recovers those whose router died (ended: settle; running: adopt; else run again), and routes it: the policy's
decision becomes a job for the chosen worker(s) and a flight in the book. Un-acked requests no live router
holds are swept up; the queue messages of running ones are kept alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os

import structlog
from nats.aio.msg import Msg
from opentelemetry import trace

from splitserve import proto
from splitserve.obs import tracing
from splitserve.proto import (
    Accepted,
    DecodeJob,
    DispatchNote,
    ErrorCode,
    GenerateRequest,
    QueuedRequest,
    RequestRecord,
    Route,
    Subjects,
    now_ms,
)
from splitserve.routing import NoWorkers
from splitserve.routing.live import dispatch_batch
from splitserve.runtime.bus import identity_refusal
from splitserve.services.router.core import REGISTRY_WARMUP_S, Inflight, RouterCore
from splitserve.services.router.shared import CorruptRecord
from splitserve.tenancy.contracts import Funding

MAX_DELIVERIES = 5  # a request that took down this many routers is failed instead of tried again


class Dispatch(RouterCore):
    """Pulling queued requests while slots are free, claiming, recovering and routing them."""

    async def _dispatch_loop(self) -> None:
        await self._registry_warmup()
        last_refresh = 0.0
        while True:
            try:
                now = self.clock()
                if now - last_refresh > 0.5:
                    await self.wq.refresh()
                    last_refresh = now
                progressed = await self._dispatch_some()
            except Exception as exc:  # a NATS hiccup must not end dispatch
                self.log.exception("dispatch_error", error=str(exc))
                progressed = False
                await asyncio.sleep(0.5)
            if not progressed:
                self._dispatch_wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dispatch_wake.wait(), timeout=0.5)

    async def _dispatch_some(self) -> bool:
        # Each served model's lanes drain only into that model's free decode slots: a model whose decoders are
        # full holds its requests in the queue without holding up another model's.
        progressed = False
        for m in self.models.models:
            while not self.draining and (free := self.free_slots(self.clock(), m.name)) > 0:
                pending = self.wq.pending_by_tenant(m.pool)
                if self.contracts_on:
                    # Contracts: guaranteed-funded tenants first, burst within its caps and the unreserved slots;
                    # one request at a time, so that each is funded as the gate said.
                    picked = self.contracts.pick(pending, free, self.fair.pick, self.clock(),
                                                 functools.partial(self._allowed, model=m.name))
                    if picked is None:
                        break
                    tenant, guaranteed, batch = picked[0], picked[1] is Funding.GUARANTEED, 1
                else:
                    fair = self.fair.pick(pending)
                    if fair is None:
                        break
                    # A few at a time when many slots are free (one round trip to the server for several
                    # requests); few enough that the fair scheduler still decides at a fine grain.
                    tenant, guaranteed, batch = fair, False, dispatch_batch(free)
                qmsgs = await self.wq.fetch(tenant, batch, m.pool)
                if not qmsgs:
                    continue
                progressed = True
                # Each dispatch claims its request with one compare-and-set on the registry: the batch's round
                # trips overlap.
                await asyncio.gather(*(self._dispatch(qmsg, guaranteed) for qmsg in qmsgs))
        return progressed

    def _allowed(self, tenant: str, model: str) -> bool:
        return self.tenants.allows_model(tenant, model)

    async def _dispatch(self, qmsg: Msg, guaranteed: bool = False, pin: str | None = None) -> None:
        """``guaranteed``: the contract gate funded this pull by the tenant's guarantee; ``pin``: the decoder it
        should go to (the one a priority preemption frees a slot on), if that one can take it."""
        try:
            q = proto.decode(qmsg.data, QueuedRequest)
        except proto.ProtocolError as exc:
            self.log.error("queue_message_undecodable", error=exc.message, subject=qmsg.subject)
            await qmsg.term()
            return
        req = q.request
        rid, key = req.request_id, req.key
        if (refusal := identity_refusal(qmsg.subject, q)) is not None:
            # Only routers may write the queue; a message whose body disagrees with its lane was not written by
            # one (or the lane was mis-named): it must not run as the tenant it claims.
            self.log.error("queue_message_forbidden", subject=qmsg.subject, error=refusal)
            await qmsg.term()
            return
        # Checked before any span: a message of a request this router runs or ran (redelivered, or the queue
        # message of one intake dispatched itself) is no dispatch in the request's trace.
        if key in self.inflight:  # redelivered while we still run it (a missed keep-alive), or intake dispatched it
            self.inflight[key].queue_msg = qmsg  # (kept alive and acked with the flight; the newest copy)
            return
        if key in self.dropped:
            await qmsg.ack()
            return
        if key in self._claiming:  # a second copy of a request this router is dispatching right now
            return
        with tracing.span_from(qmsg.headers, "router.dispatch", request_id=rid, tenant=req.tenant) as sp, \
                structlog.contextvars.bound_contextvars(request_id=rid, tenant=req.tenant):
            delivered = int(qmsg.metadata.num_delivered)
            wait_ms = max(0.0, now_ms() - q.accepted_ms)
            tracing.set_attrs(sp, queue_wait_ms=round(wait_ms, 2), deliveries=delivered)
            sp.set_attributes(tracing.gen_ai_of(req, self.models.served(req.model).name))
            self._claiming.add(key)
            try:
                await self._dispatch_claimed(q, qmsg, sp, guaranteed, pin)
            finally:
                self._claiming.discard(key)

    async def _dispatch_claimed(self, q: QueuedRequest, qmsg: Msg, sp: trace.Span, guaranteed: bool = False,
                                pin: str | None = None) -> None:
        req = q.request
        claimed = await self._claim(q, qmsg, sp)
        if claimed is None:
            return
        rec, rev = claimed
        if req.deadline_ms is not None and now_ms() >= req.deadline_ms:
            self._accepted_meta.setdefault(req.key, (req.tenant, req.stream_subject, len(q.prompt_token_ids)))
            await self._end_queued(req.key, "expired", "the deadline passed while the request waited in the queue")
            await self._settle(rec, rev, "expired", len(q.prompt_token_ids))
            await qmsg.ack()
            return
        self._rate(req.tenant, "dispatched").add(self.clock())
        inf = await self._route(req, list(q.prompt_token_ids), None, sp, queue_msg=qmsg, record=(rec, rev),
                                guaranteed=guaranteed, pin=pin)
        if inf is None:
            await qmsg.ack()  # answered with a terminal error (and settled)

    def _owner_alive(self, rec: RequestRecord) -> bool:
        if rec.owner is None:
            return False
        for hb in self.registry.live("router", self.clock()):
            if hb.worker_id == rec.owner:
                return rec.owner_pid is None or hb.pid == rec.owner_pid
        return False

    async def _claim(self, q: QueuedRequest, qmsg: Msg, sp: trace.Span) -> tuple[RequestRecord, int] | None:
        """Win the right to run this request: move its registry record to ``dispatched`` by this router, with
        compare-and-set. Returns the record and its revision, or None when it is not this router's to run (it
        ended, another live router runs it, or it was handled here: adopted from a worker, failed)."""
        req = q.request
        rid = req.request_id
        mine = RequestRecord(request_id=rid, tenant=req.tenant, state="dispatched", stream_subject=req.stream_subject,
                             prompt_tokens=len(q.prompt_token_ids), max_tokens=req.sampling.max_tokens,
                             accepted_ms=q.accepted_ms, deadline_ms=req.deadline_ms, accepted_by=q.router_id,
                             owner=self.worker_id, owner_pid=os.getpid())
        rev: int | None = q.record_revision
        if rev:  # the usual case, one round trip: the record is still as intake left it
            new_rev = await self.requests.cas(mine, rev)
            if new_rev is not None:
                return mine, new_rev
        for _ in range(8):
            try:
                got = await self.requests.get(req.tenant, rid)
            except CorruptRecord as exc:
                # Nothing a router wrote. The queue still holds the request, so it was accepted and has not been
                # settled: recover it as one whose owner died (ended per the usage stream, running per the
                # workers' heartbeats, else run here), replacing the value by compare-and-set on its revision.
                self.log.error("request_record_corrupt", request_id=rid, error=str(exc))
                return await self._recover(q, qmsg, sp, mine.model_copy(update={"owner": None, "owner_pid": None}),
                                           exc.revision, mine)
            if got is None:
                # No record (it outlived the registry's TTL, or an older router queued it): register it now.
                new_rev = await self.requests.create(mine)
                if new_rev is not None:
                    if self.quota.has_dynamic_limits(req.tenant):
                        await self.shared_quota.admit(req.tenant, rid, len(q.prompt_token_ids),
                                                      req.sampling.max_tokens, 0)
                    return mine, new_rev
                continue
            rec, rev = got
            if rec.state == "queued":
                new_rev = await self.requests.cas(mine, rev)
                if new_rev is not None:
                    return mine, new_rev
                continue
            if rec.state == "ended":
                self.log.info("queued_request_already_ended", request_id=rid, status=rec.status)
                await self._settle(rec, 0, rec.status or "ok", rec.used_tokens)  # its quota, if that was missed
                await qmsg.ack()
                return None
            # Dispatched already. By a live router (this message is a second copy, or its owner missed a
            # keep-alive): leave it to that router, un-acked. By a dead one: recover it here.
            warmup = REGISTRY_WARMUP_S - (self.clock() - self._started)
            if warmup > 0:
                await asyncio.sleep(warmup)  # a router that just started first hears every live router
            if self._owner_alive(rec) and not (rec.owner == self.worker_id and rec.owner_pid == os.getpid()):
                self.log.info("request_held_by_live_router", request_id=rid, owner=rec.owner)
                return None
            return await self._recover(q, qmsg, sp, rec, rev, mine)
        self.log.warning("claim_contended", request_id=rid)
        return None

    async def _recover(self, q: QueuedRequest, qmsg: Msg, sp: trace.Span, rec: RequestRecord, rev: int,
                       mine: RequestRecord) -> tuple[RequestRecord, int] | None:
        """A request whose router died after dispatching it: it already ended (settle it), or still runs on a
        worker (adopt it), or failed too often; else dispatch it again (return the record, now ours)."""
        req = q.request
        rid = req.request_id
        done = await self.wq.finished_record(req.tenant, rid)
        if done is not None:
            self.log.info("redelivered_already_finished", request_id=rid, status=done.status)
            used = (done.usage.prompt_tokens + done.usage.completion_tokens) if done.usage is not None else None
            await self._settle(rec, rev, done.status, used)
            await qmsg.ack()
            return None
        new_rev = await self.requests.cas(mine, rev)  # this router owns it from now on
        if new_rev is None:
            self.log.info("recovery_lost_race", request_id=rid)
            return None
        now = self.clock()
        for hb in self.registry.live("decode", now) + self.registry.live("prefill", now):
            if req.key in hb.active_requests:
                self.log.info("redelivered_adopted", request_id=rid, holder=hb.worker_id, previous_owner=rec.owner)
                tracing.set_attrs(sp, adopted_from=hb.worker_id)
                is_decoder = hb.role == "decode"
                self.book.add(Inflight(
                    request_id=rid, tenant=req.tenant, stream_subject=req.stream_subject,
                    decoder=hb.worker_id if is_decoder else "", prefiller=None if is_decoder else hb.worker_id,
                    holder=hb.worker_id, queue_msg=qmsg, record=mine, record_rev=new_rev,
                    confirmed=True), now)  # its worker's heartbeat lists it
                return None
        if int(qmsg.metadata.num_delivered) > MAX_DELIVERIES:
            self._accepted_meta.pop(req.key, None)
            await self._publish_failure(rid, req.tenant, req.stream_subject, ErrorCode.INTERNAL,
                                        f"the request was handed to a router {MAX_DELIVERIES} times and none "
                                        "finished dispatching it", req=req)
            await self._settle(mine, new_rev, "error", None)
            await qmsg.ack()
            return None
        self.log.info("recovered_dispatching", request_id=rid, deliveries=int(qmsg.metadata.num_delivered),
                      previous_owner=rec.owner)
        return mine, new_rev

    async def _redelivery_sweep(self) -> None:
        """Pick up requests whose router died. Dispatch pulls only where requests wait undelivered, so a lane
        whose only messages are un-acked ones held by no live router needs a pull of its own: when more are
        un-acked than this router holds, one pull returns any whose ack wait has run out."""
        while True:
            await asyncio.sleep(max(0.5, self.queue_ack_wait_s / 3))
            held: dict[str, int] = {}
            for inf in self.inflight.values():
                if inf.queue_msg is not None:
                    held[inf.queue_msg.subject] = held.get(inf.queue_msg.subject, 0) + 1
            pools = {m.pool for m in self.models.models}
            for lane in self.wq.lanes():
                if lane.pool not in pools:  # another model's lane: its own routers sweep it
                    continue
                if lane.pending > 0 or lane.ack_pending <= held.get(lane.subject, 0):
                    continue
                try:
                    for qmsg in await self.wq.fetch_redelivered(lane):
                        await self._dispatch(qmsg)
                except Exception as exc:
                    self.log.warning("redelivery_sweep_failed", error=str(exc), lane=lane.subject)

    async def _keepalive(self) -> None:
        """Keep the queue messages of running requests from being redelivered while this router lives."""
        while True:
            await asyncio.sleep(max(0.5, self.queue_ack_wait_s / 3))
            for inf in list(self.inflight.values()):
                if inf.queue_msg is not None:
                    with contextlib.suppress(Exception):
                        await inf.queue_msg.in_progress()

    async def _route(self, req: GenerateRequest, ids: list[int], msg: Msg | None, sp: trace.Span,
                     queue_msg: Msg | None = None, record: tuple[RequestRecord, int] | None = None,
                     guaranteed: bool = False, pin: str | None = None) -> Inflight | None:
        """Decide where the request runs and hand it to the worker(s). With ``msg`` (no queue), answers the
        caller's request; otherwise a failure goes to the request's stream subject. ``guaranteed``: funded by
        its tenant's contract guarantee (prefillers serve it first); ``pin``: on that decoder if it is live."""
        log = self.log.bind(request_id=req.request_id, tenant=req.tenant)
        now = self.clock()
        salt = self._cache_salt(req)
        try:
            decision = self._decide(req, ids, salt, now, pin)
        except NoWorkers as exc:
            if msg is not None:
                await self._reject(req, msg, ErrorCode.NO_WORKERS, str(exc))
            else:
                self._accepted_meta.pop(req.key, None)
                await self._publish_failure(req.request_id, req.tenant, req.stream_subject, ErrorCode.NO_WORKERS,
                                            str(exc), req=req)
                if record is not None:
                    await self._settle(record[0], record[1], "error", None)
            return None
        if msg is not None:
            await self.b.respond(msg, Accepted(request_id=req.request_id, router_id=self.worker_id,
                                               prompt_tokens=len(ids)))
        route = Route(decision.route)
        # Contracts: its tenant's class orders the jobs waiting on a decoder, and with its funding decides whether
        # a more urgent request may preempt it (.preempt).
        klass = self.tenants.priority(req.tenant) if self.contracts_on else 0
        job = DecodeJob(
            request_id=req.request_id, tenant=req.tenant, prompt_token_ids=ids, sampling=req.sampling,
            stream_subject=req.stream_subject, route=route, decoder_id=decision.decoder,
            prefill_worker=decision.prefiller, created_ms=req.created_ms, routed_ms=now_ms(),
            deadline_ms=req.deadline_ms,
            # the policy knows the request by its key (tenant.id); the caller by its id
            decision={**decision.to_dict(), "request_id": req.request_id, "router": self.worker_id},
            stream=req.stream, cache_salt=salt, lora=req.lora, weight=self.tenants.weight(req.tenant),
            guaranteed=guaranteed, priority_class=klass,
        )
        charge = len(ids) + req.sampling.max_tokens
        inf = Inflight(request_id=req.request_id, tenant=req.tenant, stream_subject=req.stream_subject,
                       decoder=decision.decoder, prefiller=decision.prefiller, queue_msg=queue_msg, charged=charge,
                       priority_class=klass, guaranteed=guaranteed)
        if record is not None:
            inf.record, inf.record_rev = record
        self.fair.charge(req.tenant, charge)
        if self.contracts_on:
            self.contracts.dispatched(req.tenant, decision.uncached_tokens, now)
        self.book.add(inf, now)
        inf.trace_ctx = sp.get_span_context() if sp.get_span_context().is_valid else None
        ddict = job.decision
        if self.use_queue and any(hb.worker_id != self.worker_id for hb in self.registry.live("router", now)):
            # The other routers count it on these workers until the workers' heartbeats do. (None live: no note.
            # One that starts now hears the workers' heartbeats during its warm-up, before it routes.)
            ent = self.policy.pending_entries(decision)
            with contextlib.suppress(Exception):
                await self.b.publish(Subjects.routed(self.worker_id), DispatchNote(
                    router_id=self.worker_id, request_id=req.request_id, decoder=ent[0][0],
                    decoder_tokens=ent[0][1], blocks=ent[0][2], prefiller=ent[1][0] if len(ent) > 1 else None,
                    prefiller_tokens=ent[1][1] if len(ent) > 1 else 0, tenant=req.tenant,
                    virtual_tokens=charge / self.fair.weight(req.tenant)))
        # The routing decision, flattened (scalars) and whole (JSON), so a waterfall can show why.
        tracing.set_attrs(sp, prompt_tokens=len(ids), route=str(route.value), decoder=decision.decoder,
                          prefiller=decision.prefiller, decision_json=ddict)
        tracing.set_attrs(sp, "decision.", **{k: v for k, v in ddict.items() if k != "request_id"})
        # The log line says where and why; the whole decision (every candidate's score, the thresholds) is on the
        # span above and in the request's final message (a kilobyte and more per request, rendered and written
        # again here, was the largest part of the stack's log volume).
        log.info("routed", strategy=decision.strategy, route=str(route.value), decoder=decision.decoder,
                 prefiller=decision.prefiller, reason=decision.reason, prompt_tokens=len(ids),
                 cached_tokens=decision.cached_tokens)
        await self._track(inf, req, job)
        await self._send_job(inf, route, decision.decoder, decision.prefiller, job)
        return inf
