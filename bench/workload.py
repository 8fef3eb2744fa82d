"""Mooncake trace replay workload shared by the benchmarks: requests -> lookups + KV event batches.

Each request (in timestamp order) is assigned to one of N workers the way a KV-aware router would (Dynamo's
cost: uncached blocks of this request plus the uncached blocks the worker was given in the last
``load_window_ms``; fewest wins, ties rotate), with the overlap read from a ``PrefixIndex`` fed by the same
events. The worker's cache is an LRU of ``capacity_blocks`` blocks (``None``: unbounded): the request's
blocks are touched first-block-most-recent (vLLM frees a sequence's blocks tail first, so tails are evicted
first); new blocks become ``BlockStored`` events and evictions ``BlockRemoved`` events, shaped as
``EVENT_SHAPES`` says; all of a request's events go in one sequenced ``KvEventBatch``.

The op stream is generated once, outside any timed region, so every index is measured on the same ops.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.cache import (
    MOONCAKE_BLOCK_TOKENS,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    PrefixIndex,
    batch,
    mooncake_block_hashes,
    removed,
    root_hash,
    stored,
)
from splitserve.tenancy.config import TenantsConfig

# The project's reference data lives beside the checkout: ../shared/data (CI has the same copy). Installed from
# a wheel there is no checkout: $SPLITSERVE_TRACES_DIR (or each benchmark's --trace / --traces-dir) says where.
TRACES_ENV = "SPLITSERVE_TRACES_DIR"


def traces_dir() -> Path:
    env = os.environ.get(TRACES_ENV, "").strip()
    return Path(env).expanduser() if env else Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"


DEFAULT_TRACE = traces_dir() / "mooncake_synthetic_trace.jsonl"

LOOKUP = 0
BATCH = 1
# "vllm": events shaped the way vLLM emits them (a BlockStored per prefill chunk of ``chunk_tokens``, a
# BlockRemoved per evicted block); "coarse": one BlockStored per contiguous run of new blocks and one
# BlockRemoved per eviction sweep (fewer, fatter events: the harder case for an ops/s figure).
EVENT_SHAPES = ("vllm", "coarse")


@dataclass(slots=True)
class TraceRow:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRow]:
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            rows.append(
                TraceRow(
                    int(d["timestamp"]),
                    int(d["input_length"]),
                    int(d["output_length"]),
                    [int(x) for x in d["hash_ids"]],
                )
            )
            if limit is not None and len(rows) >= limit:
                break
    rows.sort(key=lambda r: r.timestamp_ms)
    return rows


def row_tenant(i: int, tenants: int, sessions: int | None = None) -> str | None:
    """The tenant serving trace row ``i`` when the replay spreads the trace over ``tenants`` tenants (0: none,
    the trace's own unsalted id space). With ``sessions``, a session (``i % sessions``) belongs to one tenant."""
    if tenants <= 0:
        return None
    return f"tenant-{(i % sessions if sessions else i) % tenants}"


def tenant_root(tenant: str | None) -> int | None:
    """The root of a trace row's hash chain when ``tenant`` serves it: scoped by that tenant's cache salt (as
    the live router salts every request without a tenants file), so tenants never share a block. None: the
    default Mooncake root."""
    if tenant is None:
        return None
    return root_hash("mooncake", extra=(TenantsConfig.open_mode().cache_salt(tenant),))


def offset_rows(rows: list[TraceRow], copy: int = 1) -> list[TraceRow]:
    """The trace again in a disjoint hash-id space (same shape and sharing, no overlap with the original)."""
    offset = (max((h for r in rows for h in r.hash_ids), default=0) + 1) * copy
    return [
        TraceRow(r.timestamp_ms, r.input_length, r.output_length, [h + offset for h in r.hash_ids])
        for r in rows
    ]


def duplicate_rows(rows: list[TraceRow], factor: int) -> list[TraceRow]:
    """``factor`` copies of the trace with disjoint hash-id spaces (Dynamo's trace duplication)."""
    if factor <= 1:
        return rows
    offset = max((h for r in rows for h in r.hash_ids), default=0) + 1
    out = [
        TraceRow(r.timestamp_ms, r.input_length, r.output_length, [h + offset * d for h in r.hash_ids])
        for r in rows
        for d in range(factor)
    ]
    out.sort(key=lambda r: r.timestamp_ms)
    return out


class WorkerCaches:
    """Each worker's KV cache as an LRU of block hashes, turned into the KV event batches it would publish."""

    def __init__(
        self,
        capacity_blocks: int | None,
        block_size: int,
        event_shape: str = "vllm",
        chunk_tokens: int = 8192,
    ) -> None:
        if event_shape not in EVENT_SHAPES:
            raise ValueError(f"event_shape must be one of {EVENT_SHAPES}")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.shape = event_shape
        self.chunk_blocks = max(1, chunk_tokens // block_size)
        self.lru: dict[str, OrderedDict[int, None]] = {}
        self.seq: dict[str, int] = {}

    def touch(self, worker: str, hashes: list[int], ts: float) -> KvEventBatch | None:
        """The worker ran a prompt with these blocks: the batch of events it publishes (None if none)."""
        cache = self.lru.get(worker)
        if cache is None:
            cache = self.lru[worker] = OrderedDict()
        held = [h in cache for h in hashes]
        for h in reversed(hashes):  # first block ends most recent: tails are evicted first
            cache[h] = None
            cache.move_to_end(h)
        events: list[KvEvent] = []
        start = None
        for i, was_held in enumerate(held + [True]):
            if not was_held and start is None:
                start = i
            elif was_held and start is not None:
                # vLLM caches a request's newly full blocks once per scheduler step, i.e. per prefill
                # chunk; the coarse shape reports a whole run at once.
                step = i - start if self.shape == "coarse" else self.chunk_blocks
                for a in range(start, i, step):
                    b = min(a + step, i)
                    events.append(stored(hashes[a:b], hashes[a - 1] if a else None, block_size=self.block_size))
                start = None
        gone: list[int] = []
        if self.capacity is not None:
            while len(cache) > self.capacity:
                gone.append(cache.popitem(last=False)[0])
        if gone:
            if self.shape == "coarse":
                events.append(removed(gone))
            else:  # vLLM's BlockPool emits one BlockRemoved per evicted block
                events.extend(removed([h]) for h in gone)
        if not events:
            return None
        seq = self.seq.get(worker, 0)
        self.seq[worker] = seq + 1
        return batch(worker, seq, events, ts)


@dataclass
class Workload:
    ops: list[tuple[int, object]]  # (LOOKUP, hashes) | (BATCH, KvEventBatch)
    workers: list[str]
    requests: int
    lookups: int
    events: int
    stored_events: int
    removed_events: int
    batches: int
    lookup_blocks: int
    event_blocks: int
    hit_blocks: int  # blocks found on the worker each request was routed to
    best_hit_blocks: int  # blocks found on the best worker (same as hit_blocks unless load overrode it)
    request_hashes: list[list[int]] = field(default_factory=list)
    assignment: list[str] = field(default_factory=list)
    caches: WorkerCaches | None = None  # the workers' caches after the replay (to continue from)

    @property
    def ops_count(self) -> int:
        return self.lookups + self.events

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0

    def batches_iter(self) -> Iterator[KvEventBatch]:
        for kind, payload in self.ops:
            if kind == BATCH:
                assert isinstance(payload, KvEventBatch)
                yield payload


def build_workload(
    rows: list[TraceRow],
    n_workers: int,
    *,
    capacity_blocks: int | None = 2048,
    block_size: int = MOONCAKE_BLOCK_TOKENS,
    load_window_ms: int = 10_000,
    event_shape: str = "vllm",
    chunk_tokens: int = 8192,
    keep_requests: bool = False,
    tenants: int = 0,
    sessions: int | None = None,
) -> Workload:
    caches = WorkerCaches(capacity_blocks, block_size, event_shape, chunk_tokens)
    workers = [f"worker-{i:03d}" for i in range(n_workers)]
    index = PrefixIndex()
    recent: deque[tuple[int, int, int]] = deque()  # (ts, worker, uncached blocks) inside the load window
    load = [0] * n_workers
    ops: list[tuple[int, object]] = []
    counts = {
        "lookups": 0,
        "events": 0,
        "stored": 0,
        "removed": 0,
        "batches": 0,
        "lookup_blocks": 0,
        "event_blocks": 0,
        "hit": 0,
        "best_hit": 0,
    }
    request_hashes: list[list[int]] = []
    assignment: list[str] = []
    for r_i, row in enumerate(rows):
        # ``tenants``: each row hashed under its tenant's salt (see row_tenant / tenant_root)
        hashes = mooncake_block_hashes(row.hash_ids, block_size, parent=tenant_root(row_tenant(r_i, tenants, sessions)))
        if not hashes:
            continue
        now = row.timestamp_ms
        while recent and recent[0][0] <= now - load_window_ms:
            _, w_old, n_old = recent.popleft()
            load[w_old] -= n_old
        ops.append((LOOKUP, hashes))
        counts["lookups"] += 1
        counts["lookup_blocks"] += len(hashes)
        overlap = index.lookup(hashes)
        n = len(hashes)
        best_cost = None
        chosen = 0
        for k in range(n_workers):
            w = (r_i + k) % n_workers  # rotating start: fair ties
            cost = load[w] + n - overlap.get(workers[w], 0)
            if best_cost is None or cost < best_cost:
                best_cost, chosen = cost, w
        hit = overlap.get(workers[chosen], 0)
        counts["hit"] += hit
        counts["best_hit"] += max(overlap.values(), default=0)
        uncached = n - hit
        load[chosen] += uncached
        recent.append((now, chosen, uncached))

        batch = caches.touch(workers[chosen], hashes, float(now))
        if batch is not None:
            index.apply(batch)
            ops.append((BATCH, batch))
            counts["batches"] += 1
            for ev in batch.events:
                counts["events"] += 1
                if isinstance(ev, BlockStored):
                    counts["stored"] += 1
                    counts["event_blocks"] += len(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    counts["removed"] += 1
                    counts["event_blocks"] += len(ev.block_hashes)
        if keep_requests:
            request_hashes.append(hashes)
            assignment.append(workers[chosen])
    return Workload(
        ops=ops,
        workers=workers,
        requests=counts["lookups"],
        lookups=counts["lookups"],
        events=counts["events"],
        stored_events=counts["stored"],
        removed_events=counts["removed"],
        batches=counts["batches"],
        lookup_blocks=counts["lookup_blocks"],
        event_blocks=counts["event_blocks"],
        hit_blocks=counts["hit"],
        best_hit_blocks=counts["best_hit"],
        request_hashes=request_hashes,
        assignment=assignment,
        caches=caches,
    )
