"""The request book (``splitserve.routing.book``): the flight table and the decoders' slot ledger, shared by the
router service and the simulator. Pure code: every case runs on a hand-set clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.routing.book import LOST_JOB_S, ORPHAN_S, UNCONFIRMED_S, Flight, LossCheck, Move, RequestBook
from splitserve.routing.live import decoder_free_slots

CAP = 8 + 2  # decoder_free_slots of an idle decoder with max_seqs 8


def _flight(rid: str, decoder: str = "d0", prefiller: str | None = None, tenant: str = "t") -> Flight:
    return Flight(request_id=rid, tenant=tenant, decoder=decoder, prefiller=prefiller)


def _book(*decoders: str, running: int = 0) -> RequestBook[Flight]:
    b: RequestBook[Flight] = RequestBook()
    for d in decoders:
        b.heartbeat(d, "decode", [], 0.0, running=running, max_seqs=8)
    return b


def test_a_slot_is_free_again_when_its_request_ends_not_at_the_next_heartbeat() -> None:
    b = _book()
    b.ended("t.z", "d0")  # ended before the heartbeat: listed until its end is stored, not counted in the load
    b.heartbeat("d0", "decode", [f"t.r{i}" for i in range(8)] + ["t.z"], 1.0, running=8, max_seqs=8)
    base = b.free_slots(1.0)
    assert base == CAP - 8
    b.ended("t.r0", "d0")
    b.ended("t.r1", "d0")
    assert b.free_slots(1.1) == base + 2
    for dup, worker in (("t.r1", "d0"), ("t.z", "d0"), ("t.x", "d0"), ("t.o1", "d1")):
        b.ended(dup, worker)  # repeated, from before the heartbeat, never listed, another worker's
    assert b.free_slots(1.2) == base + 2
    b.heartbeat("d0", "decode", [f"t.r{i}" for i in range(2, 8)], 1.5, running=6, max_seqs=8)  # the new truth
    assert b.free_slots(1.5) == base + 2
    b.ended("t.r2", "d0")
    assert b.free_slots(1.6) == base + 3


def test_a_flight_takes_a_slot_once_before_and_after_its_decoder_lists_it() -> None:
    b = _book("d0")
    assert b.free_slots(0.0) == CAP
    f = b.add(_flight("r1"), 0.0)
    assert (f.holder, f.confirmed) == ("d0", False)
    assert b.free_slots(0.0) == CAP - 1  # sent, not in the decoder's figures yet
    assert b.heartbeat("d0", "decode", ["t.r1"], 0.5, running=1, max_seqs=8) == ["t.r1"]
    assert f.confirmed and b.free_slots(0.5) == CAP - 1  # in its figures now: counted once
    assert b.ended("t.r1", "d0") is f and "t.r1" not in b
    assert b.free_slots(0.6) == CAP


def test_a_disaggregated_flight_becomes_its_decoders_when_the_decoder_lists_it() -> None:
    b = _book("d0")
    f = b.add(_flight("r1", prefiller="p0"), 0.0)
    assert f.holder == "p0"
    b.heartbeat("p0", "prefill", ["t.r1"], 0.5)
    assert f.confirmed and f.holder == "p0"
    b.heartbeat("d0", "decode", ["t.r1"], 0.6, running=1, max_seqs=8)
    assert f.holder == "d0"


def test_another_routers_dispatch_takes_a_slot_until_listed_ended_or_its_ttl() -> None:
    b = _book("d0")
    b.remote_dispatched("t.a", "d0", 0.0)
    b.remote_dispatched("t.b", "d0", 0.0)
    b.remote_dispatched("t.c", "d0", 0.5)
    b.remote_dispatched("t.c", "d0", 0.6)  # the same note twice counts once
    assert b.free_slots(0.6) == CAP - 3
    b.heartbeat("d0", "decode", ["t.a"], 0.7, running=1, max_seqs=8)  # its figures count "a" now
    assert b.free_slots(0.7) == CAP - 3
    b.ended("t.b", "d1")  # ended (whoever reported it): its slot is no longer pending
    assert b.free_slots(0.8) == CAP - 2
    assert b.free_slots(1.6) == CAP - 1  # "c" is past the TTL: the decoder's report is the truth again
    assert b.free_slots(1.6) == b.free  # the kept total and the recount agree


def test_an_unready_or_unreachable_decoder_offers_no_slots() -> None:
    b = _book("d0", "d1")
    assert b.free_slots(0.0) == 2 * CAP
    b.heartbeat("d1", "decode", [], 0.5, max_seqs=8, ready=False)  # draining
    assert b.free_slots(0.5) == CAP
    b.unreachable("d0")
    assert b.free_slots(0.5) == 0
    b.heartbeat("d0", "decode", [], 1.0, max_seqs=8)
    assert b.free_slots(1.0) == CAP


def test_a_dead_worker_gives_back_its_flights_with_how_to_move_each() -> None:
    b = _book("d0", "d1")
    on_d0 = b.add(_flight("a", "d0"), 0.0)
    via_p0 = b.add(_flight("b", "d1", prefiller="p0"), 0.0)
    started = b.add(_flight("c", "d1", prefiller="p0"), 0.0)
    started.started = True
    handed = b.add(_flight("e", "d1", prefiller="p0"), 0.0)
    b.heartbeat("d1", "decode", ["t.e"], 0.5, running=1, max_seqs=8)  # KV landed: d1 holds it
    b.add(_flight("late", "d0"), 3.0)  # sent to a new process with the same id
    assert b.worker_lost("p0") == [(via_p0, Move.PREFILLER_FAILED), (handed, Move.PREFILLER_FAILED)]
    moves = b.worker_lost("d0", fresh_since=2.0)
    assert moves == [(on_d0, Move.DECODER_FAILED)]
    assert b.free_slots(3.0) == b.free == CAP - 3  # only d1 offers slots: d0 is gone from the ledger
    b.moved(on_d0, "d1", None, 3.0)
    assert (on_d0.attempt, on_d0.decoder, on_d0.holder, on_d0.confirmed) == (1, "d1", "d1", False)
    assert b.on_decoder("d0") == 1 and b.on_decoder("d1") == 4
    assert b.free_slots(3.0) == CAP - 4


def test_lost_and_orphaned_jobs_are_found_once_per_window() -> None:
    heard: dict[str, float] = {}
    b: RequestBook[Flight] = RequestBook()
    lost = b.add(_flight("lost"), 0.0)
    quiet = b.add(_flight("quiet", "d9"), 0.0)
    held = b.add(_flight("held", "d1"), 0.0)
    b.heartbeat("d1", "decode", ["t.held"], 0.5, max_seqs=8)
    heard.update(d0=LOST_JOB_S + 0.5, d1=0.5)
    assert b.lost(LOST_JOB_S - 0.1, heard.get) == []  # too early to tell
    found = b.lost(LOST_JOB_S + 1.0, heard.get)
    assert [(x.flight, x.check) for x in found] == [(lost, LossCheck.IN_TRANSIT)]  # d0 heartbeats without it
    assert "lost in transit" in found[0].reason
    assert b.lost(LOST_JOB_S + 1.5, heard.get) == []  # checked once per window
    # nobody ever heard d9: not known lost until UNCONFIRMED_S, then it is
    assert [x.flight for x in b.lost(UNCONFIRMED_S + 0.1, heard.get)] == [quiet]
    # "held" was listed at 0.5; d1 keeps heartbeating without it: orphaned after ORPHAN_S
    heard["d1"] = 0.5 + ORPHAN_S
    t = 0.5 + ORPHAN_S + 0.1
    orphaned = [x for x in b.lost(t, heard.get) if x.check is LossCheck.ORPHANED]
    assert [x.flight for x in orphaned] == [held] and orphaned[0].quiet_s >= ORPHAN_S
    # its holder silent as well: the registry decides whether it died, not this check
    b.heartbeat("d1", "decode", ["t.held"], t, max_seqs=8)
    assert [x for x in b.lost(t + ORPHAN_S + 1, heard.get) if x.check is LossCheck.ORPHANED] == []


def test_the_loss_check_waits_after_a_reconnect_and_skips_a_flight_being_moved() -> None:
    b: RequestBook[Flight] = RequestBook()
    late = b.add(_flight("late"), 20.0)
    moving = b.add(_flight("moving"), 20.0)
    moving.migrating = True
    heard = {"d0": 25.0}
    # the connection came back at 23: what was published before may only have arrived then
    assert b.lost(24.0, heard.get, reconnected_at=23.0) == []
    assert [x.flight for x in b.lost(25.5, heard.get, reconnected_at=20.0)] == [late]


def test_a_moved_flight_is_counted_on_its_new_decoder_only() -> None:
    b = _book("d0", "d1")
    f = b.add(_flight("r"), 0.0)
    b.heartbeat("d0", "decode", ["t.r"], 0.5, running=1, max_seqs=8)
    b.moved(f, "d1", None, 1.0)
    assert (b.on_decoder("d0"), b.on_decoder("d1")) == (0, 1)
    assert b.free_slots(1.0) == (CAP - 1) + (CAP - 1)  # d0 still reports it until its next heartbeat
    b.heartbeat("d0", "decode", [], 1.5, running=0, max_seqs=8)
    assert b.free_slots(1.5) == CAP + CAP - 1


def test_stream_deltas_give_what_a_move_resumes_from() -> None:
    f = _flight("r")
    f.delta(0, [1, 2], "ab")
    f.delta(1, [3], "c")
    f.delta(1, [3], "c")  # a repeat changes nothing
    assert (f.tokens, "".join(f.text), f.next_seq, f.tracked, f.started) == ([1, 2, 3], "abc", 2, True, True)
    f.delta(3, [9], "z")  # one went missing: resuming would skip tokens
    assert not f.tracked and f.tokens == [1, 2, 3]


def _recount(b: RequestBook[Flight]) -> int:
    total = 0
    for d in b._decoders.values():
        if d.offered:
            reported = max(0, d.running - d.gone) + d.unlisted + d.remote
            total += decoder_free_slots(d.max_seqs, reported, d.mine, d.pool)
    return total


_ops = st.lists(st.tuples(st.sampled_from(["add", "hb", "end", "move", "lost", "remote", "unreach"]),
                          st.integers(0, 11), st.integers(0, 2), st.integers(0, 9)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_the_kept_slot_total_always_equals_a_recount(ops: list[tuple[str, int, int, int]]) -> None:
    """Whatever order adds, reports, ends, moves, deaths and other routers' notes come in, the total dispatch
    reads (kept as each decoder changes) equals a recount from the ledger, every count stays >= 0, and each
    decoder's count of flights equals the flights on it."""
    b: RequestBook[Flight] = RequestBook(remote_ttl_s=0.3)
    now = 0.0
    for op, r, d, n in ops:
        now += 0.1
        key, dec = f"t.r{r}", f"d{d}"
        if op == "add" and key not in b:
            b.add(_flight(f"r{r}", dec, prefiller="p0" if n % 3 == 0 else None), now)
        elif op == "hb":
            listed = [f.key for f in b if f.decoder == dec and (int(f.request_id[1:]) + n) % 2 == 0]
            b.heartbeat(dec, "decode", listed + [f"t.r{n}"], now, running=n, max_seqs=4 + n, pool="general")
        elif op == "end":
            b.ended(key, dec)
        elif op == "move" and (f := b.get(key)) is not None:
            b.moved(f, dec, None, now)
        elif op == "lost":
            for f, _ in b.worker_lost(dec):
                b.moved(f, f"d{(d + 1) % 3}", None, now)
        elif op == "remote":
            b.remote_dispatched(key, dec, now)
        elif op == "unreach":
            b.unreachable(dec)
        free = b.free_slots(now)
        assert free == b.free == _recount(b) >= 0
        for dd, led in b._decoders.items():
            assert led.mine == sum(1 for f in b if f.decoder == dd)
            assert 0 <= led.unlisted <= led.mine and led.remote >= 0 and led.gone >= 0


def test_a_decoder_whose_heartbeats_time_out_offers_no_slots() -> None:
    b: RequestBook[Flight] = RequestBook()
    b.heartbeat("d0", "decode", [], 0.0, max_seqs=8, live_until=1.5)
    b.heartbeat("d1", "decode", [], 0.0, max_seqs=8, live_until=1.5)
    b.heartbeat("d1", "decode", [], 1.0, max_seqs=8, live_until=2.5)
    assert b.free_slots(1.5) == 2 * CAP  # at the timeout: still live (the registry's rule)
    assert b.free_slots(1.6) == CAP  # d0 went quiet; d1's later report keeps it
    assert b.free_slots(2.6) == 0
    b.heartbeat("d0", "decode", [], 3.0, max_seqs=8, live_until=4.5)  # back
    assert b.free_slots(3.0) == b.free == CAP
