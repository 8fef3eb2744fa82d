"""The request book: every request one router has dispatched, and the decode slots dispatch may fill.

Pure, synchronous and deterministic: no NATS, no engine, no clock (every call that needs the time takes
``now``). The live router service (``splitserve.services.router``) and the simulator (``splitserve.sim``) drive
the same book, so a request's state changes after dispatch and the pacing of dispatch are written once:

* :meth:`RequestBook.add` - a request was dispatched: its :class:`Flight` enters the book on its workers;
* :meth:`RequestBook.heartbeat` - a worker's report: the flights it holds are confirmed (the job arrived), a
  disaggregated request becomes its decoder's, and a decoder's slot ledger is reset to what it reports;
* :meth:`RequestBook.ended` - a request's end arrived: it leaves the book, and the slot its decoder's last report
  showed taken is offered again at once (not at the next heartbeat, which capped a decoder at about its batch
  size per heartbeat interval);
* :meth:`RequestBook.moved` - one more attempt of a request went to other workers (migration, a lost job);
* :meth:`RequestBook.worker_lost` - the flights a dead worker takes with it, each with how to move it;
* :meth:`RequestBook.lost` - the periodic check for jobs lost in transit or orphaned after they arrived;
* :meth:`RequestBook.free_slots` - how many queued requests dispatch may pull now.

A flight is keyed by ``proto.request_key(tenant, request_id)``: an id is unique only within its tenant. What a
driver needs beyond the pure state (a queue message, a subscription, the request itself) lives on a subclass
of :class:`Flight` (the router's ``Inflight``); the book never looks at it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from splitserve.proto.subjects import request_key
from splitserve.routing.live import decoder_free_slots

__all__ = ["Flight", "LossCheck", "Lost", "Move", "RequestBook"]

# A job is lost in transit when its worker heartbeats this long after it was sent without listing it (the NATS
# node between them died with it in flight: workers list a request until its end is stored) ...
LOST_JOB_S = 2.0
# ... or when no worker reports it at all within this long (sent to a worker that stopped just then).
UNCONFIRMED_S = 5.0
# A job its workers did list is orphaned when none of them has listed it for this long while its holder kept
# heartbeating (about ten beats without it): a hand-off its decoder never got, or any other message lost after
# the job arrived.
ORPHAN_S = 5.0
RECENT_ENDS_KEPT = 20_000  # ends remembered (a heartbeat lags them by at most ~1 s)
REMOTE_TTL_S = 1.0  # another router's dispatch counts on its decoder until listed, ended, or this long


@dataclass(eq=False)
class Flight:
    """One dispatched request as the book sees it. Times are the driver's clock (``now`` of the call)."""

    request_id: str
    tenant: str
    decoder: str
    prefiller: str | None
    holder: str = ""  # the worker currently responsible for it ("" at add: its prefiller, else its decoder)
    charged: int = 0  # tokens the fair scheduler charged at dispatch (the driver settles them at the end)
    attempt: int = 0
    confirmed: bool = False  # a worker of the current attempt reported it (heartbeat or stream): the job arrived
    started: bool = False  # the current attempt's decoder has produced output
    migrating: bool = False  # a move is under way (the driver's): the loss checks leave it alone
    cancelled: bool = False  # a cancel arrived (it may have reached no worker while the request moved)
    sent_at: float = 0.0  # its current attempt sent (or adopted)
    routed_at: float = 0.0  # moved on by the lost-job check (checked once per window)
    listed_at: float = 0.0  # a worker of this attempt last listed it
    # the tokens the caller has received (from the stream the driver follows): what a move resumes from
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    next_seq: int = 0
    tracked: bool = True  # False once a delta was missed: the tokens so far are not known exactly
    # Contracts (the driver's, for priority preemption; the simulator leaves the defaults): its tenant's priority
    # class, whether the contract gate funded it by its tenant's guarantee, and how often it was preempted.
    priority_class: int = 0
    guaranteed: bool = False
    preemptions: int = 0
    _listed_by_decoder: bool = field(default=False, repr=False)  # its decoder has listed this attempt

    @property
    def key(self) -> str:
        return request_key(self.tenant, self.request_id)

    def delta(self, seq: int, token_ids: list[int], text: str) -> None:
        """A stream delta of the current attempt reached the caller (the driver follows the stream)."""
        self.started = self.confirmed = True
        if seq == self.next_seq:
            self.tokens.extend(token_ids)
            self.text.append(text)
            self.next_seq += 1
        elif seq > self.next_seq:
            self.tracked = False  # a delta went missing here: resuming would skip or repeat tokens


