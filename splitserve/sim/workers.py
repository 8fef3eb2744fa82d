"""Simulated engines: prefill workers and decode workers, their KV capacity, prefix caches and KV events.

A worker is a step loop on the simulator's clock: when it has work and is idle it composes one batch, asks
the latency model how long that batch takes, and applies the batch's effects when the step ends.

* :class:`PrefillWorker` - FCFS batches of prompts up to a token budget (a prompt over the budget runs
  alone), whole prompts per step (prefill-only engines need no chunking). Its prefix cache saves the cached
  part of a prompt; each finished prompt's KV is pushed to the decoder over the fabric.
* :class:`DecodeWorker` - continuous batching: every running stream gets one token per step; requests routed
  *direct* are prefilled locally, in chunks of the step's spare token budget riding along with the decodes
  (chunked prefill, as vLLM and Sarathi do) or, with chunking off, as whole prompts in steps of their own
  that pause every stream. With a ``ctx_budget`` a step decodes only the streams whose context fits it, taken
  in turn (the rest wait a step; DistServe's simulated decoder caps a step at 50,000 context tokens). Admission
  reserves KV blocks for the prompt's uncached part and the output (no preemption), evicting
  least-recently-used unpinned prefix blocks when it must, never the cached prefix it is about to reuse; a
  request that still does not fit waits.

Both keep a prefix cache of finished prompts' full blocks (LRU, sharing the KV pool) and publish vLLM-style
KV event batches (:mod:`splitserve.cache.events`) with per-worker sequence numbers - the same structs the
live router's index consumes. Loads for heartbeats are read off the worker by the cluster.

LoRA adapters (``lru``: the worker's ``--max-loras`` slots, :class:`~splitserve.routing.adapter_lru.AdapterLru`):
a sequence whose adapter is not loaded has it loaded when it is admitted (a prefill batch, a decoder's admission),
evicting the least recently used adapter no running sequence holds; the load (``lora_load_s``) is added to that
step, so every stream of the worker waits for it, as the engine's own load blocks its loop. A sequence whose
adapter cannot be loaded (every slot held by running sequences) waits while later ones are admitted, as the live
decoder admits the first pending job whose adapter can be ready; a prefill batch stops at it. Without ``lru``
every adapter is loaded and nothing is loaded on demand.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from splitserve.cache.events import KvEvent, KvEventBatch, batch, removed, stored
from splitserve.proto import WorkerLoad, request_key
from splitserve.routing.adapter_lru import AdapterLru
from splitserve.routing.load import decoder_load, prefiller_load
from splitserve.tenancy.config import TenantsConfig
from splitserve.tenancy.fairqueue import FairQueue

if TYPE_CHECKING:
    from splitserve.sim.clock import EventLoop
    from splitserve.sim.latency import StepFit
    from splitserve.sim.workload import SimRequest

__all__ = ["DecodeWorker", "PrefillWorker", "PrefixCache", "Seq"]


@dataclass(slots=True)
class Seq:
    """One request's life in the cluster, and its measurements."""

    req: SimRequest
    route: str = "direct"
    decoder: str = ""
    prefiller: str | None = None
    hashes: list[int] = field(default_factory=list)
    dispatched_s: float = 0.0
    prefill_start_s: float = -1.0
    prefill_end_s: float = -1.0
    first_token_s: float = -1.0
    finish_s: float = -1.0
    last_token_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens the computing worker already held
    decoder_cached: int = 0  # prompt tokens the decoder held when routed (not transferred)
    todo: int = 0  # prompt tokens left to compute (local prefill)
    done: int = 0  # prompt tokens computed or cached (local prefill)
    ctx: int = 0  # tokens in the KV (prompt + generated)
    left: int = 0  # tokens still to generate
    blocks: int = 0  # KV blocks reserved on the decoder
    pinned: list[int] = field(default_factory=list)  # cached prefix blocks in use (not evictable)
    kv_bytes: int = 0
    alloc: int = 0  # tokens the reserved blocks can hold
    recompute: bool = False  # preempted: its context is recomputed on readmission
    itl_max: float = 0.0
    itl_sum: float = 0.0
    itls: int = 0
    charged: int = 0
    guaranteed: bool = False  # funded by its tenant's contract guarantee: prefillers serve it first
    # ``proto.request_key(tenant, request_id)``: how heartbeats list it and the router's ledger names it (a
    # request id is unique only within its tenant); derived from ``req`` when not given
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            self.key = request_key(self.req.tenant, self.req.request_id)


