"""Latency prediction per worker, learned online from the workers' own heartbeats: what the ``slo`` strategy,
the router's :meth:`~splitserve.routing.router.Router.slo_estimate` and SLO admission decide on.

This module owns :class:`LatencyPredictor` (and its :class:`PredictorConfig`) and :class:`SloEstimate`, the
record an estimate returns. Pure, synchronous and deterministic (no NATS, no engine, no clock of its own): the
live router and the simulator feed the very same object with the same :class:`WorkerView` s.

What it predicts, per candidate:

* **ITL** of a decoder: its decode step time at the batch it would run with this request,
  ``step_ms = a + b * seqs``. ``(a, b)`` is a weighted least-squares fit per worker over the
  ``(active_seqs, step_ms)`` pairs its heartbeats reported, older samples decaying (``decay`` per sample), so a
  worker that slows down (a longer context, a noisy neighbour) is followed. A worker's fit is shrunk towards the
  pooled fit of every worker (``prior_weight`` samples' worth, spread between batch 1 and ``ref_batch``), and the
  pooled fit towards the configured defaults the same way: a worker heard once already gets a sensible line, and
  a worker only ever seen at one batch size borrows the pool's slope instead of an undetermined one.
* **TTFT** through a prefill worker (the prefiller when disaggregated, else the decoder itself): the prefill work
  queued ahead of it plus this request's uncached tokens, at the worker's prefill rate (an EWMA of what it
  reports; the pool's EWMA, then ``default_prefill_tokens_per_s``, for one that reports none), plus one decode
  step on the decoder (the first token comes out of a forward pass) and ``overhead_ms``; all of it times the
  prefill worker's residual correction, an EWMA of measured / predicted TTFT fed by :meth:`observe_outcome`
  (bounded, so one outlier cannot make a worker look 100x slower).
* **KV wait** on a decoder: one whose free KV blocks cannot hold the request, or that already has requests
  waiting for admission, starts it only once running streams finish and free their blocks: ``kv_wait_ms`` per
  request in that line (:meth:`LatencyPredictor.kv_wait_ms`), added to the TTFT of every route through it.

A view teaches the predictor only when it says something new for its worker (its ``active_seqs``, ``step_ms``
or ``prefill_tokens_per_s`` changed, or it is another view object with different figures): the router calls
:meth:`observe` on every decision with the same heartbeat views many times over, and counting each of them as a
sample would weigh a worker by how often it was looked at. Memory is bounded: at most ``max_workers`` workers
(the least recently heard one is forgotten first) and :meth:`remove_worker` forgets one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from splitserve.routing.base import WorkerView

__all__ = ["LatencyPredictor", "PredictorConfig", "SloEstimate"]


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    """Defaults (used until workers report figures) and learning rates. Times in milliseconds."""

    default_step_ms: float = 30.0  # a decode step at batch 0 (the fixed cost of a forward pass)
    default_step_ms_per_seq: float = 0.5  # what each running stream adds to it
    default_prefill_tokens_per_s: float = 1000.0
    overhead_ms: float = 0.0  # per request, on top of prefill + one step (dispatch, KV hand-off, first delta)
    # A decoder whose free KV cannot take the request, or that already has requests waiting for a slot, admits
    # it only when running streams finish: this much per request in that line (it is the cost model's overflow
    # penalty in time units; the residual correction calibrates what it misses).
    kv_wait_ms: float = 1000.0
    decay: float = 0.97  # weight a worker's older step samples keep per new sample (~33-sample memory)
    pooled_decay: float = 0.995  # the same for the pooled fit over every worker's samples
    prior_weight: float = 2.0  # samples' worth of the pooled line in a worker's fit
    default_weight: float = 1.0  # samples' worth of the default line in the pooled fit
    ref_batch: int = 32  # the prior lines' second anchor (the first is batch 1)
    rate_alpha: float = 0.2  # EWMA weight of a new prefill-rate report
    correction_alpha: float = 0.1  # EWMA weight of a new measured / predicted TTFT ratio
    correction_min: float = 0.5
    correction_max: float = 4.0
    max_workers: int = 4096

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0 or not 0.0 < self.pooled_decay <= 1.0:
            raise ValueError("decay and pooled_decay must be within (0, 1]")
        if self.prior_weight <= 0 or self.default_weight <= 0:
            raise ValueError("prior_weight and default_weight must be positive")
        if self.ref_batch < 2:
            raise ValueError("ref_batch must be >= 2")
        if self.default_prefill_tokens_per_s <= 0:
            raise ValueError("default_prefill_tokens_per_s must be positive")
        if not 0.0 < self.correction_min <= 1.0 <= self.correction_max:
            raise ValueError("the correction bounds must hold 1.0")
        if self.max_workers < 1:
            raise ValueError("max_workers must be >= 1")


@dataclass(frozen=True, slots=True)
class SloEstimate:
    """The best candidate's predicted latencies for one request, routed nowhere (``Router.slo_estimate``).

    ``met``: whether that candidate meets the request's targets (None: the request has none). ``route`` is what
    the disaggregation rule would say on that decoder, ``prefiller`` the prefiller the TTFT assumes (None: the
    decoder prefills). ``candidates``: decoders weighed; ``meeting``: how many of them meet the targets."""

    ttft_ms: float
    itl_ms: float
    decoder: str
    prefiller: str | None = None
    route: str = "direct"
    cached_tokens: int = 0
    met: bool | None = None
    candidates: int = 0
    meeting: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ttft_ms"] = round(self.ttft_ms, 3) if math.isfinite(self.ttft_ms) else self.ttft_ms
        d["itl_ms"] = round(self.itl_ms, 3) if math.isfinite(self.itl_ms) else self.itl_ms
        return d


class _Stats:
    """Decayed weighted sums for a least-squares line y = a + b x."""

    __slots__ = ("w", "x", "y", "xx", "xy")

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.x = self.x * decay + x
        self.y = self.y * decay + y
        self.xx = self.xx * decay + x * x
        self.xy = self.xy * decay + x * y

    def fit(self, prior: tuple[float, float], weight: float, x2: float) -> tuple[float, float]:
        """The line through these samples plus ``weight`` pseudo-samples of the ``prior`` line, half at x=1 and
        half at ``x2`` (a ridge towards the prior that is in the samples' own units, so never singular)."""
        a0, b0 = prior
        h = weight / 2.0
        y1, y2 = a0 + b0, a0 + b0 * x2
        w = self.w + weight
        x = self.x + h * (1.0 + x2)
        y = self.y + h * (y1 + y2)
        xx = self.xx + h * (1.0 + x2 * x2)
        xy = self.xy + h * (y1 + x2 * y2)
        det = w * xx - x * x
        if det <= 1e-12:  # only when weight is tiny and every sample sits at one x
            return (y / w, b0) if w > 0 else prior
        b = (w * xy - x * y) / det
        return (y - b * x) / w, b


class _Worker:
    __slots__ = ("view", "seqs", "step", "rate", "stats", "fit", "fit_at", "prefill_rate", "corr", "heard")

    def __init__(self) -> None:
        self.view: WorkerView | None = None  # the last view object learned from (the cheap "nothing new" test)
        self.seqs = -1
        self.step: float | None = None
        self.rate: float | None = None
        self.stats: _Stats | None = None  # step samples (decoders only)
        self.fit: tuple[float, float] | None = None
        self.fit_at = -1  # the pooled fit's version this worker's fit was computed against
        self.prefill_rate: float | None = None  # EWMA of reported rates
        self.corr = 1.0
        self.heard = 0.0


class LatencyPredictor:
    """Per-worker TTFT / ITL prediction (see the module docstring). Not thread-safe; one per Router."""

    def __init__(self, config: PredictorConfig | None = None, **overrides: Any) -> None:
        cfg = config or PredictorConfig()
        if overrides:
            cfg = PredictorConfig(**{**asdict(cfg), **overrides})
        self.config = cfg
        self._workers: dict[str, _Worker] = {}
        self._pool = _Stats()
        self._pool_fit: tuple[float, float] = (cfg.default_step_ms, cfg.default_step_ms_per_seq)
        self._pool_version = 0  # bumped when the pooled fit changes: workers' fits are recomputed lazily
        self._pool_dirty = False
        self._pool_rate: float | None = None
        self.samples = 0  # step samples learned (for reports and tests)

    def __len__(self) -> int:
        return len(self._workers)

    def workers(self) -> list[str]:
        return list(self._workers)

    # ------------------------------------------------------------------------------------------ learning
    def observe(self, views: Sequence[WorkerView], now: float) -> int:
        """Learn from heartbeat views (raw, before any pending-load overlay: the step time was measured with
        the batch the worker reported). Returns the number of views that said something new."""
        ws = self._workers
        learned = 0
        for v in views:
            rec = ws.get(v.worker_id)
            if rec is not None:
                if rec.view is v:
                    continue  # the same heartbeat view again (the simulator reuses them between heartbeats)
                if v.active_seqs == rec.seqs and v.step_ms == rec.step and v.prefill_tokens_per_s == rec.rate:
                    rec.view = v
                    continue
            else:
                rec = self._new(v.worker_id)
            self._learn(rec, v, now)
            learned += 1
        return learned

    def _new(self, worker_id: str) -> _Worker:
        ws = self._workers
        if len(ws) >= self.config.max_workers:
            oldest = min(ws, key=lambda k: ws[k].heard)
            del ws[oldest]
        rec = ws[worker_id] = _Worker()
        return rec

    def _learn(self, rec: _Worker, v: WorkerView, now: float) -> None:
        cfg = self.config
        rec.view = v
        rec.heard = now
        step, seqs = v.step_ms, v.active_seqs
        # A step time next to an empty batch is the last batch's (engines keep reporting it after the streams
        # end): it would pin the line's intercept at whatever batch ran last.
        if step is not None and seqs > 0 and math.isfinite(step) and step > 0 and (
                step != rec.step or seqs != rec.seqs):
            if rec.stats is None:
                rec.stats = _Stats()
            rec.stats.add(float(seqs), step, cfg.decay)
            rec.fit_at = -1
            self._pool.add(float(seqs), step, cfg.pooled_decay)
            self._pool_dirty = True
            self.samples += 1
        rate = v.prefill_tokens_per_s
        if rate is not None and rate > 0 and math.isfinite(rate) and rate != rec.rate:
            a = cfg.rate_alpha
            rec.prefill_rate = rate if rec.prefill_rate is None else (1 - a) * rec.prefill_rate + a * rate
            pr = self._pool_rate
            self._pool_rate = rate if pr is None else (1 - a) * pr + a * rate
        rec.seqs, rec.step, rec.rate = seqs, step, rate

    def observe_outcome(self, worker_id: str, predicted_ttft_ms: float, actual_ttft_ms: float) -> None:
        """A finished request's measured TTFT against what was predicted for it (both through ``worker_id``, the
        worker that prefilled it): moves that worker's correction factor (bounded EWMA of the ratio)."""
        rec = self._workers.get(worker_id)
        if rec is None or not predicted_ttft_ms > 0 or not actual_ttft_ms >= 0:
            return
        if not math.isfinite(predicted_ttft_ms) or not math.isfinite(actual_ttft_ms):
            return
        cfg = self.config
        # The ratio to the uncorrected prediction: the correction is a fixed point, not a compounding factor.
        raw = predicted_ttft_ms / rec.corr
        ratio = min(max(actual_ttft_ms / raw, cfg.correction_min), cfg.correction_max)
        a = cfg.correction_alpha
        rec.corr = min(max((1 - a) * rec.corr + a * ratio, cfg.correction_min), cfg.correction_max)

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    # ------------------------------------------------------------------------------------------ predicting
    def pooled_fit(self) -> tuple[float, float]:
        """The pooled step line (a, b) over every worker's samples, shrunk towards the defaults."""
        if self._pool_dirty:
            cfg = self.config
            self._pool_fit = self._pool.fit((cfg.default_step_ms, cfg.default_step_ms_per_seq),
                                            cfg.default_weight, float(cfg.ref_batch))
            self._pool_version += 1
            self._pool_dirty = False
        return self._pool_fit

    def step_fit(self, worker_id: str) -> tuple[float, float]:
        """A worker's step line (a, b) in ms: its own samples shrunk towards the pooled line."""
        pooled = self.pooled_fit()
        rec = self._workers.get(worker_id)
        if rec is None or rec.stats is None:
            return pooled
        if rec.fit is None or rec.fit_at != self._pool_version:
            cfg = self.config
            rec.fit = rec.stats.fit(pooled, cfg.prior_weight, float(cfg.ref_batch))
            rec.fit_at = self._pool_version
        return rec.fit

    def step_ms(self, worker_id: str, batch: int) -> float:
        """Predicted decode step time of ``worker_id`` running ``batch`` streams (never below zero)."""
        a, b = self.step_fit(worker_id)
        t = a + b * batch
        return t if t > 0.0 else 0.0

    def itl_ms(self, decoder: WorkerView, extra_seqs: int = 1) -> float:
        """Predicted inter-token latency on ``decoder`` once ``extra_seqs`` more streams join it: its step at the
        batch it runs, the ones waiting for a slot and the newcomers."""
        return self.step_ms(decoder.worker_id, decoder.active_seqs + decoder.queued_requests + extra_seqs)

    def prefill_rate(self, view: WorkerView) -> float:
        """Tokens per second ``view``'s worker prefills at: its learned rate, else what the view reports, else the
        pool's, else the default."""
        rec = self._workers.get(view.worker_id)
        if rec is not None and rec.prefill_rate is not None:
            return rec.prefill_rate
        r = view.prefill_tokens_per_s
        if r is not None and r > 0:
            return r
        return self._pool_rate if self._pool_rate is not None else self.config.default_prefill_tokens_per_s

    def correction(self, worker_id: str) -> float:
        rec = self._workers.get(worker_id)
        return rec.corr if rec is not None else 1.0

    def prefill_ms(self, prefill: WorkerView, uncached_tokens: int) -> float:
        """Time until ``prefill``'s worker has computed this request's uncached tokens after the work queued
        ahead of it, uncorrected."""
        work = prefill.queued_prefill_tokens + (uncached_tokens if uncached_tokens > 0 else 0)
        return 1000.0 * work / self.prefill_rate(prefill) if work else 0.0

    def kv_wait_ms(self, decoder: WorkerView, need_blocks: int) -> float:
        """Predicted wait for KV / a decode slot on ``decoder`` for a request needing ``need_blocks`` new blocks:
        0 when its pool is unknown or takes it with nobody waiting, else ``kv_wait_ms`` per request in line; a
        decoder whose every slot is taken (``max_seqs`` known: a live heartbeat's) likewise."""
        if decoder.max_seqs and decoder.active_seqs >= decoder.max_seqs:
            # every slot taken: it starts when a stream ends, after the ones already waiting
            return self.config.kv_wait_ms * (decoder.queued_requests + decoder.waiting + 1)
        if not decoder.total_blocks or (need_blocks <= decoder.free_blocks and not decoder.queued_requests):
            return 0.0
        return self.config.kv_wait_ms * (decoder.queued_requests + 1)

    def ttft_ms(self, prefill: WorkerView, uncached_tokens: int, decoder: WorkerView | None = None, *,
                itl_ms: float | None = None) -> float:
        """Predicted time to first token when ``prefill``'s worker computes the prompt (the decoder itself when
        direct) and ``decoder`` (default: ``prefill``) runs the first step; ``itl_ms`` overrides that step."""
        if itl_ms is None:
            itl_ms = self.itl_ms(decoder if decoder is not None else prefill)
        raw = self.prefill_ms(prefill, uncached_tokens) + itl_ms + self.config.overhead_ms
        return raw * self.correction(prefill.worker_id)

    def describe(self) -> dict[str, Any]:
        a, b = self.pooled_fit()
        return {"workers": len(self._workers), "samples": self.samples, "pooled_step_ms": [round(a, 3), round(b, 4)],
                "pooled_prefill_tokens_per_s": self._pool_rate, "config": asdict(self.config)}
