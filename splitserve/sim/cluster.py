"""The simulated cluster: workers, the live routing policy driven as the router service drives it, metrics.

:class:`SimConfig` says what to simulate; :func:`simulate` runs it and returns a :class:`~.metrics.SimResult`.

The router side is the live code, unchanged (see :mod:`splitserve.routing.live`):

* the :class:`~splitserve.routing.Router` (one per model with its own settings: ``build_policies``) with the
  service's ``DisaggPolicy`` and ``ContextPools``, deciding on :class:`WorkerView` s made by ``view_from_load``
  from simulated heartbeats (every ``heartbeat_s``, staggered per worker), in the order the live registry lists
  them;
* the :class:`~splitserve.routing.book.RequestBook` the service keeps: a flight per dispatched request, fed
  every heartbeat (what each worker lists and runs) and every end, and dispatch paced by its ``free_slots``;
* ``router.release(key, worker)`` for every request the book says a worker's heartbeat lists, ``release(key)``
  when it finishes (the pending-load ledger of ``cost.py``/``pending.py``). Requests are named as the live
  router names them, by ``proto.request_key(tenant, request_id)`` (the routing request's id, the ledger's key
  and what heartbeats list), since a request id is unique only within its tenant;
* ``router.apply_events`` with each worker's KV event batches (:mod:`splitserve.cache.events`), delivered
  after ``bus_delay_s``, into the router's :class:`~splitserve.cache.index.PrefixIndex` replica;
* the :class:`~splitserve.tenancy.quota.QuotaBook` at intake (check / admit / finish) and the
  :class:`~splitserve.tenancy.fairshare.FairScheduler` at dispatch (pick / charge / settle).

Colocated mode is ``prefill=0`` (every prompt prefilled on its decoder, chunked by default).

Several models (``SimConfig.pools``: one :class:`ModelPool` per served model) run as the live router runs them:
a request is routed only among its model's workers (the live ``_live()`` filter), waits in its model's queue
lanes, dispatched while that model's decoders have free slots (``RequestBook.free_slots(now, model)``: one
model's full decoders never hold back another's requests), and its prefix cache is salted per (model, adapter)
(no hit crosses models or adapters). LoRA adapters: a request's ``lora`` is served by its model's workers, each
with ``max_loras`` slots loaded on demand (:mod:`.workers`); the candidates are chosen by the live affinity rule
(:func:`splitserve.routing.adapters.adapter_views`) from what each worker's last heartbeat listed as loaded,
unless ``lora_affinity`` is off. Without pools the cluster is the one model it always was, unchanged.
``record=True`` keeps the router's inputs and decisions (:attr:`Sim.log`) for the live-equivalence test.

SLO targets: every routing request carries its tenant's (``slo:`` in the tenants file, target by target), else the
run's ``ttft_slo_s`` / ``tpot_slo_s``, so ``strategy="slo"`` routes on them. ``slo_admission=True`` applies the live
intake's :class:`~splitserve.routing.admission.SloAdmission` on arrival (after the quota check): the policy's
``slo_estimate`` plus the wait in the tenant's queue lane (what is queued ahead at its fair share of the recent
dispatch rate) against the targets; a refused request is counted in ``refused`` (code ``slo_ttft_unmeetable`` /
``slo_itl_unmeetable``) and in the summary's ``admission`` figures. Off (the default), nothing of this runs.
"""

from __future__ import annotations

import functools
import random
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from splitserve.cache.events import KvEventBatch
from splitserve.cache.index import PrefixIndex
from splitserve.obs.rates import EventRate
from splitserve.proto import request_key
from splitserve.routing import NoWorkers, RoutingRequest, WorkerView
from splitserve.routing.adapter_lru import AdapterLru
from splitserve.routing.adapters import adapter_views
from splitserve.routing.admission import Refuse, SloAdmission, queue_wait_for, weighted_share
from splitserve.routing.book import Flight, RequestBook
from splitserve.routing.live import build_policies, dispatch_batch, live_disagg, view_from_load
from splitserve.sim.clock import EventLoop
from splitserve.sim.fabric import ModelSpec, fabric, model_spec
from splitserve.sim.latency import StepFit, latency_model
from splitserve.sim.metrics import SimResult, collect
from splitserve.sim.workers import DecodeWorker, PrefillWorker, Seq
from splitserve.sim.workload import SimRequest
from splitserve.tenancy.config import TenantsConfig, load_tenants
from splitserve.tenancy.contracts import ContractGate, Funding
from splitserve.tenancy.fairshare import FairScheduler
from splitserve.tenancy.quota import QuotaBook

