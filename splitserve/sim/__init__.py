"""Capacity planning: a discrete-event simulation of a prefill/decode cluster that runs the live policies.

The routing policy (:class:`splitserve.routing.Router` with its strategies, ``DisaggPolicy``, context pools
and pending-load ledger), the prefix index (fed by simulated KV events), the fair scheduler and the quota
book are the very objects the router service runs, built and driven the same way
(:mod:`splitserve.routing.live`). Around them: simulated engines with latency models from published
measurements or from this machine, KV capacity and eviction, a KV-transfer model per fabric, and metrics.

    from splitserve.sim import SimConfig, simulate, load_trace, scale_rate
    res = simulate(SimConfig(prefill=2, decode=6), scale_rate(load_trace("azure-conv", 2000), 4.0))
    print(res.summary["ttft_s"]["p50"], res.meets_slo)

Modules: ``clock`` (event loop), ``workload`` (traces, synthetic mixes), ``latency`` (step-time models),
``fabric`` (KV bytes per token, transfer time), ``workers`` (engines, KV pools, prefix caches, KV events),
``cluster`` (the driver), ``metrics``, ``planner`` (sweeps for the cheapest configuration), ``plots``,
``whatif`` (a change to the tenants or the pools, simulated before and after against each tenant's SLO).
Several models and LoRA adapters: ``SimConfig(pools=[ModelPool(...)])`` with ``assign_models`` /
``assign_adapters`` on the requests (see docs/models.md, "In the simulator").
"""

from splitserve.sim.cluster import ModelPool, Sim, SimConfig, simulate
from splitserve.sim.fabric import FABRICS, MODELS, Fabric, ModelSpec
from splitserve.sim.latency import StepFit, calibrated, distserve, latency_model, splitwise
from splitserve.sim.metrics import SimResult
from splitserve.sim.workload import (
    SimRequest,
    WorkloadError,
    assign_adapters,
    assign_models,
    load_azure,
    load_mooncake,
    load_sharegpt,
    load_trace,
    rag_mix,
    scale_rate,
    synthetic,
)

__all__ = [
    "FABRICS",
    "MODELS",
    "Fabric",
    "ModelPool",
    "ModelSpec",
    "Sim",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "StepFit",
    "WorkloadError",
    "assign_adapters",
    "assign_models",
    "calibrated",
    "distserve",
    "latency_model",
    "load_azure",
    "load_mooncake",
    "load_sharegpt",
    "load_trace",
    "rag_mix",
    "scale_rate",
    "simulate",
    "splitwise",
    "synthetic",
]
