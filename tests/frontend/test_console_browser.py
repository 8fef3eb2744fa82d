"""The web console in a real headless Chromium (Debian's, driven by Playwright) against a real stack
(``splitserve up --tenants``, the real model, real spans): the cluster page lists the live workers, a request's
waterfall shows its spans with the routing decision and the KV transfer, the routing explorer explains a prompt
with every strategy, the what-if page runs the simulator and shows its verdict, and a tenant's key sees only its
own tenant."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from splitserve.routing.registry import available
from splitserve.stackproc import StackProc, start_stack
from splitserve.tenancy.consolekey import key_path, read_console_key

pytestmark = pytest.mark.slow

try:
    import playwright  # noqa: F401

    from splitserve.console_shots import browser, chromium_path, sign_in

    MISSING = None if chromium_path() else "Debian package chromium (tools/apt-packages.txt)"
except ImportError:
    MISSING = "playwright (the dev extra)"
if MISSING and os.environ.get("CI") == "true":
    raise RuntimeError(f"the console browser tests need {MISSING}")  # CI runs every test
if MISSING:
    pytest.skip(f"needs {MISSING}", allow_module_level=True)

TENANTS = """\
defaults: {tokens_per_minute: 50000}
tenants:
  A: {api_keys: [sk-console-a], weight: 2}
  B: {api_keys: [sk-console-b]}