__all__ = ["ModelPool", "Sim", "SimConfig", "simulate"]


@dataclass
class ModelPool:
    """One served model of a multi-model cluster and its workers (``SimConfig.pools``)."""

    name: str  # the served model's name (what a request's ``model`` names)
    prefill: int = 1
    decode: int = 1
    max_loras: int = 0  # LoRA slots per worker, loaded on demand (``--max-loras``; 0: every adapter loaded)
    lora_load_s: float = 0.05  # one adapter load (host to GPU), paid by the step that admits its sequence
    arch: str | None = None  # KV bytes per token and weights (a ``fabric.MODELS`` name; None: SimConfig.model)
    latency: str | StepFit | None = None  # its workers' step times (None: SimConfig's prefill/decode models)
    strategy: str | None = None  # its own routing strategy (None: SimConfig.strategy), as up's models[].strategy
    disagg_threshold: int | None = None  # its own disaggregation threshold (None: SimConfig.disagg_threshold)


@dataclass
class SimConfig:
    """One simulated deployment. Latency models are names (see :func:`splitserve.sim.latency.latency_model`)
    or :class:`StepFit` objects; ``decode_latency`` defaults to ``prefill_latency``."""

    prefill: int = 1
    decode: int = 1
    long_decode: int = 0  # decoders of the ``long`` context pool
    model: str = "llama2-70b"
    prefill_latency: str | StepFit = "splitwise:llama2-70b:h100:tp8"
    decode_latency: str | StepFit | None = None
    fabric: str = "efa"
    gpus_per_prefill: int = 8  # for cost: GPUs one prefill worker uses (its TP degree)
    gpus_per_decode: int = 8
    kv_tokens: int | None = None  # KV capacity per worker in tokens (None: from the GPU memory and the model)
    gpu_mem_gb: float = 80.0
    block_size: int = 16
    max_seqs: int = 256
    decode_token_budget: int = 2048  # tokens per decoder step (decodes + prefill chunks)
    decode_ctx_budget: int | None = None  # context tokens one decode step may read (None: every stream, each step)
    chunked_prefill: bool = True
    fused_steps: bool = True  # a prefill chunk rides in the decode step's pass (vLLM); False: separate passes
    prefill_token_budget: int = 8192
    # the live router's settings (RouterService defaults)
    strategy: str = "kvaware"
    disagg_threshold: int = 512
    max_stall_ms: float | None = 100.0
    decoder_prefill_tps: float = 400.0
    long_prompt_tokens: int = 2048
    queue: bool = True  # False: dispatch at intake (the service's --no-queue)
    tenants_file: str | None = None
    tenants: TenantsConfig | None = None  # a parsed tenants file (the what-if's); takes precedence over tenants_file
    heartbeat_s: float = 0.5
    bus_delay_s: float = 0.0005
    # SLO
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    attainment: float = 0.9
    # SLO admission at intake (the live router's 429): off by default
    slo_admission: bool = False
    admission_slack: float = 1.0  # refuse when queue wait + predicted TTFT > target * slack
    seed: int = 0
    record: bool = False
    util_buckets: int = 100
    # several models: one pool each (None: the one model above, with ``prefill``/``decode``/``long_decode``)
    pools: list[ModelPool] | None = None
    max_loras: int = 0  # the one model's LoRA slots per worker (0: every adapter loaded); pools set their own
    lora_load_s: float = 0.05
    lora_affinity: bool = True  # the router's --lora-affinity (False: every worker of the model competes)

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        if self.tenants is not None:  # names only: a tenants file holds credentials
            d["tenants"] = sorted(self.tenants.tenants)
        for k in ("prefill_latency", "decode_latency"):
            v = getattr(self, k)
            d[k] = v.name if isinstance(v, StepFit) else v
        for pd, pool in zip(d["pools"] or (), self.pools or (), strict=True):
            pd["latency"] = pool.latency.name if isinstance(pool.latency, StepFit) else pool.latency
        return d

    @property
    def gpus(self) -> int:
        if self.pools:
            return sum(p.prefill * self.gpus_per_prefill + p.decode * self.gpus_per_decode for p in self.pools)
        return self.prefill * self.gpus_per_prefill + (self.decode + self.long_decode) * self.gpus_per_decode