class Move(Enum):
    """How a flight leaves a worker that died (:meth:`RequestBook.worker_lost`)."""

    DECODER_FAILED = "decoder_failed"  # its decoder (or its holder, KV landed) is gone: fence it by force
    PREFILLER_FAILED = "prefiller_failed"  # its prefiller died before any output: the KV may never come


class LossCheck(Enum):
    IN_TRANSIT = "job_lost_in_transit"
    ORPHANED = "job_orphaned"


@dataclass(frozen=True)
class Lost:
    """A flight no worker holds, found by :meth:`RequestBook.lost`: settle it from its stored end, else move it."""

    flight: Flight
    check: LossCheck
    quiet_s: float  # how long nobody has reported it

    @property
    def reason(self) -> str:
        f = self.flight
        if self.check is LossCheck.IN_TRANSIT:
            return (f"no worker reported job attempt {f.attempt} (sent to {f.holder}; lost in transit: a NATS node "
                    "died with it in flight, or its worker stopped just then)")
        return (f"job attempt {f.attempt} orphaned: {f.holder} heartbeats without it for {self.quiet_s:.0f}s "
                "(a hand-off or another message lost after the job arrived)")


class _Decoder:
    """One decoder's slot ledger: its last report, and what changed since."""

    __slots__ = ("max_seqs", "pool", "model", "running", "listed", "gone", "mine", "unlisted", "remote", "offered",
                 "slots", "dead", "live_until")

    def __init__(self) -> None:
        self.max_seqs: int | None = None
        self.pool = "general"
        self.model: str | None = None  # the served model it decodes (its slots count for that model's dispatch)
        self.running = 0  # active + queued in its last report
        self.listed: set[str] = set()  # what that report listed, less what ended since
        self.gone = 0  # how many of those ended since
        self.mine = 0  # flights of this book on it
        self.unlisted = 0  # ... that it has not listed yet (its report cannot count them)
        self.remote = 0  # other routers' recent dispatches to it it has not listed yet
        self.offered = False  # heard, ready, and not found unreachable since
        self.slots = 0  # its share of RequestBook.free
        self.dead = False  # reaped: kept only while flights or other routers' dispatches still count on it
        self.live_until: float | None = None  # its heartbeats time out then (None: never)

    def free(self) -> int:
        if not self.offered:
            return 0
        reported = max(0, self.running - self.gone) + self.unlisted + self.remote
        return decoder_free_slots(self.max_seqs, reported, self.mine, self.pool)


F = TypeVar("F", bound=Flight)


