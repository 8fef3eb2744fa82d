"""Sharing with the other routers: their dispatch notes (counted on the workers until the workers' own
heartbeats do), their fair-share charges (one token-fair schedule across routers), and the reconciliation
of quota reservations that a dead router left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.aio.msg import Msg

from splitserve.proto import (
    DispatchNote,
    FairShareReport,
    Subjects,
)
from splitserve.services.router.core import RouterCore
from splitserve.tenancy.contracts import overcommitted

FAIR_REPORT_S = 0.25  # how often a router tells the others what it charged each tenant
RUNNING_RESEND_S = 2.0  # with contracts, a router repeats its running counts at least this often
RUNNING_STALE_S = 3 * RUNNING_RESEND_S  # ... and the others forget them when it has not for this long
CAPACITY_EVERY = 8  # fair reports between two checks of the contracts against the live workers (2 s)
RECONCILE_S = 10.0  # how often a router checks old quota reservations against the request registry
RECONCILE_AFTER_S = 30.0  # reservations younger than this are never questioned (their intake may be running)


class Peers(RouterCore):
    """Dispatch notes and fair-share charges to and from the other routers; quota reconciliation."""

    async def on_dispatch_note(self, note: DispatchNote, _: Msg) -> None:
        if note.router_id == self.worker_id:
            return
        entries = [(note.decoder, note.decoder_tokens, note.blocks)]
        if note.prefiller is not None:
            entries.append((note.prefiller, note.prefiller_tokens, 0))
        now = self.clock()
        self.policy.on_remote_routed(note.key, entries, now)
        self.book.remote_dispatched(note.key, note.decoder, now)
        if note.tenant and note.virtual_tokens:
            recent = self._remote_recent.setdefault(note.router_id, {})
            recent[note.tenant] = recent.get(note.tenant, 0.0) + note.virtual_tokens
            self._apply_remote_fair()

    async def on_fair_report(self, rep: FairShareReport, _: Msg) -> None:
        if rep.incarnation == self.incarnation:
            return
        # Keyed by process: a restarted router reports from zero, and the tokens its previous process charged
        # still count.
        self._remote_fair[(rep.router_id, rep.incarnation)] = rep.virtual_tokens
        # The report includes every dispatch note it sent before it (one connection: NATS keeps their order).
        self._remote_recent.pop(rep.router_id, None)
        self._apply_remote_fair()
        if self.contracts_on:
            self._apply_remote_contracts(rep)

    def _apply_remote_contracts(self, rep: FairShareReport) -> None:
        """Another router's running requests per tenant (its latest report; a silent router's go stale)."""
        now = self.clock()
        self._remote_running[rep.router_id] = (now, rep.running)
        running: dict[str, int] = {}
        for rid, (at, counts) in list(self._remote_running.items()):
            if now - at > RUNNING_STALE_S:
                del self._remote_running[rid]
                continue
            for t, n in counts.items():
                running[t] = running.get(t, 0) + n
        self.contracts.set_remote(running)

    def _apply_remote_fair(self) -> None:
        total: dict[str, float] = {}
        for counters in [*self._remote_fair.values(), *self._remote_recent.values()]:
            for t, v in counters.items():
                total[t] = total.get(t, 0.0) + v
        self.fair.set_remote(total)

    def _check_contracts(self) -> None:
        """Say when the live workers can no longer honour the contracts' guarantees (a decoder died, prefillers
        slowed), and when they can again: ``contracts_overcommitted`` / ``contracts_fit``."""
        now = self.clock()
        decoders = self.registry.live("decode", now)
        prefillers = self.registry.live("prefill", now)
        slots = sum(hb.load.max_seqs or 0 for hb in decoders)
        speeds = [hb.load.prefill_tokens_per_s for hb in prefillers]
        # Prefill capacity is known once every live prefiller has measured its speed.
        rate = sum(s for s in speeds if s is not None) if speeds and None not in speeds else None
        problems = overcommitted(self.tenants.contracts(), slots, rate)
        if problems != self._contract_problems:
            if problems:
                self.log.warning("contracts_overcommitted", problems=problems, decode_slots=slots,
                                 prefill_tokens_per_s=rate)
            elif self._contract_problems:
                self.log.info("contracts_fit", decode_slots=slots, prefill_tokens_per_s=rate)
            self._contract_problems = problems

    async def _fair_reports(self) -> None:
        last: tuple[dict[str, float], dict[str, int]] | None = None
        sent_at = 0.0
        checks = 0
        while True:
            await asyncio.sleep(FAIR_REPORT_S)
            if self.contracts_on and (checks := checks + 1) % CAPACITY_EVERY == 0:
                self._check_contracts()
            virtual = self.fair.virtual()
            running = dict(self.book.by_tenant) if self.contracts_on else {}
            now = self.clock()
            # Sent when something changed, and with contracts at least every RUNNING_RESEND_S: running counts
            # are a level, and a router that stops reporting stops counting.
            if (virtual, running) == last and not (self.contracts_on and now - sent_at > RUNNING_RESEND_S):
                continue
            with contextlib.suppress(Exception):
                await self.b.publish(Subjects.fair(self.worker_id), FairShareReport(
                    router_id=self.worker_id, incarnation=self.incarnation, virtual_tokens=virtual,
                    running=running))
                last, sent_at = (virtual, running), now

    async def _reconcile_quota(self) -> None:
        """Release reservations nobody will finish: a router that died between reserving quota and registering
        the request, or between ending a request and releasing its quota, left them behind."""
        while True:
            await asyncio.sleep(RECONCILE_S)
            for tenant in self.shared_quota.tenants():
                for rid in self.quota.stale(tenant, RECONCILE_AFTER_S, time.time())[:256]:
                    try:
                        got = await self.requests.get(tenant, rid)
                        if got is None or got[0].state == "ended":
                            self.log.info("quota_reservation_reconciled", request_id=rid, tenant=tenant,
                                          record="missing" if got is None else "ended")
                            await self.shared_quota.finish(tenant, rid, got[0].used_tokens if got else None)
                    except Exception as exc:
                        self.log.warning("quota_reconcile_failed", tenant=tenant, error=str(exc))
                        break