_WEIGHTS_GB = {"opt-13b": 26, "opt-66b": 132, "llama2-70b": 140, "llama-3.1-8b": 16, "llama-3.3-70b": 141,
               "bloom-176b": 352, "smollm2-135m": 0.6}


def _fit(v: str | StepFit) -> StepFit:
    return v if isinstance(v, StepFit) else latency_model(v)


def _check_pools(cfg: SimConfig) -> None:
    pools = cfg.pools or []
    names = [p.name for p in pools]
    if not pools:
        if cfg.decode + cfg.long_decode < 1:
            raise ValueError("the cluster needs at least one decoder")
        if cfg.prefill < 0 or cfg.decode < 0:
            raise ValueError("worker counts must be >= 0")
        if cfg.max_loras < 0 or cfg.lora_load_s < 0:
            raise ValueError("max_loras and lora_load_s must be >= 0")
        return
    if len(set(names)) != len(names) or not all(names):
        raise ValueError(f"model pool names must be unique and non-empty: {names}")
    if cfg.long_decode:
        raise ValueError("long-context decoders are not simulated with model pools")
    for p in pools:
        if p.decode < 1 or p.prefill < 0:
            raise ValueError(f"model pool {p.name!r} needs at least one decoder and >= 0 prefillers")
        if p.max_loras < 0 or p.lora_load_s < 0:
            raise ValueError(f"model pool {p.name!r}: max_loras and lora_load_s must be >= 0")