class RequestBook(Generic[F]):
    """The flights of one router and the decoders' slot ledger. See the module docstring."""

    def __init__(self, recent_ends_kept: int = RECENT_ENDS_KEPT, remote_ttl_s: float = REMOTE_TTL_S) -> None:
        self.flights: dict[str, F] = {}
        self.by_tenant: dict[str, int] = {}  # flights per tenant (only tenants with some): contract slot meters
        self._decoders: dict[str, _Decoder] = {}
        self.free = 0  # sum of every decoder's offered slots (kept as they change: dispatch asks often)
        self.free_by_model: dict[str | None, int] = {}  # the same per served model
        self._recent_ends: OrderedDict[str, None] = OrderedDict()
        self._recent_ends_kept = recent_ends_kept
        self._remote: deque[tuple[float, str, str]] = deque()  # (at, key, decoder) of other routers' dispatches
        self._remote_live: dict[str, str] = {}  # key -> decoder, while it counts there
        self._remote_ttl_s = remote_ttl_s
        self._expiry: list[tuple[float, str]] = []  # (live_until, decoder) of reports, a heap

    # --- the flight table ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.flights)

    def __contains__(self, key: object) -> bool:
        return key in self.flights

    def __iter__(self) -> Iterator[F]:
        return iter(self.flights.values())

    def get(self, key: str) -> F | None:
        return self.flights.get(key)

    def add(self, f: F, now: float) -> F:
        """A dispatched (or adopted: ``confirmed``) request enters the book on its decoder."""
        if not f.holder:
            f.holder = f.prefiller or f.decoder
        f.sent_at = f.routed_at = f.listed_at = now
        if f.key not in self.flights:
            self.by_tenant[f.tenant] = self.by_tenant.get(f.tenant, 0) + 1
        self.flights[f.key] = f
        self._on(f)
        return f

    def remove(self, key: str) -> F | None:
        """The request left this router (ended, failed, or handed to another router)."""
        f = self.flights.pop(key, None)
        if f is not None:
            self._off(f)
            left = self.by_tenant.get(f.tenant, 0) - 1
            if left > 0:
                self.by_tenant[f.tenant] = left
            else:
                self.by_tenant.pop(f.tenant, None)
        return f

    def moved(self, f: F, decoder: str, prefiller: str | None, now: float) -> None:
        """One more attempt of ``f`` was sent to ``decoder`` (through ``prefiller``)."""
        live = self.flights.get(f.key) is f
        if live:
            self._off(f)
        f.attempt += 1
        f.decoder, f.prefiller = decoder, prefiller
        f.holder = prefiller or decoder
        f.started = f.confirmed = False
        f.sent_at = f.routed_at = f.listed_at = now
        if live:
            self._on(f)

    def kept_on(self, f: F, decoder: str) -> None:
        """A move found the request still running on its decoder (the KV landed there): it stays its holder."""
        f.holder = decoder

    def _on(self, f: F) -> None:
        f._listed_by_decoder = False
        d = self._decoders.get(f.decoder)
        if d is None:
            d = self._decoders[f.decoder] = _Decoder()
        d.mine += 1
        d.unlisted += 1
        self._refresh(d)

    def _off(self, f: F) -> None:
        d = self._decoders.get(f.decoder)
        if d is None:
            return
        d.mine -= 1
        if not f._listed_by_decoder:
            d.unlisted -= 1
        self._refresh(d)
        self._prune(f.decoder, d)

    def _refresh(self, d: _Decoder) -> None:
        new = d.free()
        if new != d.slots:
            self.free += new - d.slots
            self.free_by_model[d.model] = self.free_by_model.get(d.model, 0) + new - d.slots
            d.slots = new

    def _prune(self, worker: str, d: _Decoder) -> None:
        # a dead decoder's ledger goes once nothing counts on it (worker ids may never come back: bounded)
        if d.dead and d.mine == 0 and d.remote == 0:
            del self._decoders[worker]

    # --- what the workers report ---------------------------------------------------------------------------
    def heartbeat(self, worker: str, role: str, listed: Collection[str], now: float, *, running: int = 0,
                  max_seqs: int | None = None, pool: str = "general", ready: bool = True,
                  live_until: float | None = None, model: str | None = None) -> list[str]:
        """A worker's report: ``listed`` the request keys it holds (until each one's end is stored); for a decoder
        ``running`` its active + queued sequences, ``max_seqs`` its batch size, ``ready`` whether it takes work,
        and ``live_until`` when it counts as gone unless it reports again (None: never; the registry's
        heartbeat timeout); ``model`` the served model it decodes (its free slots are that model's). Returns the
        keys of this book's flights it lists (its own load figures count them from now on)."""
        flights = self.flights
        held = [k for k in listed if k in flights]
        for key in held:
            f = flights[key]
            if worker == f.decoder or worker == f.prefiller:
                f.confirmed = True
                f.listed_at = now
            if role == "decode" and worker == f.decoder:
                f.holder = worker  # a request handed from prefiller to decoder is the decoder's now
        if role == "decode":
            d = self._decoders.get(worker)
            if d is None:
                d = self._decoders[worker] = _Decoder()
            ends = self._recent_ends
            # A request whose end arrived before this report is listed only until its end is stored (not in the
            # load figures): it cannot end again here.
            d.listed = {k for k in listed if k not in ends}
            if d.model != model and d.slots:  # (a worker id now serving another model): its slots move along
                self.free_by_model[d.model] -= d.slots
                self.free_by_model[model] = self.free_by_model.get(model, 0) + d.slots
            d.model = model
            d.gone = 0
            d.running, d.max_seqs, d.pool, d.offered, d.dead = running, max_seqs, pool, ready, False
            d.live_until = live_until
            if live_until is not None:
                self._expire_silent(now)  # (also keeps the heap to about one timeout's reports per decoder)
                heapq.heappush(self._expiry, (live_until, worker))
            for key in held:
                f = flights[key]
                if f.decoder == worker and not f._listed_by_decoder:
                    f._listed_by_decoder = True
                    d.unlisted -= 1
            if self._remote_live:
                for key in listed:
                    if self._remote_live.get(key) == worker:
                        del self._remote_live[key]
                        d.remote -= 1
            self._refresh(d)
        return held

    def ended(self, key: str, worker: str) -> F | None:
        """``key``'s end arrived, reported by ``worker``: returns its flight if this book held it."""
        d = self._decoders.get(worker)
        if d is not None and key in d.listed:
            d.listed.discard(key)
            d.gone += 1
            self._refresh(d)
        ends = self._recent_ends
        ends[key] = None
        if len(ends) > self._recent_ends_kept:
            ends.popitem(last=False)
        self._remote_done(key)
        return self.remove(key)

    def unreachable(self, worker: str) -> None:
        """A peer found ``worker`` unreachable: it offers no slots until its next report."""
        d = self._decoders.get(worker)
        if d is not None:
            d.offered = False
            self._refresh(d)

    def worker_lost(self, worker: str, fresh_since: float = float("inf")) -> list[tuple[F, Move]]:
        """``worker`` died: it leaves the slot ledger, and the flights it takes with it are returned with how to
        move each. ``fresh_since``: a worker id whose process was replaced by a new one first heard then -
        flights sent since are the new process's (a request waiting for a live decoder goes there at once)."""
        d = self._decoders.get(worker)
        if d is not None:
            d.offered, d.dead, d.listed, d.running, d.gone = False, True, set(), 0, 0
            self._refresh(d)
            self._prune(worker, d)
        out: list[tuple[F, Move]] = []
        for f in self.flights.values():
            if f.sent_at >= fresh_since:
                continue
            if f.decoder == worker or (f.holder == worker and f.prefiller != worker):
                out.append((f, Move.DECODER_FAILED))
            elif f.prefiller == worker and not f.started:
                out.append((f, Move.PREFILLER_FAILED))
        return out

    def remote_dispatched(self, key: str, decoder: str, now: float) -> None:
        """Another router dispatched ``key`` to ``decoder``: it takes a slot there until the decoder lists it,
        it ends, or ``remote_ttl_s`` passed."""
        self._expire_remote(now)
        if key in self._remote_live or key in self.flights:
            return
        d = self._decoders.get(decoder)
        if d is None:
            d = self._decoders[decoder] = _Decoder()
        self._remote_live[key] = decoder
        self._remote.append((now, key, decoder))
        d.remote += 1
        self._refresh(d)

    def _remote_done(self, key: str) -> None:
        if not self._remote_live:
            return
        dec = self._remote_live.pop(key, None)
        if dec is not None and (d := self._decoders.get(dec)) is not None:
            d.remote -= 1
            self._refresh(d)
            self._prune(dec, d)

    def _expire_remote(self, now: float) -> None:
        q = self._remote
        horizon = now - self._remote_ttl_s
        while q and q[0][0] <= horizon:
            _, key, dec = q.popleft()
            if self._remote_live.get(key) == dec:
                self._remote_done(key)

    # --- decisions -------------------------------------------------------------------------------------------
    def free_slots(self, now: float, model: str | None = None) -> int:
        """Decode slots dispatch may fill now: each heard decoder's batch size (plus a little, so a worker never
        idles between one request finishing and the next arriving) less what it runs (its last report, less the
        listed requests that ended since) or was sent (by this router, or by the others) that its report does
        not show yet. ``model``: of that served model's decoders only (None: all)."""
        self._expire_remote(now)
        self._expire_silent(now)
        return self.free if model is None else self.free_by_model.get(model, 0)

    def _expire_silent(self, now: float) -> None:
        # a decoder whose heartbeats timed out offers nothing (the reaper declares it dead a little later)
        heap = self._expiry
        while heap and heap[0][0] < now:
            _, worker = heapq.heappop(heap)
            d = self._decoders.get(worker)
            if d is not None and d.offered and d.live_until is not None and d.live_until < now:
                d.offered = False
                self._refresh(d)
    def lost(self, now: float, last_heard: Callable[[str], float | None], reconnected_at: float = 0.0) -> list[Lost]:
        """Flights no worker holds, each checked once per window: jobs lost in transit (unconfirmed
        ``LOST_JOB_S`` after they were sent while their worker kept heartbeating, or ``UNCONFIRMED_S`` at all)
        and jobs orphaned after they arrived (confirmed, then unlisted for ``ORPHAN_S`` while their holder kept
        heartbeating). ``last_heard(worker)``: when its last heartbeat came (None: not heard). Nothing published
        before ``reconnected_at`` is known to have arrived (the connection flushed it then)."""
        out: list[Lost] = []
        for f in self.flights.values():
            if f.migrating:
                continue
            if not f.confirmed:
                sent = max(f.routed_at, reconnected_at)
                if now - sent < LOST_JOB_S:
                    continue
                heard_at = last_heard(f.holder)
                heard = heard_at is not None and heard_at > sent + LOST_JOB_S
                if not heard and now - sent < UNCONFIRMED_S:
                    continue  # no heartbeat from its worker since: not known to be lost yet (a dead one is reaped)
                f.routed_at = now
                out.append(Lost(f, LossCheck.IN_TRANSIT, round(now - sent, 1)))
            else:
                listed = max(f.listed_at, reconnected_at)
                if now - listed < ORPHAN_S:
                    continue
                heard_at = last_heard(f.holder)
                if heard_at is None or heard_at < listed + ORPHAN_S / 2:
                    continue  # its holder is not heard from either: whether it died is the registry's call
                f.listed_at = now
                out.append(Lost(f, LossCheck.ORPHANED, round(now - listed, 1)))
        return out

    def on_decoder(self, decoder: str) -> int:
        """How many of this book's flights are on ``decoder``."""
        d = self._decoders.get(decoder)
        return d.mine if d is not None else 0
