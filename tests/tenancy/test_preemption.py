"""The victim rule of priority preemption (splitserve.tenancy.preemption), pure: never a guaranteed flight nor one
of a tenant inside its guarantee, never a same-or-more-urgent class, the preference order, and the rate limit."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.tenancy.contracts import Funding
from splitserve.tenancy.preemption import PreemptionGate, PreemptionLimits, Running, choose_victim

DEC = {"d0", "d1"}


def _f(key: str, *, tenant: str = "bulk", priority: int = 5, funding: Funding = Funding.BURST, decoder: str = "d0",
       generated: int = 20, remaining: int = 100, started_at: float = 0.0, decoding: bool = True,
       preemptions: int = 0) -> Running:
    return Running(key=key, tenant=tenant, priority=priority, funding=funding, decoder=decoder, generated=generated,
                   remaining=remaining, started_at=started_at, decoding=decoding, preemptions=preemptions)


def _none(_t: str) -> int:
    return 0


def _many(_t: str) -> int:
    return 100


def test_a_burst_flight_of_a_less_urgent_class_is_preempted() -> None:
    v = choose_victim(0, DEC, [_f("bulk.a")], _many, _none)
    assert v is not None and v.key == "bulk.a"


def test_never_a_guaranteed_flight_nor_same_or_more_urgent_class() -> None:
    flights = [_f("g", funding=Funding.GUARANTEED), _f("same", priority=2), _f("more", priority=1)]
    assert choose_victim(2, DEC, flights, _many, _none) is None
    assert choose_victim(0, DEC, flights, _many, _none).key == "same"  # type: ignore[union-attr]


def test_never_a_tenant_inside_its_guarantee_whatever_funded_the_flight() -> None:
    flights = [_f("bulk.a"), _f("bulk.b")]
    # bulk runs 2 with 2 guaranteed: taking one would leave it below its guarantee
    assert choose_victim(0, DEC, flights, lambda t: 2, lambda t: 2) is None
    # running 3 with 2 guaranteed: one may go (down to 2)
    assert choose_victim(0, DEC, flights, lambda t: 3, lambda t: 2) is not None


def test_only_on_the_models_decoders_decoding_and_with_enough_left() -> None:
    assert choose_victim(0, DEC, [_f("x", decoder="other")], _many, _none) is None
    assert choose_victim(0, DEC, [_f("x", decoding=False)], _many, _none) is None
    assert choose_victim(0, DEC, [_f("x", remaining=3)], _many, _none) is None
    assert choose_victim(0, DEC, [_f("x", preemptions=2)], _many, _none) is None


def test_preference_least_urgent_then_fewest_tokens_then_newest_then_key() -> None:
    flights = [_f("c5-many", priority=5, generated=50), _f("c7-many", priority=7, generated=90),
               _f("c7-few", priority=7, generated=10, started_at=1.0), _f("c7-few-newer", priority=7, generated=10,
                                                                        started_at=2.0)]
    assert choose_victim(0, DEC, flights, _many, _none).key == "c7-few-newer"  # type: ignore[union-attr]
    tie = [_f("b", generated=5), _f("a", generated=5)]
    assert choose_victim(0, DEC, tie, _many, _none).key == "a"  # type: ignore[union-attr]
    assert choose_victim(0, DEC, list(reversed(tie)), _many, _none).key == "a"  # type: ignore[union-attr]


def test_rate_limit_and_cool_down() -> None:
    gate = PreemptionGate(PreemptionLimits(max_per_window=2, window_s=1.0, cooldown_s=5.0))
    fl = [_f("a"), _f("b", generated=30)]
    v = gate.victim(0, DEC, fl, _many, _none, now=10.0)
    assert v is not None and v.key == "a"
    gate.record("a", 10.0)
    # "a" is cooling down: the next one is "b"
    assert gate.victim(0, DEC, fl, _many, _none, now=10.1).key == "b"  # type: ignore[union-attr]
    gate.record("b", 10.1)
    assert not gate.allows(10.5) and gate.victim(0, DEC, [_f("c")], _many, _none, now=10.5) is None
    assert gate.allows(11.2)  # the window moved on
    assert gate.victim(0, DEC, [_f("a")], _many, _none, now=14.0) is None  # still cooling down
    assert gate.victim(0, DEC, [_f("a")], _many, _none, now=15.1) is not None
    assert gate.count == 2


_flight = st.builds(
    _f, key=st.text("abcdef", min_size=1, max_size=4), tenant=st.sampled_from(["t0", "t1", "t2", "t3"]),
    priority=st.integers(0, 9), funding=st.sampled_from(list(Funding)), decoder=st.sampled_from(["d0", "d1", "x"]),
    generated=st.integers(0, 300), remaining=st.integers(0, 300), started_at=st.floats(0, 100),
    decoding=st.booleans(), preemptions=st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(flights=st.lists(_flight, max_size=20), waiting=st.integers(0, 9),
       running=st.dictionaries(st.sampled_from(["t0", "t1", "t2", "t3"]), st.integers(0, 20)),
       guaranteed=st.dictionaries(st.sampled_from(["t0", "t1", "t2", "t3"]), st.integers(0, 20)))
def test_never_guaranteed_never_more_urgent_and_the_best_by_the_order(
        flights: list[Running], waiting: int, running: dict[str, int], guaranteed: dict[str, int]) -> None:
    def run(t: str) -> int:
        return running.get(t, 0)

    def g(t: str) -> int:
        return guaranteed.get(t, 0)

    v = choose_victim(waiting, DEC, flights, run, g)
    ok = [f for f in flights if f.priority > waiting and f.funding is Funding.BURST and f.decoder in DEC
          and f.decoding and f.remaining >= 8 and f.preemptions < 2 and run(f.tenant) > g(f.tenant)]
    if v is None:
        assert not ok
        return
    assert v.funding is not Funding.GUARANTEED and v.priority > waiting
    assert run(v.tenant) - 1 >= g(v.tenant)  # its tenant stays at or above its guarantee
    assert v in ok
    assert min((-f.priority, f.generated, -f.started_at, f.key) for f in ok) == \
        (-v.priority, v.generated, -v.started_at, v.key)
    # the same flights in another order give a victim of the same rank (the same one, unless two tie exactly)
    w = choose_victim(waiting, DEC, list(reversed(flights)), run, g)
    assert w is not None and (-w.priority, w.generated, -w.started_at, w.key) == \
        (-v.priority, v.generated, -v.started_at, v.key)
