"""ClusterMetrics: RequestFinished events and heartbeats -> Prometheus series and the `top` snapshot."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from splitserve.obs.metrics import ClusterMetrics
from splitserve.proto import ErrorCode, Heartbeat, RequestFinished, Route, Timings, Usage, WorkerLoad


def _samples(m: ClusterMetrics, now: float = 0.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.exposition(now).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_finished_events_become_latency_token_and_error_series() -> None:
    m = ClusterMetrics()
    m.on_finished(RequestFinished(
        request_id="r1", tenant="acme", worker_id="decode-0", status="ok", route=Route.DISAGGREGATED,
        usage=Usage(prompt_tokens=100, completion_tokens=4, cached_tokens=64),
        timings=Timings(ttft_server_ms=250.0, total_ms=900.0, queue_ms=3.0, transfer_ms=12.0),
        itl_ms=[40.0, 60.0, 80.0], kv_bytes=1_000_000), now=0.0)
    m.on_finished(RequestFinished(request_id="r2", tenant="acme", worker_id="router-0", status="error",
                                  error_code=ErrorCode.WORKER_DIED), now=1.0)
    s = _samples(m)
    lab = (("route", "disaggregated"), ("tenant", "acme"))
    assert s[("splitserve_ttft_seconds_count", lab)] == 1
    assert s[("splitserve_ttft_seconds_sum", lab)] == 0.25
    assert s[("splitserve_itl_seconds_count", lab)] == 3
    assert s[("splitserve_e2e_seconds_sum", lab)] == 0.9
    assert s[("splitserve_tokens_total", (("kind", "cached"), ("tenant", "acme")))] == 64
    assert s[("splitserve_prefix_cache_hit_ratio", ())] == 0.64
    assert s[("splitserve_kv_transfer_bytes_total", ())] == 1_000_000
    assert s[("splitserve_errors_total", (("code", "worker_died"),))] == 1
    assert s[("splitserve_requests_total", (("route", "none"), ("status", "error"), ("tenant", "acme")))] == 1


def test_heartbeats_become_worker_gauges_and_top_rows() -> None:
    m = ClusterMetrics(stale_s=5.0)
    hb = Heartbeat(worker_id="decode-0", role="decode", seq=1, pid=1,
                   load=WorkerLoad(active_seqs=3, queued_requests=2, free_blocks=10, cached_blocks=7))
    m.on_heartbeat(hb, now=100.0)
    m.on_heartbeat(Heartbeat(worker_id="prefill-0", role="prefill", seq=1, pid=2,
                             load=WorkerLoad(queued_requests=1)), now=100.0)
    s = _samples(m, now=100.5)
    assert s[("splitserve_worker_active_seqs", (("role", "decode"), ("worker", "decode-0")))] == 3
    assert s[("splitserve_queue_depth", (("role", "decode"),))] == 2
    snap = m.snapshot(now=101.0)
    assert [w["worker"] for w in snap["workers"]] == ["decode-0", "prefill-0"]
    assert snap["workers"][0]["state"] == "ready" and snap["workers"][0]["cached_blocks"] == 7
    assert m.snapshot(now=110.0)["workers"][0]["state"] == "silent"  # stopped heartbeating


def test_top_rates_cover_the_window_only() -> None:
    m = ClusterMetrics(window_s=10.0)
    for i in range(5):
        m.on_finished(RequestFinished(request_id=f"r{i}", tenant="t", worker_id="d", status="ok",
                                      usage=Usage(prompt_tokens=1, completion_tokens=20)), now=float(i))
    snap = m.snapshot(now=5.0)
    assert snap["tenants"]["t"]["requests_per_s"] == 0.5 and snap["tenants"]["t"]["tokens_per_s"] == 10.0
    assert m.snapshot(now=100.0)["tenants"] == {}


def test_series_by_model_and_adapter_come_from_the_event_not_the_worker() -> None:
    """A request's model and adapter travel in its RequestFinished: the series split by them, even for an event
    a router published (its worker id names no model) or before any heartbeat was seen."""
    m = ClusterMetrics()
    u = Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=4)
    m.on_finished(RequestFinished(request_id="r1", tenant="acme", worker_id="decode-0", status="ok", usage=u,
                                  model="smol", lora="sql"), now=0.0)
    m.on_finished(RequestFinished(request_id="r2", tenant="acme", worker_id="decode-1", status="ok", usage=u,
                                  model="big"), now=0.0)
    m.on_finished(RequestFinished(request_id="r3", tenant="acme", worker_id="router-0", status="error",
                                  error_code=ErrorCode.NO_WORKERS, model="big"), now=0.0)
    s = _samples(m)
    assert s[("splitserve:lora_requests_total", (("lora_name", "sql"), ("model_name", "smol")))] == 1
    assert s[("splitserve:lora_tokens_total", (("kind", "completion"), ("lora_name", "sql"),
                                               ("model_name", "smol")))] == 3
    assert s[("splitserve_model_tokens_total", (("kind", "cached"), ("model_name", "big"), ("tenant", "acme")))] == 4
    assert s[("splitserve:generation_tokens_total", (("model_name", "smol"),))] == 3
    assert s[("splitserve:request_failure_total", (("error_code", "no_workers"), ("model_name", "big")))] == 1
    assert not any(k[0].startswith("splitserve:lora") and ("model_name", "big") in k[1] for k in s)


def test_worker_seconds_per_stage_and_saved_seconds_are_counted_per_tenant_and_model() -> None:
    from splitserve.proto import StageCost

    m = ClusterMetrics()
    cost = StageCost(prefill_s=0.5, transfer_s=0.25, decode_s=2.0, cached_tokens=64, saved_s=0.1)
    for rid in ("r1", "r2"):
        m.on_finished(RequestFinished(request_id=rid, tenant="acme", worker_id="decode-0", status="ok",
                                      model="smol", cost=cost), now=0.0)
    s = _samples(m)
    for stage, want in (("prefill", 1.0), ("transfer", 0.5), ("decode", 4.0)):
        assert s[("splitserve_worker_seconds_total", (("model_name", "smol"), ("stage", stage),
                                                      ("tenant", "acme")))] == want
    assert s[("splitserve_cache_saved_seconds_total", (("model_name", "smol"), ("tenant", "acme")))] == 0.2
