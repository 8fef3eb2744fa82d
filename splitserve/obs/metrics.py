"""Cluster metrics, gathered in one place from what the services already publish.

Every request ends with one ``RequestFinished`` event (status, usage, server timings, inter-token gaps, KV
bytes) and every worker heartbeats its load. :class:`ClusterMetrics` turns those into Prometheus series —
TTFT, ITL and end-to-end histograms by tenant and route, queue wait, KV transfer bytes and seconds, token
counters (prompt / completion / cached: the prefix-cache hit rate), errors by kind, worker load and queue
depth — and into the snapshot ``splitserve top`` draws. No NATS here: the owner feeds it.

Two families of names. ``splitserve:*`` follows vLLM's own metric names and labels (``vllm:`` prefix there,
``model_name`` label), so a vLLM dashboard works by swapping the prefix: time_to_first_token_seconds,
inter_token_latency_seconds, request_time_per_output_token_seconds, e2e_request_latency_seconds,
request_queue_time_seconds, request_prefill_time_seconds, prompt_tokens_total, generation_tokens_total,
request_prompt_tokens / request_generation_tokens (length histograms), request_success_total{finished_reason},
prefix_cache_queries_total / prefix_cache_hits_total (tokens, counters), num_requests_running / _waiting,
lora_requests_total / lora_tokens_total (per adapter); splitserve_model_tokens_total splits tenants' tokens by model.
The older ``splitserve_*`` series (by tenant and route) stay for existing dashboards.

Every front door subscribes to every request's end, so each exposes the same cluster-wide series: scrape
one front door (or aggregate with ``max by``, not ``sum``), never add several up.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve.proto import Heartbeat, RequestFinished

# vLLM's buckets, so histogram_quantile over a mixed fleet lines up.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
UNKNOWN_MODEL = "unknown"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class _Done:
    t: float
    tenant: str
    status: str
    tokens: int


class ClusterMetrics:
    def __init__(self, *, window_s: float = 10.0, stale_s: float = 5.0) -> None:
        r = self.registry = CollectorRegistry()
        self.window_s = window_s
        self.stale_s = stale_s
        lab = ["tenant", "route"]
        self.requests = Counter("splitserve_requests_total", "Finished requests", ["tenant", "route", "status"],
                                registry=r)
        self.errors = Counter("splitserve_errors_total", "Requests that ended in an error, by kind", ["code"],
                              registry=r)
        self.tokens = Counter("splitserve_tokens_total", "Tokens by tenant and kind (prompt, completion, cached)",
                              ["tenant", "kind"], registry=r)
        self.ttft = Histogram("splitserve_ttft_seconds", "Time to first token (server side)", lab,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("splitserve_itl_seconds", "Inter-token latency at the decoder", lab,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("splitserve_e2e_seconds", "Request created -> final message", lab,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("splitserve_queue_seconds", "Request created -> routed", ["tenant"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.kv_bytes = Counter("splitserve_kv_transfer_bytes_total", "KV bytes pushed prefiller -> decoder",
                                registry=r)
        self.kv_seconds = Histogram("splitserve_kv_transfer_seconds", "KV transfer time left after prefill",
                                    buckets=LATENCY_BUCKETS, registry=r)
        wl = ["worker", "role"]
        self.up = Gauge("splitserve_worker_up", "1 while the worker heartbeats as ready", wl, registry=r)
        self.active = Gauge("splitserve_worker_active_seqs", "Sequences a worker is running", wl, registry=r)
        self.queued = Gauge("splitserve_worker_queued_requests", "Requests queued at a worker", wl, registry=r)
        self.queued_tokens = Gauge("splitserve_worker_queued_prefill_tokens", "Prefill tokens queued", wl,
                                   registry=r)
        self.free_blocks = Gauge("splitserve_worker_free_kv_blocks", "Free KV landing blocks", wl, registry=r)
        # With free blocks: KV occupancy, a decode-pool autoscaling signal (deploy/k8s)
        self.total_blocks = Gauge("splitserve_worker_total_kv_blocks", "KV pool size in blocks (0 = unknown)", wl,
                                  registry=r)
        self.cached_blocks = Gauge("splitserve_worker_cached_kv_blocks", "Prefix-cache blocks resident", wl,
                                   registry=r)
        self.queue_depth = Gauge("splitserve_queue_depth", "Requests queued at workers, by role", ["role"],
                                 registry=r)
        self.hit_ratio = Gauge("splitserve_prefix_cache_hit_ratio", "cached / prompt tokens, all requests",
                               registry=r)
        self._vllm_style(r)
        self._prompt = 0
        self._cached = 0
        self.workers: dict[str, tuple[Heartbeat, float]] = {}
        self._any_model: str | None = None
        self._recent: deque[_Done] = deque()

    def _vllm_style(self, r: CollectorRegistry) -> None:
        m = ["model_name"]
        p = "splitserve:"
        self.v_ttft = Histogram(f"{p}time_to_first_token_seconds", "Time to first token (server side)", m,
                                buckets=VLLM_TTFT_BUCKETS, registry=r)
        self.v_itl = Histogram(f"{p}inter_token_latency_seconds", "Gap between consecutive output tokens", m,
                               buckets=VLLM_ITL_BUCKETS, registry=r)
        self.v_tpot = Histogram(f"{p}request_time_per_output_token_seconds",
                                "Per request: (e2e - TTFT) / (output tokens - 1)", m, buckets=VLLM_ITL_BUCKETS,
                                registry=r)
        self.v_e2e = Histogram(f"{p}e2e_request_latency_seconds", "Request created -> finished", m,
                               buckets=VLLM_REQUEST_BUCKETS, registry=r)
        self.v_queue = Histogram(f"{p}request_queue_time_seconds", "Request created -> routed to a worker", m,
                                 buckets=VLLM_REQUEST_BUCKETS, registry=r)
        self.v_prefill = Histogram(f"{p}request_prefill_time_seconds", "Prefill compute time", m,
                                   buckets=VLLM_REQUEST_BUCKETS, registry=r)
        self.v_prompt = Counter(f"{p}prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.v_gen = Counter(f"{p}generation_tokens", "Generated tokens of finished requests", m, registry=r)
        self.v_prompt_len = Histogram(f"{p}request_prompt_tokens", "Prompt length per request", m,
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.v_gen_len = Histogram(f"{p}request_generation_tokens", "Output length per request", m,
                                   buckets=TOKEN_BUCKETS, registry=r)
        self.v_success = Counter(f"{p}request_success", "Finished requests by finish reason",
                                 [*m, "finished_reason"], registry=r)
        self.v_failed = Counter(f"{p}request_failure", "Requests that ended in an error", [*m, "error_code"],
                                registry=r)
        self.v_cache_q = Counter(f"{p}prefix_cache_queries", "Prompt tokens looked up in the prefix cache", m,
                                 registry=r)
        self.v_cache_h = Counter(f"{p}prefix_cache_hits", "Prompt tokens served from the prefix cache", m,
                                 registry=r)
        self.v_running = Gauge(f"{p}num_requests_running", "Sequences the decoders are running", m, registry=r)
        self.v_waiting = Gauge(f"{p}num_requests_waiting", "Requests queued at workers", m, registry=r)
        self.v_kv_bytes = Counter(f"{p}kv_transfer_bytes", "KV bytes moved prefiller -> decoder", m, registry=r)
        # Per adapter and per tenant x model: what a chargeback by model needs (bounded: the tenants file's
        # tenants, the served models, the adapters the workers were started with)
        self.v_lora = Counter(f"{p}lora_requests", "Finished requests per LoRA adapter", [*m, "lora_name"],
                              registry=r)
        self.v_lora_tokens = Counter(f"{p}lora_tokens", "Tokens per LoRA adapter and kind (prompt, completion)",
                                     [*m, "lora_name", "kind"], registry=r)
        self.model_tokens = Counter("splitserve_model_tokens_total", "Tokens by tenant, model and kind (prompt, "
                                    "completion, cached)", ["tenant", "model_name", "kind"], registry=r)
        # Chargeback: the worker-seconds requests caused per stage (their RequestFinished.cost)
        self.worker_seconds = Counter("splitserve_worker_seconds_total", "Worker-seconds requests caused, by "
                                      "tenant, model and stage (prefill, transfer, decode)",
                                      ["tenant", "model_name", "stage"], registry=r)
        self.saved_seconds = Counter("splitserve_cache_saved_seconds_total", "Prefill seconds the prefix cache "
                                     "saved (cached tokens at the request's prefill rate)", ["tenant", "model_name"],
                                     registry=r)

    def _model(self, worker_id: str) -> str:
        seen = self.workers.get(worker_id)
        return (seen[0].model if seen is not None else None) or self._any_model or UNKNOWN_MODEL

    def _on_finished_vllm_style(self, ev: RequestFinished) -> None:
        model = ev.model or self._model(ev.worker_id)
        if ev.lora:
            self.v_lora.labels(model, ev.lora).inc()
        if ev.status == "error":
            self.v_failed.labels(model, ev.error_code.value if ev.error_code else "unknown").inc()
        else:
            # vLLM's finished_reason values: stop / length / abort
            self.v_success.labels(model, "abort" if ev.status in ("cancelled", "expired") else
                                  (ev.finish_reason or "stop")).inc()
        if ev.usage is not None:
            u = ev.usage
            self.v_prompt.labels(model).inc(u.prompt_tokens)
            self.v_gen.labels(model).inc(u.completion_tokens)
            self.v_prompt_len.labels(model).observe(u.prompt_tokens)
            self.v_gen_len.labels(model).observe(u.completion_tokens)
            self.v_cache_q.labels(model).inc(u.prompt_tokens)
            self.v_cache_h.labels(model).inc(u.cached_tokens)
            for kind, n in (("prompt", u.prompt_tokens), ("completion", u.completion_tokens),
                            ("cached", u.cached_tokens)):
                self.model_tokens.labels(ev.tenant, model, kind).inc(n)
                if ev.lora and kind != "cached":
                    self.v_lora_tokens.labels(model, ev.lora, kind).inc(n)
        t = ev.timings
        if t is not None:
            if t.ttft_server_ms is not None:
                self.v_ttft.labels(model).observe(t.ttft_server_ms / 1000)
            if t.total_ms is not None:
                self.v_e2e.labels(model).observe(t.total_ms / 1000)
            if t.queue_ms is not None:
                self.v_queue.labels(model).observe(max(0.0, t.queue_ms) / 1000)
            if t.prefill_ms is not None:
                self.v_prefill.labels(model).observe(t.prefill_ms / 1000)
            n = ev.usage.completion_tokens if ev.usage is not None else 0
            if t.total_ms is not None and t.ttft_server_ms is not None and n > 1:
                self.v_tpot.labels(model).observe(max(0.0, t.total_ms - t.ttft_server_ms) / 1000 / (n - 1))
        if ev.cost is not None:
            c = ev.cost
            for stage, secs in (("prefill", c.prefill_s), ("transfer", c.transfer_s), ("decode", c.decode_s)):
                self.worker_seconds.labels(ev.tenant, model, stage).inc(max(0.0, secs))
            self.saved_seconds.labels(ev.tenant, model).inc(max(0.0, c.saved_s))
        itl = self.v_itl.labels(model)
        for g in ev.itl_ms:
            itl.observe(g / 1000)
        if ev.kv_bytes:
            self.v_kv_bytes.labels(model).inc(ev.kv_bytes)

    # --- feeding ------------------------------------------------------------------------------------------
    def on_finished(self, ev: RequestFinished, now: float | None = None) -> None:
        """Both halves below: what a process that sees every request's end alone (``splitserve top``) does."""
        self.count_finished(ev)
        self.see_finished(ev, now)

    def count_finished(self, ev: RequestFinished) -> None:
        """The request's counters and histograms. Several front doors share this work (a NATS queue group): each
        request is counted by exactly one of them, so summing a series over the front doors (as Prometheus does
        over pods) gives the cluster's figure, and the cost per request does not grow with the front doors."""
        self._on_finished_vllm_style(ev)
        route = ev.route.value if ev.route is not None else "none"
        self.requests.labels(ev.tenant, route, ev.status).inc()
        if ev.error_code is not None:
            self.errors.labels(ev.error_code.value).inc()
        if ev.usage is not None:
            u = ev.usage
            self.tokens.labels(ev.tenant, "prompt").inc(u.prompt_tokens)
            self.tokens.labels(ev.tenant, "completion").inc(u.completion_tokens)
            self.tokens.labels(ev.tenant, "cached").inc(u.cached_tokens)
        t = ev.timings
        if t is not None:
            if t.ttft_server_ms is not None:
                self.ttft.labels(ev.tenant, route).observe(t.ttft_server_ms / 1000)
            if t.total_ms is not None:
                self.e2e.labels(ev.tenant, route).observe(t.total_ms / 1000)
            if t.queue_ms is not None:
                self.queue.labels(ev.tenant).observe(max(0.0, t.queue_ms) / 1000)
            if t.transfer_ms is not None:
                self.kv_seconds.observe(t.transfer_ms / 1000)
        itl = self.itl.labels(ev.tenant, route)
        for g in ev.itl_ms:
            itl.observe(g / 1000)
        if ev.kv_bytes:
            self.kv_bytes.inc(ev.kv_bytes)

    def see_finished(self, ev: RequestFinished, now: float | None = None) -> None:
        """The cluster-wide views every front door keeps whole (cheap): the recent rates of the console and
        ``snapshot``, and the prefix cache's hit ratio (a gauge: the same cluster value on every front door)."""
        now = time.monotonic() if now is None else now
        completion = 0
        if ev.usage is not None:
            u = ev.usage
            completion = u.completion_tokens
            self._prompt += u.prompt_tokens
            self._cached += u.cached_tokens
            if self._prompt:
                self.hit_ratio.set(self._cached / self._prompt)
        self._recent.append(_Done(now, ev.tenant, ev.status, completion))
        self._trim(now)

    def on_heartbeat(self, hb: Heartbeat, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.workers[hb.worker_id] = (hb, now)
        if hb.model and hb.role == "decode":
            self._any_model = hb.model
        w, role, load = hb.worker_id, hb.role, hb.load
        self.up.labels(w, role).set(1 if hb.state == "ready" else 0)
        self.active.labels(w, role).set(load.active_seqs)
        self.queued.labels(w, role).set(load.queued_requests)
        self.queued_tokens.labels(w, role).set(load.queued_prefill_tokens)
        self.free_blocks.labels(w, role).set(load.free_blocks)
        self.total_blocks.labels(w, role).set(load.total_blocks)
        self.cached_blocks.labels(w, role).set(load.cached_blocks)
        self._refresh(now)

    def _refresh(self, now: float) -> None:
        depth: dict[str, int] = {}
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for wid, (hb, seen) in list(self.workers.items()):
            if now - seen > self.stale_s or hb.state == "stopped":
                self.up.labels(wid, hb.role).set(0)
                if now - seen > 10 * self.stale_s:
                    del self.workers[wid]
                continue
            depth[hb.role] = depth.get(hb.role, 0) + hb.load.queued_requests
            if hb.role in ("decode", "prefill"):
                model = hb.model or self._any_model or UNKNOWN_MODEL
                waiting[model] = waiting.get(model, 0) + hb.load.queued_requests
                if hb.role == "decode":
                    running[model] = running.get(model, 0) + hb.load.active_seqs
        for model in running.keys() | waiting.keys():
            self.v_running.labels(model).set(running.get(model, 0))
            self.v_waiting.labels(model).set(waiting.get(model, 0))
        for role, n in depth.items():
            self.queue_depth.labels(role).set(n)

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0].t > self.window_s:
            self._recent.popleft()

    # --- reading ------------------------------------------------------------------------------------------
    def exposition(self, now: float | None = None) -> bytes:
        self._refresh(time.monotonic() if now is None else now)
        return generate_latest(self.registry)

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """What ``splitserve top`` shows: live workers with their load, and recent rates."""
        now = time.monotonic() if now is None else now
        self._trim(now)
        span = self.window_s
        tenants: dict[str, dict[str, float]] = {}
        for d in self._recent:
            t = tenants.setdefault(d.tenant, {"requests_per_s": 0.0, "tokens_per_s": 0.0, "errors": 0.0})
            t["requests_per_s"] += 1 / span
            t["tokens_per_s"] += d.tokens / span
            t["errors"] += d.status == "error"
        workers = []
        for wid, (hb, seen) in sorted(self.workers.items(), key=lambda kv: (kv[1][0].role, kv[0])):
            live = now - seen <= self.stale_s and hb.state == "ready"
            workers.append({"worker": wid, "role": hb.role, "state": hb.state if live else "silent",
                            "active": hb.load.active_seqs, "queued": hb.load.queued_requests,
                            "queued_prefill_tokens": hb.load.queued_prefill_tokens,
                            "free_blocks": hb.load.free_blocks, "cached_blocks": hb.load.cached_blocks,
                            "prefill_tokens_per_s": hb.load.prefill_tokens_per_s, "age_s": round(now - seen, 1)})
        return {"workers": workers, "tenants": tenants, "window_s": span,
                "prefix_cache_hit_ratio": self._cached / self._prompt if self._prompt else None}
