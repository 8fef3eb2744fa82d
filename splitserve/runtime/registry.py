"""Which workers are alive, from their heartbeats. Pure bookkeeping: the caller feeds heartbeats and asks
with an explicit ``now`` (seconds), so the same object works in the live router and in tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.proto import Heartbeat


@dataclass
class WorkerState:
    hb: Heartbeat
    last_seen: float
    first_seen: float
    dead_reason: str | None = None
    was_ready: bool = False  # a worker still loading its model holds no requests: its silence is not a death
    # A peer found it unreachable (no responder on its subjects) since its last heartbeat: not routed to until it
    # heartbeats again. Its last "ready" may be the last word of a process that just died (up to the heartbeat
    # timeout ago), and every request routed there meanwhile would bounce back and forth until out of moves.
    unreachable: bool = False


@dataclass
class WorkerRegistry:
    """Liveness rule: a worker is live while its state is ``ready`` and its last heartbeat is younger than
    ``miss_factor`` heartbeat intervals (at least ``min_timeout_s``)."""

    miss_factor: float = 4.0
    min_timeout_s: float = 1.5
    workers: dict[str, WorkerState] = field(default_factory=dict)
    # Deaths noticed by observe(): a worker id that comes back as a new process before the old one timed out.
    _replaced: list[tuple[str, str]] = field(default_factory=list)

    def observe(self, hb: Heartbeat, now: float) -> None:
        st = self.workers.get(hb.worker_id)
        if st is None or st.hb.pid != hb.pid:
            # New worker, or the same id restarted as a new process. The old process died even if its
            # heartbeats have not timed out yet: report that, or what it held would never be failed.
            if st is not None and st.was_ready and st.dead_reason is None:
                self._replaced.append((hb.worker_id, f"{st.hb.role} worker {hb.worker_id} (pid {st.hb.pid}) died "
                                                     f"and was restarted as pid {hb.pid}"))
            self.workers[hb.worker_id] = WorkerState(hb=hb, last_seen=now, first_seen=now,
                                                     was_ready=hb.state == "ready")
            return
        if hb.seq >= st.hb.seq:
            st.hb = hb
            st.last_seen = now
            st.dead_reason = None
            st.unreachable = False
            st.was_ready = st.was_ready or hb.state == "ready"

    def timeout_for(self, st: WorkerState) -> float:
        return max(self.min_timeout_s, self.miss_factor * st.hb.interval_ms / 1000.0)

    def is_live(self, worker_id: str, now: float) -> bool:
        st = self.workers.get(worker_id)
        return st is not None and self._live(st, now)

    def _live(self, st: WorkerState, now: float) -> bool:
        return st.hb.state == "ready" and not st.unreachable and now - st.last_seen <= self.timeout_for(st)

    def unreachable(self, worker_id: str) -> None:
        """A peer could not reach the worker (no responder on its subjects): not live until its next heartbeat
        (a restarted process under the same id is a new worker and live at once). Not a death: what it holds
        stays where it is, and the heartbeat timeout still decides that."""
        st = self.workers.get(worker_id)
        if st is not None:
            st.unreachable = True

    def live(self, role: str, now: float) -> list[Heartbeat]:
        return [st.hb for st in self.workers.values() if st.hb.role == role and self._live(st, now)]

    def reap(self, now: float, observer: str | None = None) -> list[tuple[str, str]]:
        """Workers that just died (missed heartbeats or announced stop) with a reason; each reported once.

        ``observer``: the caller's own worker id. Its own heartbeats travel through NATS like everyone's; however
        late they look beyond one interval is how long the caller itself was not reading (its event loop or its
        whole machine stalled, heartbeats queued unprocessed), and that much is forgiven every other worker: a
        2 s stall of the observer is not a 2 s silence of the workers.
        """
        lag = 0.0
        me = self.workers.get(observer) if observer else None
        if me is not None:
            lag = max(0.0, now - me.last_seen - me.hb.interval_ms / 1000.0)
        dead, self._replaced = self._replaced, []
        for wid, st in self.workers.items():
            if st.dead_reason is not None or not st.was_ready:
                continue
            # A draining worker still finishes what it holds; only a stopped or silent one has died.
            if st.hb.state == "stopped":
                st.dead_reason = f"{st.hb.role} worker {wid} is {st.hb.state}"
            elif now - st.last_seen - lag > self.timeout_for(st):
                st.dead_reason = (
                    f"{st.hb.role} worker {wid} stopped heartbeating "
                    f"(last seen {now - st.last_seen:.1f}s ago)"
                )
            else:
                continue
            dead.append((wid, st.dead_reason))
        return dead

    def get(self, worker_id: str) -> Heartbeat | None:
        st = self.workers.get(worker_id)
        return st.hb if st else None
