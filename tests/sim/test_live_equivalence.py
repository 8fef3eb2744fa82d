"""The simulator's router decisions equal the live router service's on the same inputs.

A small trace (shared prefixes, real token ids, two tenants) runs through the simulator with ``record=True``;
its router inputs - every heartbeat, KV event batch, dispatch and finish, at simulated times - are then fed to
a real :class:`splitserve.services.router.service.RouterService` (its own ``on_heartbeat`` / ``on_kv_events`` /
``on_finished`` / ``_route`` handlers, its registry, its policy from ``make_policy``), with its clock set to
the simulated time and a bus that records what it would publish. Each routing decision it publishes must be
the simulator's, candidate scores included, and before each one the live router's request book must offer
dispatch the free decode slots the simulator's did (the same ``RequestBook``, fed by the same reports and ends).
"""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import trace

from splitserve import proto
from splitserve.services.router.service import RouterService
from splitserve.sim import SimConfig, synthetic
from splitserve.sim.cluster import Sim
from splitserve.sim.latency import StepFit
from tests.recording_bus import RecordingBus

CPU_FIT = StepFit("test-cpu", (30.0, 1.2, 0.0), (60.0, 0.001, 6.0))


def _run_sim(strategy: str) -> Sim:
    reqs = synthetic(40, rate=6.0, prompt=(40, 900), output=(4, 24), prefix_groups=3, prefix_tokens=256,
                     tenants=("alpha", "beta"), seed=3)
    cfg = SimConfig(prefill=2, decode=3, model="smollm2-135m", prefill_latency=CPU_FIT, fabric="local",
                    gpus_per_prefill=1, gpus_per_decode=1, kv_tokens=4096, max_seqs=4, strategy=strategy,
                    record=True, ttft_slo_s=5.0)
    sim = Sim(cfg, reqs)
    res = sim.run()
    assert res.summary["finished"] == 40
    return sim


async def _replay(
    sim: Sim, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], list[tuple[int, int]]]:
    cfg = sim.cfg
    clock = [0.0]
    svc = RouterService("router-eq", "nats://127.0.0.1:1", strategy=strategy, disagg_threshold=cfg.disagg_threshold,
                        max_stall_ms=cfg.max_stall_ms, decoder_prefill_tps=cfg.decoder_prefill_tps,
                        long_prompt_tokens=cfg.long_prompt_tokens)
    svc.clock = lambda: clock[0]
    svc.make_policy()
    bus = RecordingBus()
    svc.bus = bus  # type: ignore[assignment]
    hb_seq: dict[str, int] = {}
    pairs = []
    slots: list[tuple[int, int]] = []
    span = trace.INVALID_SPAN
    for entry in sim.log:
        kind, now = entry[0], entry[1]
        clock[0] = now
        if kind == "hb":
            _, _, wid, role, pool, load, ids = entry
            hb_seq[wid] = hb_seq.get(wid, -1) + 1
            hb = proto.Heartbeat(worker_id=wid, role=role, seq=hb_seq[wid], pid=1, interval_ms=cfg.heartbeat_s * 1000,
                                 load=proto.WorkerLoad(**load), active_requests=ids, pool=pool)
            await svc.on_heartbeat(hb, None)  # type: ignore[arg-type]
        elif kind == "kv":
            await svc.on_kv_events(proto.KvEventBatch.model_validate(entry[2]), None)  # type: ignore[arg-type]
        elif kind == "route":
            _, _, rid, tenant, ids, max_tokens, sim_decision = entry
            req = proto.GenerateRequest(request_id=rid, tenant=tenant, prompt_token_ids=ids,
                                        sampling=proto.SamplingParams(max_tokens=max_tokens))
            before = len(bus.published)
            inf = await svc._route(req, list(ids), None, span)
            assert inf is not None
            job = next(m for _, m in bus.published[before:] if isinstance(m, (proto.PrefillJob, proto.DecodeJob)))
            live = dict((job.decode if isinstance(job, proto.PrefillJob) else job).decision)
            live.pop("router", None)  # which replica decided: the live router's own id, not part of the policy
            pairs.append((sim_decision, live))
        elif kind == "slots":
            slots.append((entry[2], svc.free_slots(now)))
        elif kind == "fin":
            _, _, rid, tenant, p, o, decoder = entry
            ev = proto.RequestFinished(request_id=rid, tenant=tenant, worker_id=decoder, status="ok",
                                       usage=proto.Usage(prompt_tokens=p, completion_tokens=o))
            await svc.on_finished(ev, None)  # type: ignore[arg-type]
    assert len(slots) == len(pairs)
    return pairs, slots


@pytest.mark.parametrize("strategy", ["kvaware", "roundrobin", "prefixaware"])
async def test_sim_decisions_equal_live_router(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _run_sim(strategy)
    pairs, slots = await _replay(sim, strategy, monkeypatch)
    assert [s for s, _ in slots] == [live for _, live in slots], "the live router paces dispatch differently"
    assert len(pairs) == 40
    for sim_d, live_d in pairs:
        assert live_d == sim_d
    routes = {d["route"] for d, _ in pairs}
    assert routes == {"direct", "disaggregated"}  # both paths were exercised
    if strategy == "kvaware":
        assert any(d["cached_tokens"] > 0 for d, _ in pairs)  # the index (fed by simulated events) mattered
        assert len({d["decoder"] for d, _ in pairs}) == 3


async def test_replay_detects_a_diverging_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: a live router with another disaggregation threshold decides differently."""
    sim = _run_sim("kvaware")
    sim.cfg.disagg_threshold = 64
    pairs, _ = await _replay(sim, "kvaware", monkeypatch)
    assert any(s["route"] != live["route"] or s["thresholds"] != live["thresholds"] for s, live in pairs)
