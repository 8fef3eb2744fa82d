"""deploy/grafana's dashboard queries only series that splitserve/obs/metrics.py exports, with labels they have:
renaming a metric or a label without updating the dashboard fails here, not silently in Grafana."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from splitserve.obs.metrics import ClusterMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "splitserve-dashboard.json"
SERIES = re.compile(r"\b(splitserve_[a-z0-9_]+)\b(\{[^}]*\})?")
SELECTOR_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def exported() -> dict[str, set[str]]:
    """Every series name the registry can expose -> its label names (histograms' ``le`` included)."""
    out: dict[str, set[str]] = {}
    for value in vars(ClusterMetrics()).values():
        if not isinstance(value, (Counter, Gauge, Histogram)):
            continue
        name, labels = value._name, set(value._labelnames)
        if isinstance(value, Counter):
            out[f"{name}_total"] = labels
        elif isinstance(value, Histogram):
            for suffix in ("_bucket", "_sum", "_count"):
                out[f"{name}{suffix}"] = labels | ({"le"} if suffix == "_bucket" else set())
        else:
            out[name] = labels
    return out


def queries(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var.get("type") == "query":
            exprs.append(var["definition"])
    return exprs


def test_every_queried_series_exists_with_its_labels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    known = exported()
    assert len(known) > 15  # the registry was read at all
    used: set[str] = set()
    for expr in queries(dash):
        found = SERIES.findall(expr)
        assert found, f"no splitserve series in {expr!r}"
        labels_here: set[str] = set()
        for name, selector in found:
            assert name in known, f"dashboard queries {name}, which splitserve/obs/metrics.py does not export"
            used.add(name)
            labels_here |= known[name]
            for label in SELECTOR_LABEL.findall(selector or ""):
                assert label in known[name], f"{name} has no label {label!r} ({expr!r})"
        for group in BY.findall(expr):
            for label in (g.strip() for g in group.split(",") if g.strip()):
                assert label in labels_here, f"grouping by {label!r}, which none of {expr!r}'s series has"
        m = re.search(r"label_values\((\w+),\s*(\w+)\)", expr)
        if m:
            assert m.group(2) in known[m.group(1)]
    # and the dashboard covers the families the README promises
    for fam in ("splitserve_ttft_seconds_bucket", "splitserve_itl_seconds_bucket", "splitserve_e2e_seconds_bucket",
                "splitserve_queue_seconds_bucket", "splitserve_kv_transfer_bytes_total", "splitserve_tokens_total",
                "splitserve_prefix_cache_hit_ratio", "splitserve_requests_total", "splitserve_errors_total",
                "splitserve_worker_active_seqs", "splitserve_worker_free_kv_blocks", "splitserve_queue_depth"):
        assert fam in used, fam


def test_dashboard_is_importable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert all(p["gridPos"]["x"] >= 0 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dash["panels"])
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "tenant"} <= names
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"


def test_every_panel_gives_the_same_figure_from_one_front_door_or_several() -> None:
    # Every front door is scraped (the k8s base runs two). Counters and histograms are counted by one front door
    # per request (a queue group), so they must be summed over the front doors; gauges from heartbeats are the
    # same on each, so they must be de-duplicated (max/avg by the worker), never shown or summed per front door.
    # Before: workers up by role counted each worker once per front door, and the per-worker panels drew one
    # line per worker and front door.
    dash = json.loads(DASHBOARD.read_text())
    gauges = {v._name for v in vars(ClusterMetrics()).values() if isinstance(v, Gauge)}
    for p in dash["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"].strip()
            assert re.match(r"(sum|max|avg|count|min)\b|histogram_quantile\(\s*[\d.]+\s*,\s*sum\b", expr), \
                f"panel {p.get('title')!r}: {expr!r} is not aggregated over the front doors"
            for name, _ in SERIES.findall(expr):
                if name in gauges and name != "splitserve_prefix_cache_hit_ratio":
                    assert re.search(rf"max by \((worker, role|role)\) \({name}\b", expr), \
                        f"panel {p.get('title')!r}: gauge {name} is not de-duplicated over the front doors"
