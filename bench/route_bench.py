"""Routing decisions per second and decision latency, per strategy, with a realistically filled index.

    python -m bench.route_bench --workers 64 --json

The KV index is pre-filled by replaying the Mooncake trace's events over the decode pool (``bench.workload``,
so it holds what those workers would cache: tens of thousands of blocks); then every trace request is routed
at its trace timestamp with ``Router.decide`` against that index and heartbeat-like worker views from a
small load model (``LoadModel``) that reacts to the decisions. ``prefixaware`` gets one untimed warm-up pass
over the trace so its own tree is as full as the shared index. Only ``decide`` is timed, one call at a time.

Tenants: the live router keys every request's blocks by its tenant's cache salt, so tenants never share cached
prefixes. ``--tenants N`` (default 1) spreads the trace's sessions over N tenants and salts each row's hashes
(history and measured requests alike) with its tenant's salt; with 1 every request is one tenant's, which is
what the KV-aware figures within a tenant are measured on. ``--tenants 0`` replays the unsalted trace.
"""

from __future__ import annotations

import argparse
import copy
import gc
import heapq
import json
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any

from bench.workload import DEFAULT_TRACE, build_workload, load_trace, offset_rows, row_tenant, tenant_root
from splitserve.cache import PrefixIndex, mooncake_block_hashes
from splitserve.routing import Decision, Router, RoutingRequest, WorkerView, available


class LoadModel:
    """Worker loads that react to the routed traffic, refreshed into views like heartbeats would be.

    A routed request holds one sequence and its prompt's blocks on the decoder until it has prefilled
    (locally when direct) and decoded ``output_length`` tokens at ``itl_s``; when disaggregated, its
    uncached tokens queue on the prefiller for ``uncached / prefill_tps`` seconds. Crude on purpose: it only
    has to keep the views honest enough that a cost-based strategy cannot herd onto one worker.
    """

    def __init__(
        self,
        n_decode: int,
        n_prefill: int,
        capacity_blocks: int,
        block_size: int,
        prefill_tps: float = 10_000.0,
        itl_s: float = 0.03,
        heartbeat_s: float = 0.5,
    ) -> None:
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.prefill_tps, self.itl_s, self.heartbeat_s = prefill_tps, itl_s, heartbeat_s
        self.roles = {f"worker-{i:03d}": "decode" for i in range(n_decode)}
        self.roles.update({f"prefill-{i:03d}": "prefill" for i in range(n_prefill)})
        self.state = {w: [0, 0, 0] for w in self.roles}  # active seqs, queued prefill tokens, used blocks
        self.ends: list[tuple[float, int, str, int, int, int]] = []
        self.next_heartbeat = float("-inf")
        self.views: list[WorkerView] = []
        self._n = 0

    def at(self, now: float) -> list[WorkerView]:
        while self.ends and self.ends[0][0] <= now:
            _, _, w, a, q, u = heapq.heappop(self.ends)
            st = self.state[w]
            st[0] -= a
            st[1] -= q
            st[2] -= u
        if now >= self.next_heartbeat:
            self.views = [
                WorkerView(
                    w,
                    role,
                    active_seqs=st[0],
                    queued_prefill_tokens=st[1],
                    used_blocks=st[2],
                    free_blocks=max(0, self.capacity - st[2]),
                    total_blocks=self.capacity,
                )
                for (w, role), st in zip(self.roles.items(), self.state.values(), strict=True)
            ]
            self.next_heartbeat = now + self.heartbeat_s
        return self.views

    def _hold(self, w: str, now: float, until: float, a: int, q: int, u: int) -> None:
        st = self.state[w]
        st[0] += a
        st[1] += q
        st[2] += u
        self._n += 1
        heapq.heappush(self.ends, (until, self._n, w, a, q, u))

    def routed(self, d: Decision, output_length: int, now: float) -> None:
        blocks = -(-d.prompt_tokens // self.block_size)
        prefill_s = d.uncached_tokens / self.prefill_tps
        if d.prefiller is not None:
            self._hold(d.prefiller, now, now + prefill_s, 1, d.uncached_tokens, 0)
            self._hold(d.decoder, now, now + prefill_s + output_length * self.itl_s, 1, 0, blocks)
        else:
            self._hold(
                d.decoder, now, now + prefill_s + output_length * self.itl_s, 1, d.uncached_tokens, blocks
            )


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p / 100))] if s else 0.0