class Sim:
    def __init__(self, cfg: SimConfig, requests: Sequence[SimRequest]) -> None:
        _check_pools(cfg)
        self.cfg = cfg
        self.requests = list(requests)
        self.loop = EventLoop()
        self.rng = random.Random(cfg.seed)
        spec = model_spec(cfg.model)
        self.spec = spec
        self.fabric = fabric(cfg.fabric)
        self.kv_bpt = spec.kv_bytes_per_token
        pfit = _fit(cfg.prefill_latency)
        dfit = _fit(cfg.decode_latency) if cfg.decode_latency is not None else pfit
        bs = cfg.block_size

        def blocks(gpus: int, arch: ModelSpec = spec) -> int:
            if cfg.kv_tokens is not None:
                return cfg.kv_tokens // bs
            free = max(0.0, (cfg.gpu_mem_gb * gpus - _WEIGHTS_GB.get(arch.name, 0)) * 0.9) * 1e9
            return int(free / arch.kv_bytes_per_token) // bs

        self.decoders: list[DecodeWorker] = []
        self.prefillers: list[PrefillWorker] = []
        # the served models: the pools', or the one model (named by its architecture, as a worker names its files)
        self.multi = bool(cfg.pools)
        self.pools = list(cfg.pools) if cfg.pools else [
            ModelPool(cfg.model, cfg.prefill, cfg.decode, cfg.max_loras, cfg.lora_load_s)]
        self.default_model = self.pools[0].name
        self.model_of: dict[str, str] = {}  # worker id -> the model it serves
        self._spec_of: dict[str, ModelSpec] = {}  # worker id -> its model's architecture (multi-model)
        if not self.multi:
            for i in range(cfg.decode + cfg.long_decode):
                pool = "long" if i >= cfg.decode else "general"
                w = DecodeWorker(f"d{i}" if pool == "general" else f"ld{i - cfg.decode}", dfit,
                                 blocks(cfg.gpus_per_decode), bs, self, max_seqs=cfg.max_seqs,
                                 token_budget=cfg.decode_token_budget, chunked=cfg.chunked_prefill, pool=pool,
                                 fused=cfg.fused_steps, ctx_budget=cfg.decode_ctx_budget)
                self.decoders.append(w)
            self.prefillers = [PrefillWorker(f"p{i}", pfit, blocks(cfg.gpus_per_prefill), bs, self,
                                             token_budget=cfg.prefill_token_budget, kv_bytes_per_token=self.kv_bpt)
                               for i in range(cfg.prefill)]
        else:
            for mp in self.pools:
                self._add_pool(mp, pfit, dfit, blocks)
        self.workers: list[DecodeWorker | PrefillWorker] = [*self.decoders, *self.prefillers]
        self.by_id = {w.wid: w for w in self.workers}
        top = self.pools[0]
        for wk in self.workers:
            self.model_of.setdefault(wk.wid, top.name)
            if not self.multi and top.max_loras:
                wk.lru, wk.lora_load_s = AdapterLru(top.max_loras), top.lora_load_s
        # what each worker's last heartbeat listed as loaded (workers without on-demand slots have every adapter)
        self.hb_adapters: dict[str, frozenset[str]] = {}

        # --- the live router's objects --------------------------------------------------------------------
        self.index = PrefixIndex()
        self.disagg = live_disagg(cfg.disagg_threshold, cfg.max_stall_ms, cfg.decoder_prefill_tps)
        # the live router's policies: one per pool with its own strategy or threshold (routing.policies)
        own = {mp.name: (mp.strategy or cfg.strategy, self.disagg if mp.disagg_threshold is None else
                         replace(self.disagg, min_uncached_tokens=mp.disagg_threshold))
               for mp in (cfg.pools or []) if mp.strategy is not None or mp.disagg_threshold is not None}
        self.router = build_policies(cfg.strategy, self.disagg, self.index, cfg.long_prompt_tokens, own)
        if cfg.tenants is not None:
            self.tenants = cfg.tenants
        else:
            self.tenants = load_tenants(cfg.tenants_file) if cfg.tenants_file else TenantsConfig.open_mode()
        self.quota = QuotaBook(self.tenants)
        self.fair = FairScheduler(self.tenants.weight)
        # the live router's contract gate (splitserve.tenancy.contracts), over this book's flights
        self.contracts = ContractGate(self.tenants.contract, self.tenants.priority,
                                      lambda t: self.book.by_tenant.get(t, 0), self.tenants.contracts())
        self.contracts_on = bool(self.tenants.contracts()) or self.tenants.defaults.contract is not None
        # heartbeat-derived state, in the live registry's order (decoders, then prefillers; first heard first)
        self.views: list[WorkerView] = []
        self._pos: dict[str, int] = {}
        self._n_decode_views = 0
        self.book: RequestBook[Flight] = RequestBook()  # the live router's flight table and slot ledger
        # queue lanes per served model (None: the one model), each per tenant, as the live router's lanes are
        lanes: list[str | None] = [mp.name for mp in self.pools] if self.multi else [None]
        self.lanes: dict[str | None, dict[str, deque[SimRequest]]] = {m: {} for m in lanes}
        self.lane_pending: dict[str | None, dict[str, int]] = {m: {} for m in lanes}
        self.done: list[Seq] = []
        self.refused: list[tuple[SimRequest, str]] = []
        # SLO targets per tenant (ms), SLO admission and the dispatch rate its queue-wait estimate reads
        self._slo_targets: dict[str, tuple[float | None, float | None]] = {}
        self.admission = SloAdmission(slack=cfg.admission_slack) if cfg.slo_admission else None
        self.dispatched: dict[str, EventRate] = {}  # per tenant, as the live router measures it (admission)
        self.admission_log: list[tuple[str, str, int]] = []  # (tenant, reason, retry_after_s) per refusal
        self.failed: list[tuple[SimRequest, str]] = []
        self.kv_bytes = 0
        self.log: list[tuple[Any, ...]] = []
        self.itl = array("d")
        self.itl_by_kind: dict[str, array[float]] = {}
        self._kinds = any(r.kind for r in self.requests)  # any per-kind ITL to keep
        self.horizon = max((r.arrival_s for r in self.requests), default=0.0) + 1.0
        nb = max(1, cfg.util_buckets)
        self.util_dt = self.horizon / nb
        self.util = {"prefill": [0.0] * (nb + 1), "decode": [0.0] * (nb + 1)}

    def _add_pool(self, mp: ModelPool, pfit: StepFit, dfit: StepFit, blocks: Any) -> None:
        """One model's workers, named ``{model}/d{i}`` and ``{model}/p{i}``."""
        cfg = self.cfg
        arch = model_spec(mp.arch) if mp.arch else self.spec
        if mp.latency is not None:
            pfit = dfit = _fit(mp.latency)
        ws: list[DecodeWorker | PrefillWorker] = []
        for i in range(mp.decode):
            d = DecodeWorker(f"{mp.name}/d{i}", dfit, blocks(cfg.gpus_per_decode, arch), cfg.block_size, self,
                             max_seqs=cfg.max_seqs, token_budget=cfg.decode_token_budget, chunked=cfg.chunked_prefill,
                             fused=cfg.fused_steps, ctx_budget=cfg.decode_ctx_budget)
            self.decoders.append(d)
            ws.append(d)
        for i in range(mp.prefill):
            p = PrefillWorker(f"{mp.name}/p{i}", pfit, blocks(cfg.gpus_per_prefill, arch), cfg.block_size, self,
                              token_budget=cfg.prefill_token_budget, kv_bytes_per_token=arch.kv_bytes_per_token)
            self.prefillers.append(p)
            ws.append(p)
        for w in ws:
            self.model_of[w.wid] = mp.name
            self._spec_of[w.wid] = arch
            if mp.max_loras:
                w.lru, w.lora_load_s = AdapterLru(mp.max_loras), mp.lora_load_s

    def model_for(self, r: SimRequest) -> str:
        """The served model a request gets (none named: the default; with one model, any name is it)."""
        if not self.multi or not r.model:
            return self.default_model
        return r.model

    # ------------------------------------------------------------------------------------------ heartbeats
    def _heartbeat(self, w: DecodeWorker | PrefillWorker, schedule: bool = True) -> None:
        now = self.loop.now
        ld = w.load()  # the live worker's rule (splitserve.routing.load)
        pool = w.pool if w.role == "decode" else "general"
        active = ld.active_seqs
        view = view_from_load(w.wid, w.role, pool, ld)
        held = w.active()
        wid = w.wid
        if w.lru is not None:  # the heartbeat's ``adapters`` (every pool adapter is in ``adapters_available``)
            self.hb_adapters[wid] = frozenset(w.lru.loaded())
        if self.cfg.record:  # the heartbeat's active_requests: request keys (ids are unique per tenant only)
            self.log.append(("hb", now, wid, w.role, pool, {
                "active_seqs": active, "queued_requests": ld.queued_requests,
                "queued_prefill_tokens": ld.queued_prefill_tokens, "free_blocks": ld.free_blocks,
                "total_blocks": ld.total_blocks, "used_blocks": ld.used_blocks,
                "prefill_tokens_per_s": ld.prefill_tokens_per_s, "step_ms": ld.step_ms, "max_seqs": ld.max_seqs},
                [s.key for s in held]))
        pos = self._pos.get(wid)
        if pos is None:
            self._register(w, view)
        else:
            self.views[pos] = view
        # As the live router: the book takes the report, and every request of its it lists is released from the
        # pending-load ledger (this worker's own figures count it now).
        release = self.router.release
        for key in self.book.heartbeat(wid, w.role, [s.key for s in held], now, running=active + ld.queued_requests,
                                       max_seqs=w.max_seqs if isinstance(w, DecodeWorker) else None, pool=pool,
                                       model=self.model_of[wid] if self.multi else None):
            release(key, wid)
        if schedule:
            self.loop.after(self.cfg.heartbeat_s, self._hb_event, w)
        self._dispatch()

    def _hb_event(self, w: DecodeWorker | PrefillWorker) -> None:
        self._heartbeat(w)

    def _register(self, w: DecodeWorker | PrefillWorker, view: WorkerView) -> None:
        # live: registry.live("decode") + registry.live("prefill"), each in first-heard order
        views, pos = self.views, self._pos
        if w.role == "decode":
            at = self._n_decode_views  # after the decoders heard so far, before the prefillers
            self._n_decode_views += 1
            views.insert(at, view)
            for i in range(at, len(views)):
                pos[views[i].worker_id] = i
        else:
            pos[view.worker_id] = len(views)
            views.append(view)

    # ------------------------------------------------------------------------------------------ KV events
    def publish_kv(self, batch: KvEventBatch) -> None:
        self.loop.after(self.cfg.bus_delay_s, self._kv_arrive, batch)

    def _kv_arrive(self, batch: KvEventBatch) -> None:
        if self.cfg.record:
            self.log.append(("kv", self.loop.now, batch.model_dump()))
        self.router.apply_events(batch)

    # ------------------------------------------------------------------------------------------ requests
    def _arrive(self, r: SimRequest) -> None:
        now = self.loop.now
        lane = self.model_for(r) if self.multi else None
        queues = self.lanes.get(lane)
        if queues is None:  # intake refuses a model not served (model_not_found)
            self.refused.append((r, "model_not_found"))
            return
        q = queues.get(r.tenant)
        queued = len(q) if q else 0
        refusal = self.quota.check(r.tenant, r.prompt_tokens, r.output_tokens, queued, now)
        if refusal is not None:
            self.refused.append((r, refusal.code))
            return
        if self.admission is not None and not self._admit_slo(r, lane, queued, now):
            return
        self.quota.admit(r.tenant, r.request_id, r.prompt_tokens, r.output_tokens, now)
        if not self.cfg.queue:
            self._route(r)
            return
        if q is None:
            q = queues[r.tenant] = deque()
        q.append(r)
        self.lane_pending[lane][r.tenant] = len(q)
        self._dispatch()

    def slo_targets(self, tenant: str) -> tuple[float | None, float | None]:
        """(TTFT, ITL) targets in ms of a tenant's requests: its own SLO's, else the run's."""
        t = self._slo_targets.get(tenant)
        if t is None:
            slo = self.tenants.slo(tenant)
            ttft = slo.ttft_p99_ms if slo is not None and slo.ttft_p99_ms is not None else self.cfg.ttft_slo_s * 1000
            itl = slo.itl_p99_ms if slo is not None and slo.itl_p99_ms is not None else self.cfg.tpot_slo_s * 1000
            t = self._slo_targets[tenant] = (ttft, itl)
        return t

    def _admit_slo(self, r: SimRequest, lane: str | None, queued: int, now: float) -> bool:
        """The live intake's SLO admission: False (and counted as refused) when no worker can serve ``r`` in time
        once what is queued ahead of it in its lane has dispatched."""
        assert self.admission is not None
        scoped = self.multi or r.lora is not None
        model = self.model_for(r) if scoped else None
        ttft, itl = self.slo_targets(r.tenant)
        rreq = RoutingRequest(request_id=request_key(r.tenant, r.request_id), tenant=r.tenant,
                              block_hashes=r.hashes(self.cfg.block_size, model), prompt_tokens=r.prompt_tokens,
                              session_key=r.session, ttft_slo_ms=ttft, itl_slo_ms=itl)
        try:
            est = self.router.slo_estimate(rreq, self._candidates(r, model) if scoped else self.views, now, model)
        except NoWorkers:
            return True  # routing fails it the same way, and says so
        wait = 0.0
        # As the live intake (splitserve.services.router.slo_gate): its tenant's requests queued ahead of it
        if self.cfg.queue and queued > 0:
            views = self._candidates(r, model) if scoped else self.views
            rate = self.dispatched.get(r.tenant)
            share = weighted_share(r.tenant, self.lane_pending[lane], self.tenants.weight)
            wait = queue_wait_for(queued, self.book.free_slots(now, lane), views, self.router.predictor_of(model),
                                  r.output_tokens, share, rate.per_s(now) if rate is not None else 0.0,
                                  ((s.decoder, s.left) for d in self.decoders for s in d.running), est.decoder)
        verdict = self.admission.check(est, ttft, itl, wait)
        if isinstance(verdict, Refuse):
            self.refused.append((r, f"slo_{verdict.reason}"))
            self.admission_log.append((r.tenant, verdict.reason, verdict.retry_after_s))
            return False
        return True

    def _dispatch(self) -> None:
        if not self.cfg.queue:
            return
        for lane, queues in self.lanes.items():
            self._dispatch_lane(lane, queues, self.lane_pending[lane])

    def _dispatch_lane(self, lane: str | None, queues: dict[str, deque[SimRequest]], pending: dict[str, int]) -> None:
        """Pull one model's queued requests while its decoders have free slots (None: the one model's, all)."""
        book = self.book
        while (free := book.free_slots(self.loop.now, lane)) > 0:
            guaranteed = False
            if self.contracts_on:  # as the live router: the contract gate, one request at a time
                uses = None if lane is None else functools.partial(self.tenants.allows_model, model=lane)
                picked = self.contracts.pick(pending, free, self.fair.pick, self.loop.now, uses)
                if picked is None:
                    return
                tenant, batch, guaranteed = picked[0], 1, picked[1] is Funding.GUARANTEED
            else:
                fair = self.fair.pick(pending)
                if fair is None:
                    return
                tenant, batch = fair, dispatch_batch(free)
            q = queues[tenant]
            for _ in range(min(batch, len(q))):
                self._route(q.popleft(), guaranteed)
            pending[tenant] = len(q)

    def _route(self, r: SimRequest, guaranteed: bool = False) -> None:
        now = self.loop.now
        cfg = self.cfg
        scoped = self.multi or r.lora is not None
        model = self.model_for(r) if scoped else None
        hashes = r.hashes(cfg.block_size, model)  # salted per (model, adapter) as the live router does
        key = request_key(r.tenant, r.request_id)  # as the live router names it (ids are unique per tenant)
        ttft_slo, itl_slo = self.slo_targets(r.tenant)
        rreq = RoutingRequest(request_id=key, tenant=r.tenant, block_hashes=hashes,
                              prompt_tokens=r.prompt_tokens, session_key=r.session, ttft_slo_ms=ttft_slo,
                              itl_slo_ms=itl_slo)
        try:
            d = self.router.decide(rreq, self._candidates(r, model) if scoped else self.views, now, model)
        except NoWorkers as exc:
            self.failed.append((r, str(exc)))
            self.quota.finish(r.tenant, r.request_id, None, now)
            return
        if cfg.record:  # the decision as the live router publishes it: the policy knows the request by its key
            # (and the free slots dispatch saw: the live router's book must offer the same)
            self.log.append(("slots", now, self.book.free_slots(now)))
            self.log.append(("route", now, r.request_id, r.tenant, r.token_ids, r.output_tokens,
                             {**d.to_dict(), "request_id": r.request_id}))
        if self.admission is not None:
            if (rate := self.dispatched.get(r.tenant)) is None:
                rate = self.dispatched[r.tenant] = EventRate()
            rate.add(now)
        charge = r.prompt_tokens + r.output_tokens
        self.fair.charge(r.tenant, charge)
        if self.contracts_on:
            self.contracts.dispatched(r.tenant, d.uncached_tokens, now)
        s = Seq(r, route=d.route, decoder=d.decoder, prefiller=d.prefiller, hashes=hashes, dispatched_s=now,
                charged=charge, key=key, guaranteed=guaranteed)
        s.decoder_cached = d.cached_tokens
        self.book.add(Flight(request_id=r.request_id, tenant=r.tenant, decoder=d.decoder, prefiller=d.prefiller,
                             charged=charge), now)
        if d.prefiller is not None:
            self.loop.after(cfg.bus_delay_s, self._to_prefiller, s)
        else:
            self.loop.after(cfg.bus_delay_s, self._to_decoder, s)

    def _candidates(self, r: SimRequest, model: str | None) -> list[WorkerView]:
        """The live router's candidates for a request of ``model``: that model's workers (``_live()``), then for an
        adapter the affinity rule over what their heartbeats listed loaded (``adapter_views``)."""
        views = self.views
        if self.multi:
            of = self.model_of
            views = [v for v in views if of[v.worker_id] == model]
        lora = r.lora
        if lora is None:
            return views
        hb = self.hb_adapters
        loaded = {v.worker_id for v in views if v.worker_id not in hb or lora in hb[v.worker_id]}
        decoders = [v for v in views if v.role == "decode"]
        prefillers = [v for v in views if v.role != "decode"]
        out, _ = adapter_views(decoders, prefillers, loaded, self.cfg.lora_affinity)
        return out

    def _to_prefiller(self, s: Seq) -> None:
        self.by_id[s.prefiller].submit(s)  # type: ignore[index,union-attr]

    def _to_decoder(self, s: Seq) -> None:
        self.by_id[s.decoder].submit_direct(s)  # type: ignore[union-attr]

    # ------------------------------------------------------------------------------------------ worker callbacks
    def transfer_s(self, s: Seq, nbytes: int, compute_s: float) -> float:
        self.kv_bytes += nbytes
        layers = self._spec_of[s.decoder].layers if self.multi else self.spec.layers
        return self.fabric.transfer_s(nbytes, compute_s, layers) + self.cfg.bus_delay_s

    def kv_landed(self, s: Seq) -> None:
        # The prefiller's first token reaches the client with the KV hand-off.
        now = self.loop.now
        s.route = "disaggregated"
        s.first_token_s = now
        s.last_token_s = now
        s.left = s.req.output_tokens - 1
        if s.left <= 0:
            s.finish_s = now
            self.finished(s)
            return
        self.by_id[s.decoder].submit_landed(s)  # type: ignore[union-attr]

    def first_token(self, s: Seq) -> None:
        s.first_token_s = self.loop.now

    def tokens(self, seqs: list[Seq], gaps: list[float]) -> None:
        """One step's tokens: ``seqs[i]`` produced one ``gaps[i]`` after its last (the worker keeps each
        sequence's own ITL figures)."""
        self.itl.extend(gaps)
        if self._kinds:
            by_kind = self.itl_by_kind
            for s, gap in zip(seqs, gaps, strict=True):
                k = s.req.kind
                if k:
                    arr = by_kind.get(k)
                    if arr is None:
                        arr = by_kind[k] = array("d")
                    arr.append(gap)

    def finished(self, s: Seq) -> None:
        now = self.loop.now
        r = s.req
        rid = r.request_id
        self.book.ended(s.key, s.decoder)  # reported by its decoder, as the live RequestFinished is
        used = r.prompt_tokens + r.output_tokens
        if self.cfg.record:
            self.log.append(("fin", now, rid, r.tenant, r.prompt_tokens, r.output_tokens, s.decoder))
        self.router.release(s.key)
        self.fair.settle(r.tenant, s.charged, used)
        self.quota.finish(r.tenant, rid, used, now)
        r.drop_hashes()
        s.hashes = []
        self.done.append(s)
        self._dispatch()

    def account(self, w: object, start: float, dur: float) -> None:
        series = self.util["decode" if getattr(w, "role", "") == "decode" else "prefill"]
        dt = self.util_dt
        end = start + dur
        i = int(start / dt)
        while start < end and i < len(series):
            edge = (i + 1) * dt
            step = (edge if edge < end else end) - start
            series[i] += step
            start += step
            i += 1

    # ------------------------------------------------------------------------------------------ run
    def run(self, max_sim_s: float | None = None) -> SimResult:
        loop = self.loop
        hb = self.cfg.heartbeat_s
        for w in self.workers:  # everyone has announced itself before the first request (a warm cluster)
            self._heartbeat(w, schedule=False)
        n = len(self.workers)
        for i, w in enumerate(self.workers):
            loop.at(hb * (i + 1) / (n + 1), self._hb_event, w)
        for r in self.requests:
            loop.at(r.arrival_s, self._arrive, r)
        total = len(self.requests)

        def drained() -> bool:
            return len(self.done) + len(self.refused) + len(self.failed) >= total

        limit = max_sim_s if max_sim_s is not None else self.horizon * 20 + 600.0
        loop.run(until=limit, stop=drained)
        return collect(self)


def simulate(cfg: SimConfig, requests: Sequence[SimRequest], max_sim_s: float | None = None) -> SimResult:
    """Run one simulation and return its metrics."""
    return Sim(cfg, requests).run(max_sim_s)

