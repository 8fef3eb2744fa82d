"""Terminal rendering of traces read back from SS_TRACES (``splitserve trace``).

A waterfall is one row per span, ordered by start: service, span name (indented by depth), start offset
from the trace's first span, a duration bar on a shared time axis, and the attributes a debugger needs
(routing decision, KV transfer, token counts). Error spans are red and carry their status message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

# Attributes worth a column, per span name (everything else is in --json).
_DECISION = ("prompt_tokens", "decision.strategy", "decision.route", "decision.decoder", "decision.prefiller",
             "decision.reason", "decision.cached_tokens", "decision.uncached_tokens", "decision.thresholds",
             "decision.candidates", "error.code")
_KEY_ATTRS: dict[str, tuple[str, ...]] = {
    "client.generate": ("ttft_ms", "route", "finish_reason", "completion_tokens", "error.code"),
    # intake (and, with --no-queue, the routing decision), then the durable queue's dispatch with the decision
    "router.request": ("queued_ahead", "quota.limit", *_DECISION),
    "router.dispatch": ("queue_wait_ms", "deliveries", "adopted_from", *_DECISION),
    "router.fail": ("error_code", "failed_worker"),
    "prefill.job": ("prompt_tokens", "decoder", "queue_wait_ms"),
    "kv.reserve": ("decoder", "kv.reserve_ms"),
    "prefill.compute": ("prefill.tokens", "prefill.cached_tokens", "prefill.ms"),
    "kv.push": ("kv.bytes", "kv.transport", "kv.layerwise", "kv.exposed_ms", "kv.bandwidth_mbps"),
    "decode.admit": ("route", "prompt_tokens", "cached_tokens", "first_token_ms", "prefill_ms", "transfer_ms"),
    "decode.stream": ("completion_tokens", "finish_reason", "itl_p50_ms", "itl_max_ms", "error.code"),
}
_BAR = 32


def _depths(spans: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    parent = {s["span_id"]: s.get("parent_id") for s in spans}
    out: dict[str, int] = {}
    for sid in parent:
        d, p, seen = 0, parent[sid], {sid}
        while p in parent and p not in seen:
            seen.add(p)
            d += 1
            p = parent[p]
        out[sid] = d
    return out


def _fmt(v: Any, limit: int = 120) -> str:
    s = str(v)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def rows(spans: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The waterfall as data, one row per span ordered by start: what the terminal table and the web console
    draw. Offsets are from the trace's first span; ``key_attributes`` are the ones worth showing per span."""
    if not spans:
        return []
    t0 = min(s["start_ns"] for s in spans)
    depth = _depths(spans)
    out = []
    for s in sorted(spans, key=lambda s: (s["start_ns"], -s["end_ns"])):
        attrs = s.get("attributes") or {}
        out.append({
            "span_id": s["span_id"], "parent_id": s.get("parent_id"), "service": s["service"],
            "worker_id": s.get("worker_id", ""), "name": s["name"], "depth": depth.get(s["span_id"], 0),
            "start_ms": (s["start_ns"] - t0) / 1e6, "duration_ms": (s["end_ns"] - s["start_ns"]) / 1e6,
            "error": s.get("status") == "error", "status_message": s.get("status_message"),
            "key_attributes": {k: attrs[k] for k in _KEY_ATTRS.get(s["name"], ()) if k in attrs},
        })
    return out


def render_waterfall(spans: Sequence[Mapping[str, Any]], console: Console | None = None,
                     title: str | None = None) -> None:
    console = console or Console()
    if not spans:
        console.print("no spans")
        return
    t0 = min(s["start_ns"] for s in spans)
    t1 = max(s["end_ns"] for s in spans)
    total = max(1, t1 - t0)
    table = Table(title=title or f"trace {spans[0]['trace_id']}  ({total / 1e6:.1f} ms, {len(spans)} spans)",
                  show_lines=False, expand=False)
    for col in ("service", "span", "start ms", "dur ms", "timeline", "attributes"):
        table.add_column(col, overflow="fold", no_wrap=col in ("timeline", "start ms", "dur ms"))
    scale = _BAR / (total / 1e6)
    for r in rows(spans):
        err = r["error"]
        a = int(r["start_ms"] * scale)
        b = max(a + 1, int((r["start_ms"] + r["duration_ms"]) * scale))
        bar = Text(" " * a + "█" * (b - a) + " " * (_BAR - b), style="red" if err else "cyan")
        shown = [f"{k}={_fmt(v)}" for k, v in r["key_attributes"].items()]
        if err:
            shown.insert(0, f"ERROR: {r['status_message'] or ''}")
        style = "bold red" if err else ""
        table.add_row(
            Text(f"{r['service']}/{r['worker_id']}", style=style),
            Text("  " * r["depth"] + r["name"], style=style),
            f"{r['start_ms']:9.1f}",
            f"{r['duration_ms']:9.1f}",
            bar,
            Text("  ".join(shown), style="red" if err else ""),
        )
    console.print(table)


def render_slowest(rows: Sequence[Mapping[str, Any]], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"slowest {len(rows)} recent requests")
    for col in ("request_id", "trace_id", "root", "duration ms", "spans", "error"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["request_id"]), r["trace_id"], r["root"], f"{r['duration_ms']:.1f}", str(r["spans"]),
                      Text("error", style="bold red") if r["error"] else "")
    console.print(table)
