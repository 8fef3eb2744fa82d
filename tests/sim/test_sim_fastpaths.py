"""The simulator's fast paths (issue 28: 1,000 workers) change how it computes, never what it decides.

Each shortcut is checked against the plain way it replaced:

* a decode step reports its tokens in one call, and the ITL percentiles sort the gaps with numpy;
* workers are registered into the live registry's order incrementally.

Heartbeats list requests as ``proto.request_key(tenant, request_id)`` (ids are unique per tenant only), so two
tenants may use the same request id.
"""

from __future__ import annotations

import dataclasses
import json
import random
from array import array
from typing import Any

from splitserve import proto
from splitserve.sim import SimConfig, SimRequest, synthetic
from splitserve.sim.cluster import Sim
from splitserve.sim.latency import StepFit
from splitserve.sim.metrics import _pcts

FIT = StepFit("test", (30.0, 1.2, 0.0), (60.0, 0.001, 6.0))


def _cfg(**kw: Any) -> SimConfig:
    base = SimConfig(prefill=2, decode=3, model="smollm2-135m", prefill_latency=FIT, fabric="local",
                     gpus_per_prefill=1, gpus_per_decode=1, kv_tokens=6000, max_seqs=6, ttft_slo_s=5.0, record=True)
    return dataclasses.replace(base, **kw)


def _reqs() -> list[SimRequest]:
    return synthetic(120, rate=12.0, prompt=(40, 1200), output=(4, 40), prefix_groups=3, prefix_tokens=256,
                     tenants=("alpha", "beta"), seed=11)


def test_heartbeats_list_request_keys_and_tenants_may_share_request_ids() -> None:
    shared = [dataclasses.replace(r, request_id=f"q{i // 2}") for i, r in enumerate(_reqs())]  # alpha/beta pairs
    assert len({r.request_id for r in shared}) == len(shared) // 2
    sim = Sim(_cfg(), shared)
    res = sim.run()
    assert res.summary["finished"] == len(shared)
    listed = {k for e in sim.log if e[0] == "hb" for k in e[6]}
    assert listed and listed <= {proto.request_key(r.tenant, r.request_id) for r in shared}
    assert all(d["request_id"] == rid for e in sim.log if e[0] == "route" for rid, d in [(e[2], e[6])])
    # the same run with unique ids decides the same: an id only has to be unique within its tenant
    unique = Sim(_cfg(), _reqs())
    ures = unique.run()
    assert ures.summary == res.summary
    strip = [{k: v for k, v in row.items() if k != "id"} for row in res.requests]
    assert strip == [{k: v for k, v in row.items() if k != "id"} for row in ures.requests]


def test_workers_are_registered_in_the_live_registry_order() -> None:
    sim = Sim(_cfg(prefill=2, decode=3, long_decode=1), _reqs()[:5])
    order = [sim.prefillers[0], sim.decoders[0], sim.prefillers[1], sim.decoders[3], sim.decoders[1],
             sim.decoders[2]]
    for w in order:  # first heard first, decoders before prefillers
        sim._heartbeat(w, schedule=False)
    assert [v.worker_id for v in sim.views] == ["d0", "ld0", "d1", "d2", "p0", "p1"]
    assert sim._pos == {v.worker_id: i for i, v in enumerate(sim.views)}


def test_itl_percentiles_sorted_by_numpy_equal_sorted() -> None:
    rng = random.Random(5)
    for n in (0, 1, 1025, 50_000):
        xs = [rng.choice([0.0, -0.0, 0.03, 1e-9, float("inf")]) if rng.random() < 0.3 else rng.random()
              for _ in range(n)]
        # json: NaN (inf - inf in a percentile) equals NaN, and -0.0 stays -0.0
        assert json.dumps(_pcts(array("d", xs))) == json.dumps(_pcts(list(xs)))
    nan = array("d", [float("nan")] * 2000 + [1.0])
    assert json.dumps(_pcts(nan)) == json.dumps(_pcts(list(nan)))  # NaN: sorted's order, not numpy's