"""
LONG = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
        "Constantinople. ") * 3 + "Summarise this in one sentence:"


def complete(base: str, key: str, prompt: str, request_id: str) -> dict[str, Any]:
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}", "X-Request-Id": request_id})
    with urllib.request.urlopen(req, timeout=300) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def api_status(base: str, path: str, key: str) -> int:
    req = urllib.request.Request(f"{base}/console/api{path}", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StackProc, str, str]]:
    tmp = tmp_path_factory.mktemp("console")
    (tmp / "tenants.yaml").write_text(TENANTS)
    sp = start_stack(tmp / "state", "--prefill", "1", "--decode", "1", "--disagg-threshold", "32",
                     "--transport", "tcp", "--strategy", "kvaware", "--tenants", str(tmp / "tenants.yaml"),
                     timeout=900)
    try:
        assert sp.http_url
        rid_a, rid_b = f"console-a-{uuid.uuid4().hex[:12]}", f"console-b-{uuid.uuid4().hex[:12]}"
        assert complete(sp.http_url, "sk-console-a", LONG, rid_a)["choices"][0]["text"]
        assert complete(sp.http_url, "sk-console-b", "Hello there", rid_b)["choices"][0]["text"]
        yield sp, rid_a, rid_b
    finally:
        sp.stop()


def open_trace(page: Any, base: str, rid: str, timeout: float = 30.0) -> None:
    """Spans leave each process in ~0.5 s batches and the console caches the stream for 3 s: retry."""
    deadline = time.monotonic() + timeout
    while True:
        page.goto(f"{base}/console/#requests/{rid}")
        page.reload()
        page.wait_for_selector("#waterfall, #trace-error")
        names = {e.get_attribute("data-span") for e in page.query_selector_all("#waterfall .span-row")}
        if {"decode.stream", "kv.push"} <= names or time.monotonic() > deadline:
            return
        time.sleep(1.0)


def test_admin_sees_workers_waterfall_and_routing_explorer(stack: tuple[StackProc, str, str]) -> None:
    sp, rid_a, rid_b = stack
    base = sp.http_url
    assert base
    key = read_console_key(sp.state_dir)
    assert key and any(str(key_path(sp.state_dir)) in line for line in sp.output)  # `up` said where it is
    with browser() as b:
        page = b.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{base}/console/")
        page.wait_for_selector("#login:not([hidden])")  # --tenants: the console asks for a key
        page.fill("#key-input", "not-a-key")
        page.click("#key-submit")
        page.wait_for_selector("#login:not([hidden])")
        sign_in(page, base, key)
        assert page.text_content("#who") == "admin"

        # Cluster: every live worker, from their heartbeats
        page.goto(f"{base}/console/#cluster")
        page.wait_for_selector("#workers .worker-row[data-worker='decode-0']")
        page.wait_for_selector("#control .worker-row[data-worker='router-0']")
        workers = {r.get_attribute("data-worker"): r.inner_text() for r in page.query_selector_all(".worker-row")}
        assert {"decode-0", "prefill-0", "router-0", "cache-index-0", "frontend-0"} <= set(workers)
        assert "ready" in workers["decode-0"] and "hf" in workers["decode-0"]

        # Requests: the disaggregated request's waterfall, with every hop's spans, its decision and KV transfer
        open_trace(page, base, rid_a)
        spans = [e.get_attribute("data-span") for e in page.query_selector_all("#waterfall .span-row")]
        assert {"router.request", "router.dispatch", "prefill.job", "prefill.compute", "kv.push", "decode.admit",
                "decode.stream"} <= set(spans), spans
        decision = page.inner_text(".decision")
        assert "disaggregated" in decision and "kvaware" in decision and "decode-0" in decision
        kv = page.inner_text(".kv-transfer")
        assert "KiB" in kv or "MiB" in kv
        page.click("#waterfall .span-row[data-span='kv.push']")  # a span opens its attributes
        assert '"kv.bytes"' in page.inner_text(".wf-attrs")

        # Tenants: both, with their quota
        page.goto(f"{base}/console/#tenants")
        page.wait_for_selector(".tenant-row[data-tenant='B']")
        assert {r.get_attribute("data-tenant") for r in page.query_selector_all(".tenant-row")} == {"A", "B"}
        page.wait_for_selector(".usage-row[data-tenant='A']")
        assert "50,000" in page.inner_text(".tenant-row[data-tenant='A']")

        # Routing explorer: every strategy's answer for a prompt, nothing dispatched
        page.goto(f"{base}/console/#explorer")
        page.fill("#explain-prompt", LONG)
        page.click("#explain-submit")
        page.wait_for_selector("#explain .strategy")
        cards = {c.get_attribute("data-strategy"): c.inner_text()
                 for c in page.query_selector_all("#explain .strategy")}
        assert set(cards) == set(available())  # every registered strategy
        assert "live" in cards["kvaware"] and "decode-0" in cards["kvaware"]
        # the long prompt's prefix is on the workers now: the router's index replica says so
        assert "holds of this prompt" in page.inner_text("#explain-workers")


def test_a_tenant_key_sees_only_its_own_tenant(stack: tuple[StackProc, str, str]) -> None:
    sp, rid_a, rid_b = stack
    base = sp.http_url
    assert base
    assert api_status(base, "/cluster", "sk-console-a") == 403
    assert api_status(base, f"/trace/{rid_b}", "sk-console-a") == 404
    with browser() as b:
        page = b.new_page(viewport={"width": 1400, "height": 900})
        sign_in(page, base, "sk-console-a")
        assert page.text_content("#who") == "tenant A"
        assert page.is_hidden("nav a[data-page='cluster']") and page.is_hidden("nav a[data-page='explorer']")
        assert page.is_hidden("nav a[data-page='whatif']")
        assert api_status(base, "/whatif/traces", "sk-console-a") == 403
        page.goto(f"{base}/console/#cluster")  # not for tenants: it lands on the tenant's own page
        page.wait_for_selector(".tenant-row")
        assert [r.get_attribute("data-tenant") for r in page.query_selector_all(".tenant-row")] == ["A"]
        page.wait_for_selector(".usage-row")
        assert [r.get_attribute("data-tenant") for r in page.query_selector_all(".usage-row")] == ["A"]

        open_trace(page, base, rid_a)
        assert page.query_selector_all("#waterfall .span-row")
        page.goto(f"{base}/console/#requests")
        page.click("#requests-refresh")
        page.wait_for_selector(f"#slowest .request-row[data-request='{rid_a}']")
        seen = {r.get_attribute("data-request") for r in page.query_selector_all(".request-row")}
        assert rid_a in seen and rid_b not in seen
        page.goto(f"{base}/console/#requests/{rid_b}")
        page.reload()
        page.wait_for_selector("#trace-error")
        assert "no trace" in page.inner_text("#trace-error")


def test_the_what_if_page_runs_the_simulator_and_shows_its_verdict(stack: tuple[StackProc, str, str]) -> None:
    from splitserve.sim.workload import TRACE_FILES, TRACES_DIR

    trace = TRACE_FILES["mooncake-arxiv20"]  # 20 rows: a second or two of simulation
    if not (TRACES_DIR / trace).is_file():
        pytest.skip(f"{TRACES_DIR / trace} is not present")
    sp, _, _ = stack
    base = sp.http_url
    assert base
    with browser() as b:
        page = b.new_page(viewport={"width": 1400, "height": 900})
        sign_in(page, base, read_console_key(sp.state_dir))
        page.goto(f"{base}/console/#whatif")
        page.wait_for_selector(f"#whatif-trace option[value='{trace}']", state="attached")
        assert "add_tenant" in page.input_value("#whatif-change")  # prefilled with a deploy/whatif example
        page.select_option("#whatif-trace", trace)
        page.fill("#whatif-prefill", "1")
        page.fill("#whatif-decode", "1")
        page.fill("#whatif-change", "add_tenant:\n  name: C\n  spec: {slo: {ttft_p99_ms: 600000}}\n  rate_rps: 1.0\n")
        page.click("#whatif-run")
        page.wait_for_selector("#whatif-verdict, #whatif-error", timeout=120_000)
        assert page.get_attribute("#whatif-verdict", "data-verdict") == "accepted", page.inner_text("#whatif-result")
        assert "ACCEPTED" in page.inner_text("#whatif-verdict")
        rows = {(r.get_attribute("data-tenant"), r.get_attribute("data-run"))
                for r in page.query_selector_all("#whatif-tenants .whatif-row")}
        assert rows == {("A", "before"), ("A", "after"), ("B", "before"), ("B", "after"), ("C", "after")}
        assert page.is_enabled("#whatif-run")


async def test_route_explain_over_nats_is_a_dry_run_with_clear_errors(stack: tuple[StackProc, str, str]) -> None:
    """The router's ss.admin.route.explain itself: the same answer twice (nothing moved), the cache the served
    prompt left behind, and unknown strategies and malformed requests answered precisely."""
    import nats

    from splitserve import ops, proto
    from splitserve.proto import RouteExplainRequest, Subjects
    from splitserve.tenancy.natsauth import read_admin_credentials

    sp, _, _ = stack
    creds = read_admin_credentials(sp.state_dir)
    assert creds is not None
    nc = await nats.connect(sp.nats_url, user=creds[0], password=creds[1])
    try:
        req = RouteExplainRequest(tenant="A", prompt=LONG, strategies=["kvaware", "roundrobin", "nope"])
        first = await ops.route_explain(nc, req)
        again = await ops.route_explain(nc, req)
        by = {r.strategy: r for r in first.results}
        assert list(by) == ["kvaware", "roundrobin", "nope"] and by["kvaware"].live
        assert by["nope"].error and "unknown routing strategy" in by["nope"].error
        assert first.live_strategy == "kvaware" and first.prompt_tokens > 32
        def picks(rep: proto.RouteExplainReply) -> list[Any]:
            return [(r.decision or {}).get("decoder") for r in rep.results] + [
                (r.decision or {}).get("route") for r in rep.results]

        assert picks(again) == picks(first)
        # the prompt was served before: the router's replica of the index knows a worker holds its prefix
        assert max(w.cached_blocks for w in first.workers) > 0
        msg = await nc.request(Subjects.ADMIN_ROUTE_EXPLAIN, b'{"v": 1, "tenant": "A"}', timeout=10)
        err = proto.decode(msg.data, proto.StreamError)
        assert err.code == proto.ErrorCode.BAD_REQUEST and "exactly one of prompt" in err.message
    finally:
        await nc.close()
