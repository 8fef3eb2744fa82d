"""The prefill -> decode hand-off message (``PrefillDone`` on ``ss.decode.{worker}.kvready``), delivered at least
once and taken at most once.

It used to be one fire-and-forget publish. In an hour of chaos (3-node NATS cluster, 37 nats-server kills among
145) one was lost in flight: the KV had landed, the decoder held its reservation (and listed the request in
its heartbeats, so no router thought it lost) until the 300 s lease ran out, and the request never ran. Now
the prefiller sends it as a request and again while unanswered (:func:`hand_over`); the decoder answers at
once and takes each transfer only once (:class:`Handoffs`), so a repeat whose first copy did arrive (its
answer was the one lost) runs nothing twice.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from splitserve.proto import PrefillDone, PrefillDoneAck
from splitserve.runtime.bus import Bus

# One try waits this long for the decoder's answer (it answers before doing anything else); the hand-off is
# sent this many times in all. A decoder that is gone (no responders) is not retried: its death moves the request.
ACK_TIMEOUT_S = 2.0
TRIES = 4
# Transfers a decoder remembers having taken (a repeat comes within TRIES * ACK_TIMEOUT_S of the first).
TAKEN_KEPT = 4096


async def hand_over(bus: Bus, subject: str, done: PrefillDone, log: Any) -> bool:
    """Deliver ``done`` to its decoder until it answers; False if it never did (logged)."""
    for attempt in range(1, TRIES + 1):
        try:
            await bus.request(subject, done, PrefillDoneAck, timeout=ACK_TIMEOUT_S)
            if attempt > 1:
                log.warning("handoff_resent", request_id=done.request_id, tries=attempt, subject=subject)
            return True
        except NoRespondersError:
            log.warning("handoff_no_decoder", request_id=done.request_id, subject=subject)
            return False
        except (NatsTimeout, TimeoutError):
            continue
    log.warning("handoff_unanswered", request_id=done.request_id, subject=subject, tries=TRIES)
    return False


def _key(done: PrefillDone) -> str:
    # per request (tenant-scoped key), attempt and transfer: a migrated request's next hand-off is a new one
    return f"{done.decode.key}:{done.decode.attempt}:{done.kv.transfer_id}"


class Handoffs:
    """A decoder's side: answer every hand-off at once, and say whether this one is new."""

    def __init__(self, kept: int = TAKEN_KEPT) -> None:
        self.kept = kept
        self._taken: OrderedDict[str, None] = OrderedDict()

    async def take(self, bus: Bus, done: PrefillDone, msg: Msg) -> bool:
        """Answer the prefiller (an older one, publishing without a reply subject, is not answered) and return
        True the first time this transfer arrives, False for a repeat."""
        if msg.reply:
            await bus.respond(msg, PrefillDoneAck(request_id=done.request_id, transfer_id=done.kv.transfer_id))
        key = _key(done)
        if key in self._taken:
            return False
        self._taken[key] = None
        while len(self._taken) > self.kept:
            self._taken.popitem(last=False)
        return True
