"""Failure detection and migration: dead workers (the reaper), jobs lost in transit or orphaned (the book's
``lost`` check), bounced KV hand-offs. A request whose worker is gone is fenced off its old decoder and routed
again over prompt + tokens so far, continuing its stream at the next seq number; after ``max_migrations``
moves it fails with the failure's own code, and one already complete or cancelled ends here.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import structlog
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry import trace

from splitserve.obs import tracing
from splitserve.proto import (
    DecodeJob,
    ErrorCode,
    JobBounced,
    PrefillJob,
    RequestFinished,
    RevokeJob,
    RevokeReply,
    Route,
    StreamFinal,
    Subjects,
    Usage,
    now_ms,
)
from splitserve.routing import NoWorkers
from splitserve.routing.book import Flight, LossCheck, Move
from splitserve.runtime.bus import PayloadTooLarge
from splitserve.services.router.core import Inflight, RouterCore


class Migration(RouterCore):
    """Dead workers, lost jobs and bounced hand-offs: a request moves, or ends with a precise error."""

    async def _reaper(self) -> None:
        seen_reconnects, hold_until = self.b.reconnects, 0.0
        while True:
            await asyncio.sleep(0.25)
            now = self.clock()
            if self.b.reconnects != seen_reconnects:
                # The connection to NATS was down: every worker's heartbeats were missed alike, and they come
                # back over the next interval. Declaring them dead now would move requests that are fine.
                seen_reconnects, hold_until = self.b.reconnects, now + 2 * self.registry.min_timeout_s
            if now < hold_until:
                continue
            for wid, reason in self.registry.reap(self.clock(), observer=self.worker_id):
                self.log.warning("worker_dead", dead_worker=wid, reason=reason)
                self.policy.remove_worker(wid)
                self._worker_lost(wid, reason)
            await self._expire_queued()
            try:
                await self._check_lost_jobs()
            except Exception as exc:  # e.g. SS_USAGE electing a leader: checked again next round
                self.log.warning("lost_job_check_failed", error=str(exc))

    async def _check_lost_jobs(self) -> None:
        """Jobs lost in transit and jobs orphaned after they arrived (the book's ``lost`` check): each is settled
        or sent again by :meth:`_send_again`."""
        workers = self.registry.workers

        def last_heard(wid: str) -> float | None:
            st = workers.get(wid)
            return st.last_seen if st is not None else None

        for lost in self.book.lost(self.clock(), last_heard, self.b.last_reconnect):
            if self.book.get(lost.flight.key) is not lost.flight:
                continue  # ended meanwhile (a settle below ran on_finished)
            fields = {"quiet_s": lost.quiet_s} if lost.check is LossCheck.ORPHANED else {}
            await self._send_again(lost.flight, lost.check.value, lost.reason, **fields)

    async def _send_again(self, inf: Flight, event: str, reason: str, **fields: Any) -> None:
        """A job no worker holds (lost in transit, or orphaned): retired from its stored RequestFinished if it
        ended meanwhile (only its end notice was lost), else sent again as one more attempt (``_migrate``)."""
        done = await self.wq.finished_record(inf.tenant, inf.request_id)
        if done is not None:
            await self.on_finished(done, None)  # type: ignore[arg-type]
            return
        self.log.warning(event, request_id=inf.request_id, worker=inf.holder, **fields)
        assert isinstance(inf, Inflight)
        self.b.spawn(self._migrate(inf, inf.attempt, reason, inf.holder, decoder_failed=False))

    async def on_bounced(self, ev: JobBounced, _: Msg) -> None:
        inf = self.inflight.get(ev.key)
        if inf is None or inf.attempt != ev.attempt:
            return
        self.log.warning("job_bounced", request_id=ev.request_id, worker=ev.worker_id, code=str(ev.code),
                         reason=ev.message)
        if ev.code == ErrorCode.WORKER_DIED and ev.decoder == inf.decoder:
            # The prefiller found the decoder unreachable: do not send the request (or any other) back there on
            # the strength of a heartbeat its process may not outlive (SIGKILLed, restarting): wait for the next.
            self.registry.unreachable(inf.decoder)
            self.book.unreachable(inf.decoder)
        self.b.spawn(self._migrate(inf, inf.attempt, f"{ev.message} (from {ev.worker_id})", ev.worker_id,
                                   decoder_failed=False, code=ev.code))

    def _worker_lost(self, wid: str, reason: str) -> None:
        # A worker id whose process was replaced by a new one: requests routed since the new one appeared are
        # the new process's (a request waiting for a live decoder goes there at once), not the dead one's.
        st = self.registry.workers.get(wid)
        fresh = st.first_seen if st is not None and st.dead_reason is None else float("inf")
        for inf, how in self.book.worker_lost(wid, fresh):
            # a prefiller that died before any output: unless the decoder already has the KV, send it again
            self.b.spawn(self._migrate(inf, inf.attempt, reason, wid, decoder_failed=how is Move.DECODER_FAILED))

    async def _migrate(self, inf: Inflight, attempt: int, reason: str, failed: str, *, decoder_failed: bool,
                       code: ErrorCode = ErrorCode.WORKER_DIED) -> None:
        """Move one attempt of a request to another worker (idempotent per attempt: several signals of the
        same failure move it once)."""
        if self.inflight.get(inf.key) is not inf or inf.attempt != attempt or inf.migrating:
            return
        inf.migrating = True
        try:
            parent = None
            if inf.trace_ctx is not None:
                parent = trace.set_span_in_context(trace.NonRecordingSpan(inf.trace_ctx))
            with tracing.tracer().start_as_current_span("router.migrate", context=parent) as sp, \
                    structlog.contextvars.bound_contextvars(request_id=inf.request_id, tenant=inf.tenant):
                tracing.set_attrs(sp, request_id=inf.request_id, tenant=inf.tenant, failed_worker=failed,
                                  reason=reason, attempt=attempt + 1, resumed_tokens=len(inf.tokens),
                                  start_seq=inf.next_seq, from_decoder=inf.decoder, from_prefiller=inf.prefiller)
                await self._migrate_once(inf, attempt, reason, failed, decoder_failed, sp, code)
        except Exception as exc:  # never leave the caller waiting on a bug here
            self.log.exception("migration_failed", request_id=inf.request_id, error=str(exc))
            if self.inflight.get(inf.key) is inf:
                await self._fail(inf, ErrorCode.INTERNAL, f"{reason}; moving the request failed: {exc}", failed)
        finally:
            inf.migrating = False

    async def _migrate_once(self, inf: Inflight, attempt: int, reason: str, failed: str, decoder_failed: bool,
                            sp: trace.Span, code: ErrorCode = ErrorCode.WORKER_DIED) -> None:
        """``code``: what the request ends with when it cannot be moved again (the failure's own code: a KV
        hand-off that keeps failing is ``kv_transfer_failed``, not a dead worker)."""
        log = self.log.bind(request_id=inf.request_id, tenant=inf.tenant)
        if inf.job is None or inf.request is None or not inf.tracked:
            why = ("adopted after a router restart" if inf.job is None
                   else "a stream message was missed, so the tokens so far are not known exactly")
            tracing.set_attrs(sp, migrated=False, not_movable=why)
            await self._fail(inf, ErrorCode.WORKER_DIED, f"{reason} while serving this request (not moved: {why})",
                             failed)
            return
        # Fence the previous decoder: a dead one does not answer; one only thought dead (or whose prefiller
        # died) drops the attempt, or, when the KV has landed there and it was not the one that failed, keeps it.
        try:
            reply = await self.b.request(Subjects.revoke(inf.decoder), RevokeJob(
                request_id=inf.request_id, tenant=inf.tenant, attempt=attempt, force=decoder_failed,
                reason=reason), RevokeReply, timeout=1.0)
        except (NoRespondersError, NatsTimeout, TimeoutError):
            reply = None
        if isinstance(reply, RevokeReply) and reply.running:
            log.info("migration_not_needed", decoder=inf.decoder, reason=reason)
            tracing.set_attrs(sp, migrated=False, kept_on=inf.decoder)
            self.book.kept_on(inf, inf.decoder)
            return
        await self._move_on(inf, attempt, reason, failed, sp, code)

    async def _move_on(self, inf: Inflight, attempt: int, reason: str, failed: str, sp: trace.Span,
                       code: ErrorCode = ErrorCode.WORKER_DIED) -> None:
        """The attempt is fenced off its decoder: end the request here (cancelled, or complete), fail it (out of
        moves), or route it again over prompt + tokens so far. Also the second half of a priority preemption
        (:mod:`.preempt`)."""
        log = self.log.bind(request_id=inf.request_id, tenant=inf.tenant)
        assert inf.request is not None and inf.job is not None
        if inf.cancelled:
            await self._end_here(inf, "cancelled")
            return
        if len(inf.tokens) >= inf.request.sampling.max_tokens:
            # Its worker stopped between the last token and the final message: the output is complete. (Sent
            # on, a decoder would have to produce at least one token more than max_tokens.)
            tracing.set_attrs(sp, migrated=False, complete=True)
            log.info("ended_without_migration", reason=reason, completion_tokens=len(inf.tokens))
            await self._end_here(inf, "length")
            return
        if attempt - inf.preemptions >= self.max_migrations:  # a preempted request did not fail: not counted
            tracing.set_attrs(sp, migrated=False, exhausted=True)
            await self._fail(inf, code,
                             f"{reason} while serving this request, after {attempt - inf.preemptions} migration(s) "
                             f"(--max-migrations {self.max_migrations})", failed)
            return
        decoders = await self._wait_for_decoders(self.models.served(inf.request.model if inf.request else None).name)
        if self.inflight.get(inf.key) is not inf:
            return
        if not decoders:
            tracing.set_attrs(sp, migrated=False)
            await self._fail(inf, ErrorCode.WORKER_DIED, f"{reason} while serving this request; no live decoder "
                             f"to move it to within {self.no_worker_wait_s:.1f}s", failed)
            return
        req, old = inf.request, inf.job
        context = [*old.prompt_token_ids, *inf.tokens]
        now = self.clock()
        salt = self._cache_salt(req)
        try:
            decision = self._decide(req, context, salt, now)
        except NoWorkers as exc:
            await self._fail(inf, ErrorCode.WORKER_DIED, f"{reason} while serving this request; {exc}", failed)
            return
        route = Route(decision.route)
        ddict = {**decision.to_dict(), "request_id": req.request_id}  # the policy knows it by its key
        job = old.model_copy(update=dict(
            attempt=attempt + 1, resume_token_ids=list(inf.tokens), resume_text="".join(inf.text),
            start_seq=inf.next_seq, route=route, decoder_id=decision.decoder, prefill_worker=decision.prefiller,
            routed_ms=now_ms(), decision=ddict, cache_salt=salt))
        inf.job = job
        self.book.moved(inf, decision.decoder, decision.prefiller, self.clock())
        tracing.set_attrs(sp, migrated=True, route=str(route.value), decoder=decision.decoder,
                          prefiller=decision.prefiller, decision_json=ddict)
        log.warning("migrated", attempt=attempt + 1, failed_worker=failed, reason=reason, decoder=decision.decoder,
                    prefiller=decision.prefiller, resumed_tokens=len(inf.tokens), start_seq=inf.next_seq)
        await self._send_job(inf, route, decision.decoder, decision.prefiller, job)

    async def _send_job(self, inf: Inflight, route: Route, decoder: str, prefiller: str | None,
                        job: DecodeJob) -> None:
        """Publish the job to its prefiller (disaggregated) or its decoder (direct)."""
        try:
            if route is Route.DISAGGREGATED:
                assert prefiller is not None
                await self.b.publish(Subjects.prefill_job(prefiller), PrefillJob(decode=job))
            else:
                await self.b.publish(Subjects.decode_job(decoder), job)
        except PayloadTooLarge as exc:
            await self._fail(inf, ErrorCode.PAYLOAD_TOO_LARGE, str(exc))

    async def _end_here(self, inf: Inflight, reason: Literal["cancelled", "length"]) -> None:
        """End a request whose worker is gone here, with what the caller already has: it was cancelled while
        it had no worker, or its output was already complete."""
        self.book.remove(inf.key)
        job = inf.job
        assert job is not None
        usage = Usage(prompt_tokens=len(job.prompt_token_ids), completion_tokens=len(inf.tokens))
        status: Literal["cancelled", "ok"] = "cancelled" if reason == "cancelled" else "ok"
        await self._retire(inf, usage.prompt_tokens + usage.completion_tokens, status)
        await self.b.publish(inf.stream_subject, StreamFinal(
            request_id=inf.request_id, seq=inf.next_seq, token_ids=list(inf.tokens), text="".join(inf.text),
            finish_reason=reason, usage=usage, route=job.route, prefill_worker=job.prefill_worker,
            decode_worker="", decision=job.decision))
        await self.b.publish(Subjects.finished(inf.tenant, inf.request_id), RequestFinished(
            request_id=inf.request_id, tenant=inf.tenant, worker_id=self.worker_id, status=status, usage=usage,
            route=job.route, finish_reason=reason, model=inf.request.model if inf.request else None, lora=job.lora))
