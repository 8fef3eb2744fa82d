"""What a simulation reports: latency percentiles, SLO attainment, goodput, utilisation, cache and KV traffic.

* TTFT: arrival -> first token (for a disaggregated request, the prefiller's first token arrives with the
  KV hand-off); ITL: gaps between a stream's later tokens; TPOT: (finish - first token) / (tokens - 1);
  e2e: arrival -> last token.
* SLO attainment (DistServe's definition): the share of requests with TTFT <= ``ttft_slo_s`` and the share
  with TPOT <= ``tpot_slo_s``; the run *meets* the SLO when both shares are >= ``attainment``. Goodput:
  requests per second that met both (over the arrival span).
* Utilisation: busy time / elapsed, per worker and per pool over time (``util_buckets`` slices).
* Cache hit ratio: prompt tokens served from a prefix cache / prompt tokens; KV bytes moved between pools.
* SLO admission (``slo_admission``): ``admission`` - the requests it refused (also in ``refused``), by reason
  and tenant, and the Retry-After they were told.
* Several models or LoRA adapters: ``models`` (per served model: TTFT and TPOT percentiles, throughput -
  finished requests over the span from its first arrival to its last finish - and its workers' adapter loads,
  loads per finished request, and the most adapters any of its workers held at once) and ``adapters`` (the same
  over the cluster). Absent for a single-model run without adapters, whose summary is what it always was.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from splitserve.sim.cluster import Sim

__all__ = ["SimResult", "collect", "percentile"]


def percentile(xs: Sequence[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _sorted(xs: Sequence[float]) -> list[float]:
    """``sorted(xs)``; an ``array('d')`` (the ITL series: millions of gaps in a big run) is sorted by numpy, whose
    stable sort orders floats as ``sorted`` does (NaN aside: those take ``sorted``)."""
    if isinstance(xs, array) and xs.typecode == "d" and len(xs) > 1024:
        a = np.frombuffer(xs, dtype=np.float64)
        if not np.isnan(a).any():
            return np.sort(a, kind="stable").tolist()  # type: ignore[no-any-return]
    return sorted(xs)


def _pcts(xs: Sequence[float]) -> dict[str, float]:
    s = _sorted(xs)
    if not s:
        return {"n": 0}
    n = len(s)

    def q(p: float) -> float:
        k = (n - 1) * p
        lo = int(k)
        hi = min(lo + 1, n - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"n": n, "mean": sum(s) / n, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1]}


@dataclass
class SimResult:
    config: dict[str, Any]
    summary: dict[str, Any]
    requests: list[dict[str, Any]] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    util_series: dict[str, list[float]] = field(default_factory=dict)
    util_dt: float = 1.0

    @property
    def meets_slo(self) -> bool:
        return bool(self.summary["slo"]["met"])

    def to_dict(self, requests: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"config": self.config, **self.summary}
        if requests:
            out["requests"] = self.requests
        return out

    def by_kind(self, kind: str) -> dict[str, Any]:
        return self.summary.get("by_kind", {}).get(kind, {})


def collect(sim: Sim) -> SimResult:
    cfg = sim.cfg
    done = sim.done
    ttft, tpot, e2e = [], [], []
    rows = []
    kinds: dict[str, dict[str, list[float]]] = {}
    prompt_total = cached_total = 0
    routes: dict[str, int] = {}
    ok_ttft = ok_tpot = ok_both = 0
    for s in done:
        r = s.req
        t1 = s.first_token_s - r.arrival_s
        tp = (s.finish_s - s.first_token_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        ttft.append(t1)
        tpot.append(tp)
        e2e.append(s.finish_s - r.arrival_s)
        a, b = t1 <= cfg.ttft_slo_s, tp <= cfg.tpot_slo_s
        ok_ttft += a
        ok_tpot += b
        ok_both += a and b
        prompt_total += r.prompt_tokens
        cached_total += s.cached_tokens
        routes[s.route] = routes.get(s.route, 0) + 1
        if r.kind:
            k = kinds.setdefault(r.kind, {"ttft": [], "itl_max": [], "tpot": [], "itl_mean": []})
            k["ttft"].append(t1)
            k["tpot"].append(tp)
            if s.itls:
                k["itl_max"].append(s.itl_max)
                k["itl_mean"].append(s.itl_sum / s.itls)
        rows.append({"id": r.request_id, "kind": r.kind, "tenant": r.tenant, "model": r.model, "lora": r.lora,
                     "arrival_s": round(r.arrival_s, 4),
                     "prompt": r.prompt_tokens, "output": r.output_tokens, "route": s.route, "decoder": s.decoder,
                     "prefiller": s.prefiller, "cached_tokens": s.cached_tokens, "ttft_s": round(t1, 5),
                     "tpot_s": round(tp, 5), "e2e_s": round(s.finish_s - r.arrival_s, 5),
                     "itl_max_s": round(s.itl_max, 5), "kv_bytes": s.kv_bytes})
    n = len(done)
    total = len(sim.requests)
    span = max((r.arrival_s for r in sim.requests), default=0.0) or 1.0
    end = sim.loop.now or 1.0
    per_worker = {w.wid: round(w.busy_s / end, 4) for w in sim.workers}
    itl = sim.itl.tolist()
    slo = {
        "ttft_s": cfg.ttft_slo_s, "tpot_s": cfg.tpot_slo_s, "attainment": cfg.attainment,
        "ttft_ok": ok_ttft / total if total else 0.0, "tpot_ok": ok_tpot / total if total else 0.0,
        "both_ok": ok_both / total if total else 0.0,
    }
    slo["met"] = n == total and slo["ttft_ok"] >= cfg.attainment and slo["tpot_ok"] >= cfg.attainment
    def pool_util(role: str) -> float:
        ws = [w for w in sim.workers if w.role == role]
        return round(sum(w.busy_s for w in ws) / (end * len(ws)), 4) if ws else 0.0

    summary = {
        "requests": total, "finished": n, "refused": len(sim.refused), "failed": len(sim.failed),
        "unfinished": total - n - len(sim.refused) - len(sim.failed),
        "rate_rps": round(total / span, 4), "sim_s": round(end, 3), "gpus": cfg.gpus,
        "ttft_s": _pcts(ttft), "itl_s": _pcts(sim.itl), "tpot_s": _pcts(tpot), "e2e_s": _pcts(e2e),
        "slo": slo, "goodput_rps": round(ok_both / span, 4),
        "goodput_per_gpu_rps": round(ok_both / span / max(1, cfg.gpus), 4),
        "routes": routes,
        "cache_hit_ratio": round(cached_total / prompt_total, 4) if prompt_total else 0.0,
        "kv_bytes_moved": sim.kv_bytes,
        "utilisation": {"prefill": pool_util("prefill"), "decode": pool_util("decode"), "per_worker": per_worker},
        "index": {"batches": sim.index.batches, "events": sim.index.events, "gaps": sim.index.gaps},
        "events_processed": sim.loop.processed,
        "by_kind": {k: {**{m: _pcts(v) for m, v in d.items()}, "itl": _pcts(sim.itl_by_kind.get(k, ()))}
                    for k, d in kinds.items()},
    }
    if sim.admission is not None:
        summary["admission"] = _admission(sim)
    if sim.multi or any(w.lru is not None for w in sim.workers) or any(r.lora for r in sim.requests):
        models = _per_model(sim)
        summary["models"] = models
        summary["adapters"] = _adapters(sim, models)
    nd = max(1, sum(1 for w in sim.workers if w.role == "decode"))
    npf = max(1, sum(1 for w in sim.workers if w.role == "prefill"))
    dt = sim.util_dt
    series = {"decode": [x / (dt * nd) for x in sim.util["decode"]],
              "prefill": [x / (dt * npf) for x in sim.util["prefill"]]}
    return SimResult(cfg.describe(), summary, rows, ttft, itl, tpot, series, dt)


def _admission(sim: Sim) -> dict[str, Any]:
    """SLO admission's refusals: how many, why, whose, and the Retry-After they were given."""
    by_reason: dict[str, int] = {}
    by_tenant: dict[str, int] = {}
    for tenant, reason, _ in sim.admission_log:
        by_reason[reason] = by_reason.get(reason, 0) + 1
        by_tenant[tenant] = by_tenant.get(tenant, 0) + 1
    return {"refused": len(sim.admission_log), "by_reason": by_reason, "by_tenant": by_tenant,
            "retry_after_s": _pcts([float(x[2]) for x in sim.admission_log]),
            "slack": sim.cfg.admission_slack}


