"""Several router replicas, as pure objects: the same worker set and the same KV events give the same
session-affinity and kvaware decisions on every replica, and replicas that exchange their dispatches
(``pending_entries`` -> ``on_remote_routed``, what the service sends as DispatchNote) do not pile one burst
onto the worker that looked cheapest to all of them."""

from __future__ import annotations

from collections import Counter

from splitserve.cache import batch, hash_token_blocks, stored
from splitserve.routing import Router, RoutingRequest, WorkerView

BS = 16


def _decoders(n: int = 4) -> list[WorkerView]:
    return [WorkerView(f"d{i}", "decode") for i in range(n)]


def _tokens(seed: int, n: int) -> list[int]:
    return [seed * 1_000_000 + i for i in range(n)]


def test_session_affinity_agrees_across_replicas() -> None:
    replicas = [Router("session", disagg_threshold=10**9, pending_ttl_s=None) for _ in range(3)]
    ws = _decoders(5)
    for s in range(40):
        req = RoutingRequest(f"r{s}", tenant="t", token_ids=_tokens(s, 32), session_key=f"sess-{s}")
        owners = {r.decide(req, list(reversed(ws)) if i % 2 else ws, float(s)).decoder
                  for i, r in enumerate(replicas)}
        assert len(owners) == 1  # the ring depends only on the worker set, not on order or replica
    # a worker leaving moves only its own sessions, on every replica alike
    before = {s: replicas[0].decide(RoutingRequest(f"a{s}", tenant="t", token_ids=_tokens(s, 32),
                                                   session_key=f"sess-{s}"), ws, 0.0).decoder for s in range(40)}
    after = [{s: r.decide(RoutingRequest(f"b{s}", tenant="t", token_ids=_tokens(s, 32), session_key=f"sess-{s}"),
                          ws[:-1], 0.0).decoder for s in range(40)} for r in replicas]
    assert after[0] == after[1] == after[2]
    assert all(after[0][s] == before[s] for s in range(40) if before[s] != "d4")


def test_kvaware_agrees_across_replicas_fed_the_same_events() -> None:
    replicas = [Router("kvaware", disagg_threshold=10**9, pending_ttl_s=None) for _ in range(3)]
    docs = {f"d{i}": _tokens(100 + i, 512) for i in range(4)}
    seq = 0
    for wid, toks in docs.items():
        b = batch(wid, seq, ts_ms=0.0, events=[stored(hash_token_blocks(toks, BS), block_size=BS)])
        for r in replicas:
            assert r.apply_events(b) is False
    ws = _decoders(4)
    for wid, toks in docs.items():
        req = RoutingRequest(f"q-{wid}", token_ids=toks + _tokens(7, 40))
        picks = [(d.decoder, d.cached_tokens) for d in (r.decide(req, ws, 1.0) for r in replicas)]
        assert picks == [(wid, 512)] * 3


def test_replicas_sharing_dispatches_spread_a_burst() -> None:
    # d0 looks cheapest in the (stale) heartbeat views every replica holds. Three replicas each dispatching a
    # third of a 12-request burst between two heartbeats: alone, each piles its share onto d0 (its own
    # ledger only sees its own dispatches); exchanging dispatches, they spread it like one router would.
    ws = [WorkerView("d0", "decode", queued_prefill_tokens=0), WorkerView("d1", "decode", queued_prefill_tokens=300),
          WorkerView("d2", "decode", queued_prefill_tokens=600)]

    def burst(share: bool) -> Counter[str]:
        replicas = [Router("kvaware", disagg_threshold=10**9, pending_ttl_s=1.0) for _ in range(3)]
        got: Counter[str] = Counter()
        for i in range(12):
            me = replicas[i % 3]
            d = me.decide(RoutingRequest(f"r{i}", token_ids=_tokens(i, 400)), ws, 0.01 * i)
            got[d.decoder] += 1
            if share:
                for other in replicas:
                    if other is not me:
                        other.on_remote_routed(d.request_id, me.pending_entries(d), 0.01 * i)
        return got

    alone, shared = burst(False), burst(True)
    one = Router("kvaware", disagg_threshold=10**9, pending_ttl_s=1.0)
    single = Counter(one.decide(RoutingRequest(f"r{i}", token_ids=_tokens(i, 400)), ws, 0.01 * i).decoder
                     for i in range(12))
    assert shared == single
    assert alone["d0"] > shared["d0"]
    assert max(shared.values()) - min(shared.values()) <= max(single.values()) - min(single.values())
