"""PrefixIndex throughput and lookup latency on a Mooncake trace replay, beside a naive dict-of-sets index.

    python -m bench.index_bench --trace ../shared/data/traces/mooncake_synthetic_trace.jsonl \
        --workers 16 --json

Ops are counted the way Dynamo's ``mooncake_bench`` counts them: one op per lookup plus one per KV event
(a ``BlockStored`` / ``BlockRemoved`` carries a run of blocks); block ops (blocks in lookups plus blocks in
events) and requests (one lookup plus its batch) are reported beside them. The work per request is the same
under both event shapes, so ops/s mostly measures how many events a shape splits it into: "coarse" (about 2.5
ops a request) reads ~2.5x lower than "vllm" (about 7.7) at the same or better requests/s. The time goes in
per-block dict probes (~60-90 ns each in CPython, the floor of a Python loop); 1M coarse ops/s would need
~2.5 us a request for ~50 block probes, which takes native code.

Both indexes replay the same pre-generated op stream (see ``bench.workload``) on one thread; the lookup
results of the two are compared on every request before anything is timed. Latency percentiles come from a
separate pass that times each lookup on its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from bench.workload import (
    BATCH,
    DEFAULT_TRACE,
    EVENT_SHAPES,
    Workload,
    build_workload,
    duplicate_rows,
    load_trace,
)
from splitserve.cache import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, PrefixIndex

TARGET_OPS_PER_S = 1_000_000
TARGET_LOOKUP_P99_US = 50.0


class IndexLike(Protocol):
    def apply(self, batch: KvEventBatch) -> bool: ...

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]: ...


class NaiveIndex:
    """The baseline: worker -> set of held hashes (any tier) and worker -> medium -> set.

    Lookup walks the prompt once per worker (O(depth x workers)); this is the "Python dictionary" index of
    Dynamo's flash-indexer write-up, with the same sequence handling as PrefixIndex so results compare.
    """

    def __init__(self) -> None:
        self.any: dict[str, dict[int, int]] = {}  # worker -> hash -> number of tiers holding it
        self.tiers: dict[str, dict[str, set[int]]] = {}
        self.seq: dict[str, int] = {}

    def apply(self, batch: KvEventBatch) -> bool:
        w, seq = batch.worker_id, batch.seq
        last = self.seq.get(w)
        gap = False
        if last is None:
            gap = seq != 0
        elif seq != last + 1:
            if seq > last:
                gap = True
            elif seq == 0:
                self.any.pop(w, None)
                self.tiers.pop(w, None)
            else:
                return False
        self.seq[w] = seq
        anyw = self.any.setdefault(w, {})
        tiers = self.tiers.setdefault(w, {})
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                s = tiers.setdefault(ev.medium, set())
                for h in ev.block_hashes:
                    if h not in s:
                        s.add(h)
                        anyw[h] = anyw.get(h, 0) + 1
            elif isinstance(ev, BlockRemoved):
                s = tiers.setdefault(ev.medium, set())
                for h in ev.block_hashes:
                    if h in s:
                        s.discard(h)
                        c = anyw[h] - 1
                        if c:
                            anyw[h] = c
                        else:
                            del anyw[h]
            elif isinstance(ev, AllBlocksCleared):
                for medium in [ev.medium] if ev.medium is not None else list(tiers):
                    for h in tiers.pop(medium, set()):
                        c = anyw[h] - 1
                        if c:
                            anyw[h] = c
                        else:
                            del anyw[h]
        return gap

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        out = {}
        for w, held in self.any.items():
            n = 0
            for h in block_hashes:
                if h not in held:
                    break
                n += 1
            if n:
                out[w] = n
        return out


def _replay(index: IndexLike, ops: list[tuple[int, Any]]) -> float:
    lookup, apply = index.lookup, index.apply
    gc.disable()  # a collection in the middle of a few-ms run is noise, not index cost
    try:
        t0 = time.perf_counter()
        for kind, payload in ops:
            if kind:
                apply(payload)
            else:
                lookup(payload)
        return time.perf_counter() - t0
    finally:
        gc.enable()


def _latencies(index: IndexLike, ops: list[tuple[int, Any]]) -> tuple[list[float], list[float]]:
    lookup, apply = index.lookup, index.apply
    clock = time.perf_counter_ns
    lk: list[float] = []
    ap: list[float] = []
    gc.disable()
    try:
        for kind, payload in ops:
            t0 = clock()
            if kind:
                apply(payload)
                ap.append(clock() - t0)
            else:
                lookup(payload)
                lk.append(clock() - t0)
    finally:
        gc.enable()
    return lk, ap


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p / 100))]


def verify(workload: Workload, make: Callable[[], IndexLike], reference: Callable[[], IndexLike]) -> int:
    """Replay both and compare every lookup. Returns the number of lookups compared."""
    a, b = make(), reference()
    n = 0
    for kind, payload in workload.ops:
        if kind == BATCH:
            assert isinstance(payload, KvEventBatch)
            ga, gb = a.apply(payload), b.apply(payload)
            assert ga == gb, "gap detection differs from the reference"
        else:
            assert isinstance(payload, list)
            ra, rb = a.lookup(payload), b.lookup(payload)
            if ra != rb:
                raise AssertionError(f"lookup {n} differs: {ra} != {rb}")
            n += 1
    return n


def measure(name: str, make: Callable[[], IndexLike], workload: Workload, passes: int) -> dict[str, Any]:
    times = [_replay(make(), workload.ops) for _ in range(passes)]
    best, median = min(times), statistics.median(times)
    lk, ap = _latencies(make(), workload.ops)
    ops, blocks = workload.ops_count, workload.lookup_blocks + workload.event_blocks
    return {
        "name": name,
        "passes": passes,
        "elapsed_s_best": round(best, 6),
        "elapsed_s_median": round(median, 6),
        "ops_per_s": round(ops / best),
        "ops_per_s_median": round(ops / median),
        "block_ops_per_s": round(blocks / best),
        "lookups_per_s": round(workload.lookups / best),
        # The shape-independent figure: a request is one lookup plus its batch, whatever the event shape.
        "requests_per_s": round(workload.requests / best),
        "ns_per_block_op": round(best / blocks * 1e9, 1) if blocks else 0.0,
        "lookup_p50_us": round(_pct(lk, 50) / 1000, 2),
        "lookup_p99_us": round(_pct(lk, 99) / 1000, 2),
        "lookup_max_us": round(max(lk, default=0) / 1000, 2),
        "apply_p50_us": round(_pct(ap, 50) / 1000, 2),
        "apply_p99_us": round(_pct(ap, 99) / 1000, 2),
    }


def _one_shape(
    rows: list[Any],
    workers: int,
    capacity_blocks: int | None,
    block_size: int,
    passes: int,
    shape: str,
    chunk_tokens: int,
    baseline: bool,
    check: bool,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    wl = build_workload(
        rows,
        workers,
        capacity_blocks=capacity_blocks,
        block_size=block_size,
        event_shape=shape,
        chunk_tokens=chunk_tokens,
    )
    gen_s = time.perf_counter() - t0
    compared = verify(wl, PrefixIndex, NaiveIndex) if check else 0
    out: dict[str, Any] = {
        "event_shape": shape,
        "requests": wl.requests,
        "ops": wl.ops_count,
        "lookups": wl.lookups,
        "events": wl.events,
        "stored_events": wl.stored_events,
        "removed_events": wl.removed_events,
        "batches": wl.batches,
        "lookup_blocks": wl.lookup_blocks,
        "event_blocks": wl.event_blocks,
        "hit_ratio": round(wl.hit_ratio, 4),
        "best_worker_hit_ratio": round(wl.best_hit_blocks / wl.lookup_blocks, 4) if wl.lookup_blocks else 0.0,
        "lookups_verified_against_baseline": compared,
        "workload_gen_s": round(gen_s, 3),
        "index": measure("PrefixIndex", PrefixIndex, wl, passes),
    }
    if baseline:
        out["baseline"] = measure("NaiveIndex (dict of sets)", NaiveIndex, wl, passes)
        out["speedup_ops"] = round(out["index"]["ops_per_s"] / out["baseline"]["ops_per_s"], 2)
    out["target_met"] = {
        "ops_per_s": out["index"]["ops_per_s"] >= TARGET_OPS_PER_S,
        "lookup_p99_us": out["index"]["lookup_p99_us"] < TARGET_LOOKUP_P99_US,
    }
    return out


def run(
    trace: str = str(DEFAULT_TRACE),
    workers: int = 16,
    capacity_blocks: int | None = 2048,
    block_size: int = 512,
    passes: int = 7,
    duplicate: int = 1,
    limit: int | None = None,
    baseline: bool = True,
    check: bool = True,
    shapes: Sequence[str] = EVENT_SHAPES,
    chunk_tokens: int = 8192,
) -> dict[str, Any]:
    """Replay the trace under each event shape; the first shape's figures are also the top-level ones."""
    rows = duplicate_rows(load_trace(trace, limit), duplicate)
    by_shape = {
        shape: _one_shape(
            rows, workers, capacity_blocks, block_size, passes, shape, chunk_tokens, baseline, check
        )
        for shape in shapes
    }
    first = by_shape[shapes[0]]
    return {
        "trace": os.path.basename(trace),
        "workers": workers,
        "capacity_blocks": capacity_blocks,
        "block_size_tokens": block_size,
        "chunk_tokens": chunk_tokens,
        "python": sys.version.split()[0],
        "target": {"ops_per_s": TARGET_OPS_PER_S, "lookup_p99_us": TARGET_LOOKUP_P99_US},
        "event_shape": shapes[0],
        "index": first["index"],
        **({"baseline": first["baseline"], "speedup_ops": first["speedup_ops"]} if baseline else {}),
        "by_shape": by_shape,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument(
        "--capacity-blocks", type=int, default=2048, help="per-worker LRU capacity; 0 = unbounded"
    )
    ap.add_argument(
        "--block-size",
        type=int,
        default=512,
        help="tokens per block (512 = one block per trace hash id; 16 expands each id to 32)",
    )
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument(
        "--shapes",
        default=",".join(EVENT_SHAPES),
        help="event shapes to replay, comma-separated: vllm (per chunk / per evicted block), coarse",
    )
    ap.add_argument("--chunk-tokens", type=int, default=8192, help="prefill chunk (one BlockStored each)")
    ap.add_argument("--duplicate", type=int, default=1, help="copies of the trace with disjoint hash spaces")
    ap.add_argument("--limit", type=int, default=None, help="only the first N trace rows")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--cpu", type=int, default=None, help="pin to this CPU core")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {a.cpu})
    res = run(
        a.trace,
        a.workers,
        a.capacity_blocks or None,
        a.block_size,
        a.passes,
        a.duplicate,
        a.limit,
        not a.no_baseline,
        not a.no_check,
        tuple(a.shapes.split(",")),
        a.chunk_tokens,
    )
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(
        f"{res['trace']}: {res['workers']} workers, capacity {res['capacity_blocks']} blocks of "
        f"{res['block_size_tokens']} tokens"
    )
    for shape, r in res["by_shape"].items():
        print(
            f"[{shape}] {r['requests']} requests; ops {r['ops']} = {r['lookups']} lookups "
            f"+ {r['events']} events "
            f"({r['stored_events']} stored, {r['removed_events']} removed); hit ratio {r['hit_ratio']}"
        )
        for x in [r["index"]] + ([r["baseline"]] if "baseline" in r else []):
            print(
                f"  {x['name']:26s} {x['ops_per_s']:>11,} ops/s {x['requests_per_s']:>9,} requests/s "
                f"{x['block_ops_per_s']:>12,} block ops/s  "
                f"lookup p50 {x['lookup_p50_us']:>7} us p99 {x['lookup_p99_us']:>7} us"
            )
        if "speedup_ops" in r:
            print(f"  speedup {r['speedup_ops']}x; target met: {r['target_met']}")


if __name__ == "__main__":
    main()