def _per_model(sim: Sim) -> dict[str, dict[str, Any]]:
    """Each served model's figures (see the module docstring)."""
    out: dict[str, dict[str, Any]] = {}
    for mp in sim.pools:
        done = [s for s in sim.done if sim.model_for(s.req) == mp.name]
        ttft = [s.first_token_s - s.req.arrival_s for s in done]
        tpot = [(s.finish_s - s.first_token_s) / (s.req.output_tokens - 1) for s in done if s.req.output_tokens > 1]
        asked = [r for r in sim.requests if sim.model_for(r) == mp.name]
        span = (max(s.finish_s for s in done) - min(r.arrival_s for r in asked)) if done else 0.0
        ws = [w for w in sim.workers if sim.model_of[w.wid] == mp.name]
        loads = sum(w.lru.loads for w in ws if w.lru is not None)
        out[mp.name] = {
            "requests": len(asked), "finished": len(done), "prefill": mp.prefill, "decode": mp.decode,
            "ttft_s": _pcts(ttft), "tpot_s": _pcts(tpot),
            "throughput_rps": round(len(done) / span, 4) if span > 0 else 0.0,
            "adapter_requests": sum(1 for s in done if s.req.lora), "max_loras": mp.max_loras,
            "adapter_loads": loads, "loads_per_request": round(loads / len(done), 4) if done else 0.0,
            "peak_loaded": max((w.lru.peak for w in ws if w.lru is not None), default=0),
        }
    return out


def _adapters(sim: Sim, models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The adapter figures over the cluster."""
    loads = sum(m["adapter_loads"] for m in models.values())
    done = len(sim.done)
    return {"affinity": sim.cfg.lora_affinity, "requests": sum(m["adapter_requests"] for m in models.values()),
            "loads": loads, "loads_per_request": round(loads / done, 4) if done else 0.0,
            "peak_loaded": max((m["peak_loaded"] for m in models.values()), default=0)}