def run(
    trace: str = str(DEFAULT_TRACE),
    workers: int = 64,
    prefillers: int = 16,
    capacity_blocks: int = 2048,
    block_size: int = 512,
    disagg_threshold: int = 2048,
    strategies: list[str] | None = None,
    sessions: int = 400,
    limit: int | None = None,
    tenants: int = 1,
) -> dict[str, Any]:
    rows = [r for r in load_trace(trace, limit) if r.hash_ids]
    t0 = time.perf_counter()
    # What these workers served before: the same trace in a disjoint hash space, replayed into the index and
    # the workers' caches. The measured requests then find a full index but only their own reuse.
    history = build_workload(
        offset_rows(rows), workers, capacity_blocks=capacity_blocks, block_size=block_size, tenants=tenants,
        sessions=sessions,
    )
    base_index = PrefixIndex()
    for batch in history.batches_iter():
        base_index.apply(batch)
    snapshot = base_index.snapshot()
    assert history.caches is not None
    requests = [
        (
            mooncake_block_hashes(row.hash_ids, block_size, parent=tenant_root(row_tenant(i, tenants, sessions))),
            row.input_length,
            row.output_length,
            row.timestamp_ms / 1000.0,
            f"session-{i % sessions}",
        )
        for i, row in enumerate(rows)
    ]
    warmup = [
        (
            mooncake_block_hashes(row.hash_ids, block_size, parent=tenant_root(row_tenant(i, tenants, sessions))),
            row.input_length,
            row.output_length,
            row.timestamp_ms / 1000.0 - 2000.0,
        )
        for i, row in enumerate(offset_rows(rows))
    ]
    prep_s = time.perf_counter() - t0
    stats = base_index.stats()
    out: dict[str, Any] = {
        "trace": os.path.basename(trace),
        "decode_workers": workers,
        "prefill_workers": prefillers,
        "block_size_tokens": block_size,
        "capacity_blocks": capacity_blocks,
        "disagg_threshold": disagg_threshold,
        "tenants": tenants,
        "requests": len(requests),
        "index_blocks_at_start": stats.blocks,
        "index_worker_blocks_at_start": sum(sum(m.values()) for m in stats.worker_blocks.values()),
        "prep_s": round(prep_s, 3),
        "python": sys.version.split()[0],
        "strategies": {},
    }
    for name in strategies or available():
        index = PrefixIndex()
        index.restore(snapshot)
        caches = copy.deepcopy(history.caches)
        router = Router(name, index=index, block_size=block_size, disagg_threshold=disagg_threshold)
        if name == "prefixaware":  # its own tree learns from the same history (untimed)
            warm = LoadModel(workers, prefillers, capacity_blocks, block_size)
            for i, (hashes, n_tok, n_out, ts) in enumerate(warmup):
                d = router.decide(
                    RoutingRequest(f"w{i}", block_hashes=hashes, prompt_tokens=n_tok), warm.at(ts), ts
                )
                warm.routed(d, n_out, ts)
        model = LoadModel(workers, prefillers, capacity_blocks, block_size)
        lat: list[float] = []
        routes: Counter[str] = Counter()
        decoders: Counter[str] = Counter()
        cached = 0
        clock = time.perf_counter_ns
        gc.disable()
        try:
            for i, (hashes, n_tok, n_out, ts, skey) in enumerate(requests):
                views = model.at(ts)
                req = RoutingRequest(f"r{i}", block_hashes=hashes, prompt_tokens=n_tok, session_key=skey)
                t = clock()
                d = router.decide(req, views, ts)
                lat.append(clock() - t)
                # What the workers then publish (untimed): both ends hold the prompt's KV afterwards.
                for w in (d.decoder, d.prefiller):
                    if w is not None:
                        published = caches.touch(w, hashes, ts)
                        if published is not None:
                            index.apply(published)
                model.routed(d, n_out, ts)
                routes[d.route] += 1
                decoders[d.decoder] += 1
                cached += d.cached_tokens
        finally:
            gc.enable()
        total_s = sum(lat) / 1e9
        out["strategies"][name] = {
            "decisions_per_s": round(len(lat) / total_s),
            "decision_p50_us": round(_pct(lat, 50) / 1000, 1),
            "decision_p99_us": round(_pct(lat, 99) / 1000, 1),
            "decision_mean_us": round(statistics.fmean(lat) / 1000, 1),
            "disaggregated_share": round(routes["disaggregated"] / len(lat), 3),
            "cached_token_share": round(cached / max(1, sum(r[1] for r in requests)), 3),
            "busiest_decoder_share": round(max(decoders.values()) / len(lat), 3),
            "decoders_used": len(decoders),
            "index_blocks_at_end": len(index),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--workers", type=int, default=64, help="decode workers")
    ap.add_argument("--prefillers", type=int, default=16)
    ap.add_argument("--capacity-blocks", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--disagg-threshold", type=int, default=2048)
    ap.add_argument("--strategies", default=",".join(available()))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--tenants", type=int, default=1,
                    help="spread the sessions over N tenants, each with its own cache salt (0: unsalted)")
    ap.add_argument("--cpu", type=int, default=None, help="pin to this CPU core")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {a.cpu})
    res = run(
        a.trace,
        a.workers,
        a.prefillers,
        a.capacity_blocks,
        a.block_size,
        a.disagg_threshold,
        a.strategies.split(","),
        limit=a.limit,
        tenants=a.tenants,
    )
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(
        f"{res['trace']}: {res['requests']} requests; {res['decode_workers']} decoders + "
        f"{res['prefill_workers']} prefillers; index at start {res['index_blocks_at_start']} blocks "
        f"({res['index_worker_blocks_at_start']} worker-block pairs)"
    )
    for name, r in res["strategies"].items():
        print(
            f"  {name:12s} {r['decisions_per_s']:>8,} decisions/s  p50 {r['decision_p50_us']:>7} us  "
            f"p99 {r['decision_p99_us']:>7} us  disagg {r['disaggregated_share']:.2f}  "
            f"cached {r['cached_token_share']:.2f}  busiest {r['busiest_decoder_share']:.3f}"
        )


if __name__ == "__main__":
    main()