class PrefixCache:
    """A worker's KV pool in blocks: active sequences' blocks plus an LRU of reusable prefix blocks."""

    __slots__ = ("total", "bs", "used", "lru", "pins", "events", "hits", "lookups", "evicted")

    def __init__(self, total_blocks: int, block_size: int) -> None:
        self.total = total_blocks
        self.bs = block_size
        self.used = 0  # blocks held by active sequences (not counting pinned cache blocks)
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.pins: dict[int, int] = {}
        self.events: list[KvEvent] = []
        self.hits = 0
        self.lookups = 0
        self.evicted = 0

    @property
    def free(self) -> int:
        return self.total - self.used - len(self.lru)

    def match(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` held here."""
        lru = self.lru
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def pin(self, hashes: list[int]) -> None:
        pins, lru = self.pins, self.lru
        for h in hashes:
            pins[h] = pins.get(h, 0) + 1
            lru.move_to_end(h)

    def unpin(self, hashes: list[int]) -> None:
        pins = self.pins
        for h in hashes:
            n = pins.get(h, 0) - 1
            if n > 0:
                pins[h] = n
            else:
                pins.pop(h, None)

    def reserve(self, blocks: int, keep: list[int] | None = None) -> bool:
        """Take ``blocks`` for a sequence, evicting unpinned prefix blocks if needed; False if impossible.

        ``keep``: cached blocks the caller matched and will pin once this succeeds. They are held for the
        eviction only, so making room can never drop the prefix the sequence is about to reuse."""
        if blocks > self.free:
            if keep:
                # Held through the pin counts alone, not ``pin``: a failed reserve must leave the LRU order
                # untouched, and when nothing of ``keep`` would have been evicted anyway the eviction
                # (and so every run that never needed this) stays exactly what it was.
                pins = self.pins
                for h in keep:
                    pins[h] = pins.get(h, 0) + 1
                ok = self._evict(blocks - self.free)
                self.unpin(keep)
            else:
                ok = self._evict(blocks - self.free)
            if not ok:
                return False
        self.used += blocks
        return True

    def release(self, blocks: int) -> None:
        self.used -= blocks

    def _evict(self, need: int) -> bool:
        lru, pins = self.lru, self.pins
        if len(lru) - len(pins) < need:
            return False
        gone: list[int] = []
        skipped: list[int] = []
        while len(gone) < need and lru:
            h, _ = lru.popitem(last=False)
            if h in pins:
                skipped.append(h)
            else:
                gone.append(h)
        for h in reversed(skipped):
            lru[h] = None
            lru.move_to_end(h, last=False)
        if gone:
            self.events.append(removed(gone))
            self.evicted += len(gone)
        return len(gone) >= need

    def insert(self, hashes: list[int]) -> None:
        """A finished prompt's full blocks become reusable prefix blocks (as much as fits)."""
        if not hashes or self.total <= 0:
            return
        lru = self.lru
        new = [h for h in hashes if h not in lru]
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
        if not new:
            return
        room = self.free
        if room < len(new) and not self._evict(min(len(new) - room, len(lru) - len(self.pins))):
            pass
        room = self.free
        if room <= 0:
            return
        new = new[:room]  # a chain's leading blocks are the reusable ones
        for h in new:
            lru[h] = None
        self.events.append(stored(new, block_size=self.bs))


class _Worker:
    role = "decode"

    def __init__(self, wid: str, model: StepFit, kv_blocks: int, block_size: int, ctx: Cluster) -> None:
        self.wid = wid
        self.model = model
        self.cache = PrefixCache(kv_blocks, block_size)
        self.bs = block_size
        self.c = ctx
        self.busy = False
        self.busy_s = 0.0
        self.steps = 0
        self.kv_seq = -1
        self.step_ms_ema: float | None = None
        self.pool = "general"
        self.lru: AdapterLru | None = None  # LoRA slots loaded on demand (None: every adapter loaded)
        self.lora_load_s = 0.0  # one adapter load
        self.lora_wait_s = 0.0  # adapter loads the next step pays for

    def _lora_admit(self, lru: AdapterLru, s: Seq, held: set[str]) -> None:
        """``s`` is admitted: its adapter is made ready (a load is paid by this step) and held."""
        name = s.req.lora
        if name is None:
            return
        if lru.admit(name, held):
            self.lora_wait_s += self.lora_load_s
        held.add(name)

    def flush_events(self) -> None:
        ev = self.cache.events
        if ev:
            self.kv_seq += 1
            self.cache.events = []
            self.c.publish_kv(batch(self.wid, self.kv_seq, ev, self.c.loop.now * 1000.0))

    def _ran(self, dur: float) -> None:
        self.busy_s += dur
        self.steps += 1
        self.c.account(self, self.c.loop.now, dur)


class Cluster(Protocol):
    """What a worker needs from the simulation around it (implemented by :class:`splitserve.sim.cluster.Sim`)."""

    loop: EventLoop
    tenants: TenantsConfig  # the weights a prefiller's fair queue serves by

    def publish_kv(self, batch: KvEventBatch) -> None: ...
    def account(self, w: object, start: float, dur: float) -> None: ...
    def first_token(self, s: Seq) -> None: ...
    def tokens(self, seqs: list[Seq], gaps: list[float]) -> None: ...
    def finished(self, s: Seq) -> None: ...
    def kv_landed(self, s: Seq) -> None: ...
    def transfer_s(self, s: Seq, nbytes: int, compute_s: float) -> float: ...


class PrefillWorker(_Worker):
    role = "prefill"

    def __init__(self, wid: str, model: StepFit, kv_blocks: int, block_size: int, ctx: Cluster, *,
                 token_budget: int = 8192, kv_bytes_per_token: int = 0) -> None:
        super().__init__(wid, model, kv_blocks, block_size, ctx)
        # waiting prompts, served by weighted tokens between tenants as the live prefiller serves them
        self.q: FairQueue[Seq] = FairQueue(lambda t: ctx.tenants.weight(t))
        self.batch: list[Seq] = []
        self.token_budget = token_budget
        self.kv_bpt = kv_bytes_per_token
        self.queued_tokens = 0
        self.rate = model.prefill_tokens_per_s()

    def submit(self, s: Seq) -> None:
        hit = self.cache.match(s.hashes)
        s.cached_tokens = min(hit * self.bs, s.req.prompt_tokens - 1)
        s.todo = s.req.prompt_tokens - s.cached_tokens
        self.queued_tokens += s.todo
        self.q.push(s.req.tenant, s.todo, s, s.guaranteed)
        if not self.busy:
            self._step(None)

    def _step(self, _: object) -> None:
        loop = self.c.loop
        if self.batch:
            self._done(self.batch)
            self.batch = []
        if not self.q:
            self.busy = False
            self.flush_events()
            return
        lru = self.lru
        if lru is None:
            batch = [self.q.pop()]
            tokens = batch[0].todo
            while self.q and tokens + self.q.peek().todo <= self.token_budget:
                s = self.q.pop()
                tokens += s.todo
                batch.append(s)
        else:
            batch, tokens = self._lora_batch(lru)
        self.queued_tokens -= tokens
        dur = self.model.prefill_ms([s.todo for s in batch]) / 1000.0
        if self.lora_wait_s:
            dur += self.lora_wait_s
            self.lora_wait_s = 0.0
        for s in batch:
            s.prefill_start_s = loop.now
        self.busy = True
        self.batch = batch
        self._ran(dur)
        loop.after(dur, self._step)

    def _lora_batch(self, lru: AdapterLru) -> tuple[list[Seq], int]:
        """The FCFS batch while its adapters fit the slots (a batch holds every adapter it runs with), with its
        adapters loaded; and its tokens."""
        q = self.q
        held: set[str] = set()  # nothing runs between batches: the first prompt's adapter always fits
        first = q.pop()
        self._lora_admit(lru, first, held)
        batch, tokens = [first], first.todo
        while q and tokens + q.peek().todo <= self.token_budget and lru.can_admit(q.peek().req.lora, held):
            s = q.pop()
            self._lora_admit(lru, s, held)
            tokens += s.todo
            batch.append(s)
        return batch, tokens

    def _done(self, batch: list[Seq]) -> None:
        now = self.c.loop.now
        for s in batch:
            s.prefill_end_s = now
            self.cache.insert(s.hashes)
            compute = now - s.prefill_start_s
            nbytes = self.kv_bpt * (s.req.prompt_tokens - s.decoder_cached)
            s.kv_bytes = nbytes
            self.c.loop.after(self.c.transfer_s(s, nbytes, compute), self.c.kv_landed, s)
        self.flush_events()

    def load(self) -> WorkerLoad:
        """Its heartbeat's load, by the live prefiller's rule (``splitserve.routing.load``)."""
        return prefiller_load(running=len(self.batch), waiting=len(self.q),
                              running_tokens=sum(s.todo for s in self.batch), waiting_tokens=self.queued_tokens,
                              prefill_tokens_per_s=round(self.rate, 1))

    def active(self) -> list[Seq]:
        """The sequences it holds, in the order its heartbeat lists them."""
        return [*self.batch, *self.q]


class DecodeWorker(_Worker):
    role = "decode"

    def __init__(self, wid: str, model: StepFit, kv_blocks: int, block_size: int, ctx: Cluster, *,
                 max_seqs: int = 256, token_budget: int = 2048, chunked: bool = True, pool: str = "general",
                 fused: bool = True, ctx_budget: int | None = None) -> None:
        super().__init__(wid, model, kv_blocks, block_size, ctx)
        self.max_seqs = max_seqs
        self.token_budget = token_budget
        self.chunked = chunked
        self.fused = fused
        self.pool = pool
        self.waiting: deque[Seq] = deque()  # direct requests and landed-KV requests waiting for admission
        self.prefilling: list[Seq] = []
        self.running: list[Seq] = []
        self.step_batch: tuple[list[Seq], list[tuple[Seq, int]]] | None = None
        self.queued_tokens = 0
        self.ctx_sum = 0
        self.rate = model.prefill_tokens_per_s()
        self.preemptions = 0
        self.ctx_budget = ctx_budget

    # --- admission ---------------------------------------------------------------------------------------
    def submit_direct(self, s: Seq) -> None:
        s.route = "direct"
        self.waiting.append(s)
        self.queued_tokens += s.req.prompt_tokens
        self._kick()

    def submit_landed(self, s: Seq) -> None:
        self.waiting.append(s)
        self._kick()

    def _kick(self) -> None:
        if not self.busy:
            self._step(None)

    def _admit(self) -> None:
        # Paged allocation as vLLM does it: a sequence is admitted with its prompt's blocks (plus one to
        # grow into) and takes a block whenever its context crosses a block boundary; when none is left the
        # youngest running sequence is preempted and later recomputed.
        w = self.waiting
        bs = self.bs
        cache = self.cache
        now = self.c.loop.now
        lru = self.lru
        held: set[str] = set()
        if lru is not None:
            held = {s.req.lora for s in (*self.running, *self.prefilling) if s.req.lora is not None}
        while w and len(self.running) + len(self.prefilling) < self.max_seqs:
            if lru is None:
                s = w[0]
            else:
                nxt = self._lora_next(lru, held)
                if nxt is None:
                    break  # every waiting sequence's adapter waits for a slot a running sequence holds
                s = nxt
            p = s.req.prompt_tokens
            if s.route == "direct" or s.recompute:
                hit = 0 if s.recompute else cache.match(s.hashes)
                total = s.ctx if s.recompute else p
                need = -(-(total - hit * bs) // bs) + 1
                # the matched blocks are still unpinned here: the reserve must not evict them to make room
                # (``need`` counts on them, and pinning an evicted block fails)
                matched = s.hashes[:hit]
                if not cache.reserve(need, matched):
                    if self.running or self.prefilling:
                        break
                    need = max(0, cache.free)  # larger than the whole pool: run it degraded rather than never
                    cache.reserve(need)
                w.popleft()
                if not s.recompute:
                    self.queued_tokens -= p
                    s.pinned = matched
                    cache.pin(s.pinned)
                    s.cached_tokens = min(hit * bs, p - 1)
                    s.prefill_start_s = now
                s.todo = total - (s.cached_tokens if not s.recompute else 0)
                s.done = total - s.todo
                s.blocks = need
                s.alloc = (need + len(s.pinned)) * bs
                self.prefilling.append(s)
                if lru is not None:
                    self._lora_admit(lru, s, held)
            else:
                need = -(-p // bs) + 1
                if not cache.reserve(need):
                    if self.running or self.prefilling:
                        break
                    need = max(0, cache.free)
                    cache.reserve(need)
                w.popleft()
                s.blocks = need
                s.alloc = need * bs
                s.ctx = p
                self.ctx_sum += p
                self.running.append(s)
                if lru is not None:
                    self._lora_admit(lru, s, held)

    def _lora_next(self, lru: AdapterLru, held: set[str]) -> Seq | None:
        """The first waiting sequence whose adapter can be ready without waiting, moved to the head of the line
        (None: none can). Admitting one that must wait would stall every stream: the others go first."""
        w = self.waiting
        for i, s in enumerate(w):
            if lru.can_admit(s.req.lora, held):
                if i:
                    del w[i]
                    w.appendleft(s)
                return s
        return None

    def _grow(self, s: Seq) -> bool:
        """``s`` needs one more block; preempt the youngest running sequences until it gets one.
        False if ``s`` itself was preempted."""
        cache = self.cache
        while not cache.reserve(1):
            victim = next((v for v in reversed(self.running) if v.left > 0 and not v.recompute), s)
            if victim.recompute:
                return False
            self._preempt(victim)
            if victim is s:
                return False
        s.blocks += 1
        s.alloc += self.bs
        return True

    def _preempt(self, v: Seq) -> None:
        self.running.remove(v)
        self.ctx_sum -= v.ctx
        self.cache.release(v.blocks)
        self.cache.unpin(v.pinned)
        v.pinned = []
        v.blocks = 0
        v.recompute = True
        self.preemptions += 1
        self.waiting.appendleft(v)

    # --- the step loop -------------------------------------------------------------------------------------
    def _step(self, _: object) -> None:
        c = self.c
        loop = c.loop
        last = None
        batch = self.step_batch
        if batch is not None:
            last = batch[0]
            self._apply(last, batch[1])
            self.step_batch = None
        if self.waiting:
            self._admit()
        if self.ctx_budget is not None and last:
            # the streams just decoded go to the back of the line, behind those that waited and those that
            # arrived during the step (DistServe: a decoded batch is re-queued at the end of the decode queue)
            was = set(map(id, last))
            self.running = [s for s in self.running if id(s) not in was] + [s for s in self.running if id(s) in was]
        chunks: list[tuple[Seq, int]] = []
        if self.prefilling:
            if self.chunked:
                budget = max(1, self.token_budget - len(self.running))
                for s in self.prefilling:
                    if budget <= 0:
                        break
                    n = s.todo if s.todo < budget else budget
                    chunks.append((s, n))
                    budget -= n
            else:
                chunks = [(s, s.todo) for s in self.prefilling]
        decodes = self.running if (self.chunked or not chunks) else []
        ctx = self.ctx_sum
        if decodes and self.ctx_budget is not None and ctx + len(decodes) > self.ctx_budget:
            # the streams in line order while their context (+ the token they add) fits; at least one
            left = self.ctx_budget
            n = 0
            for s in decodes:
                if s.ctx + 1 > left and n:
                    break
                left -= s.ctx + 1
                n += 1
            decodes = decodes[:n]
            ctx = sum(s.ctx for s in decodes)
        if not chunks and not decodes:
            self.busy = False
            self.flush_events()
            return
        if chunks and not self.fused:
            # an engine that runs a prefill chunk and a decode step as separate passes (the hf engine)
            dur = self.model.chunk_ms([(n, s.done) for s, n in chunks]) + (
                self.model.decode_ms(len(decodes), ctx) if decodes else 0.0)
        elif chunks:
            dur = self.model.mixed_ms([(n, s.done) for s, n in chunks], len(decodes), ctx if decodes else 0)
        else:
            dur = self.model.decode_ms(len(decodes), ctx)
        dur /= 1000.0
        if decodes and not chunks:
            e = self.step_ms_ema
            self.step_ms_ema = dur * 1000.0 if e is None else 0.8 * e + 0.2 * dur * 1000.0
        if self.lora_wait_s:  # (after the step-time figure: a load is not the engine's step)
            dur += self.lora_wait_s
            self.lora_wait_s = 0.0
        self.busy = True
        self.step_batch = (list(decodes), chunks)
        now = loop.now
        self.busy_s += dur  # _ran, inline (once per decode step: the simulator's most frequent event)
        self.steps += 1
        c.account(self, now, dur)
        loop.at(now + dur, self._step)

    def _apply(self, decodes: list[Seq], chunks: list[tuple[Seq, int]]) -> None:
        c = self.c
        now = c.loop.now
        finished: list[Seq] = []
        # the streams that produced a token this step and their inter-token gaps, reported in one call
        toks: list[Seq] = []
        gaps: list[float] = []
        for s in decodes:
            if s.recompute:
                continue  # preempted during this step's bookkeeping: its token is not produced
            gap = now - s.last_token_s
            s.last_token_s = now
            s.ctx += 1
            s.left -= 1
            toks.append(s)
            gaps.append(gap)
            s.itl_sum += gap
            s.itls += 1
            if gap > s.itl_max:
                s.itl_max = gap
            if s.left <= 0:
                finished.append(s)
            elif s.ctx >= s.alloc and not self._grow(s):
                continue
        if toks:
            self.ctx_sum += len(toks)  # one per token (integers: the same sum as adding each in turn)
            c.tokens(toks, gaps)
        for s, n in chunks:
            s.todo -= n
            s.done += n
            if s.todo <= 0:
                self.prefilling.remove(s)
                if s.recompute:  # a preempted sequence is back: it resumes its stream
                    s.recompute = False
                    self.ctx_sum += s.ctx
                    self.running.append(s)
                    continue
                s.prefill_end_s = now
                s.ctx = s.req.prompt_tokens
                self.ctx_sum += s.ctx
                s.left = s.req.output_tokens - 1
                s.last_token_s = now
                c.first_token(s)
                if s.left <= 0:
                    finished.append(s)
                else:
                    self.running.append(s)
        if finished:
            done = set(map(id, finished))
            self.running = [s for s in self.running if id(s) not in done]
            for s in finished:
                self.ctx_sum -= s.ctx
                self.cache.release(s.blocks)
                self.cache.unpin(s.pinned)
                self.cache.insert(s.hashes)
                s.finish_s = now
                c.finished(s)
            self.flush_events()

    # --- reports -------------------------------------------------------------------------------------------
    def load(self) -> WorkerLoad:
        """Its heartbeat's load, by the live decoder's rule (``splitserve.routing.load``)."""
        cache = self.cache
        return decoder_load(decoding=len(self.running), prefilling=len(self.prefilling), waiting=len(self.waiting),
                            prefill_tokens_left=sum(s.todo for s in self.prefilling),
                            waiting_prefill_tokens=self.queued_tokens, max_seqs=self.max_seqs,
                            free_blocks=max(0, cache.free), total_blocks=cache.total, used_blocks=cache.used,
                            prefill_tokens_per_s=round(self.rate, 1), step_ms=self.step_ms_ema)

    def active(self) -> list[Seq]:
        """The sequences it holds, in the order its heartbeat lists them."""
        return [*self.running, *self.prefilling, *self.waiting]
