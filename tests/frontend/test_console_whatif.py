"""The console's what-if panel API (``/console/api/whatif``): the real front door app running the real
``splitserve sim what-if`` in a child process on a tiny trace in an allow-listed folder (accepted, refused, a bad
change file), and its refusals (admin only, oversize, unknown or path-like traces, no tenants file, one run at a
time, timeout, a crash), with no credential of the tenants file in any answer.

No NATS: the what-if reads nothing from the cluster. Each real run is a Python start plus a simulation of 24
requests (a few seconds on a busy 2-core machine); the failure answers use a stand-in command (``python -c``)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from splitserve.obs.metrics import ClusterMetrics
from splitserve.services.frontend import console
from splitserve.services.frontend.app import AuthThrottle, create_app
from splitserve.services.frontend.console_data import ConsoleData
from splitserve.services.frontend.whatif import MAX_CHANGE_BYTES, WhatIfRunner, default_traces_dir, sanitized_tenants
from splitserve.tenancy.config import TenantsConfig, load_tenants
from tests.frontend.fakes import FakeBackend

ADMIN = "admin-key-whatif-0123456789"
KEY_A, KEY_B = "sk-whatif-tenant-a-0123456789", "sk-whatif-tenant-b-0123456789"
PW_A, PW_B = "pw-whatif-secret-A-42", "pw-whatif-secret-B-42"
SECRETS = (ADMIN, KEY_A, KEY_B, PW_A, PW_B)
TENANTS = TenantsConfig.model_validate({
    "defaults": {"max_queued": 500},
    "tenants": {
        "A": {"api_keys": [KEY_A], "password": PW_A, "weight": 2,
              "slo": {"ttft_p99_ms": 120000, "itl_p99_ms": 5000},
              "contract": {"decode_slots": {"guaranteed": 4, "burst": 64}}},
        "B": {"api_keys": [KEY_B], "password": PW_B},
    }})
KEYS = {KEY_A: "A", KEY_B: "B"}
TRACE = "tiny.jsonl"
HAS_EXAMPLES = (Path(__file__).resolve().parents[2] / "deploy" / "whatif").is_dir()  # the checkout's examples
# A newcomer at half the trace's rate, with a target no simulated request misses: accepted.
ACCEPT = """\
add_tenant:
  name: C
  spec: {weight: 1, slo: {ttft_p99_ms: 600000}}
  rate_rps: 0.5
"""
# A's p99 TTFT promised at 1 ms: no 70B prefill of a 1,024-token prompt meets it, so A breaks: refused.
REFUSE = """\
set_tenant:
  name: A
  slo: {ttft_p99_ms: 1}
"""


def write_trace(folder: Path, n: int = 24) -> None:
    """A Mooncake-format trace: one 1,024-token prompt a second, 16 tokens out, two shared-prefix groups."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"timestamp": 1000 * i, "input_length": 1024, "output_length": 16,
             "hash_ids": [i % 2, 100 + i]} for i in range(n)]
    (folder / TRACE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "notes.txt").write_text("not a trace\n")


def clean(r: httpx2.Response) -> httpx2.Response:
    """Every answer: no tenants-file credential, no admin key, no traceback, no temporary path."""
    for s in SECRETS:
        assert s not in r.text, (s, r.status_code, r.text[:500])
    assert "Traceback" not in r.text and "splitserve-whatif-" not in r.text, r.text[:500]
    return r


def as_(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def make(runner: WhatIfRunner | None) -> Any:
    app = create_app(FakeBackend(), api_keys=KEYS, auth_throttle=AuthThrottle(allowed=10_000))
    data = ConsoleData(ClusterMetrics(), lambda: None, tenants=TENANTS if runner is not None else None)
    console.install(app, data, console.ConsoleAuth(KEYS, [ADMIN]), runner)
    return app


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    write_trace(tmp_path / "traces")
    return tmp_path / "traces"


@pytest.fixture
def runner(traces: Path) -> WhatIfRunner:
    return WhatIfRunner(tenants=TENANTS, traces_dir=traces, timeout_s=60.0)


@pytest.fixture
async def http(runner: WhatIfRunner) -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=make(runner)), base_url="http://t",
                                  timeout=120) as c:
        yield c


async def post(http: httpx2.AsyncClient, body: dict[str, Any], key: str | None = ADMIN) -> httpx2.Response:
    return clean(await http.post("/console/api/whatif", json=body, headers=as_(key) if key else {}))


# --- the real CLI -------------------------------------------------------------------------------------------------
async def test_an_accepted_change_and_a_second_run_at_once_gets_429(http: httpx2.AsyncClient) -> None:
    body = {"change": ACCEPT, "trace": TRACE, "prefill": 1, "decode": 1}
    first, second = await asyncio.gather(post(http, body), post(http, body))
    busy, done = sorted((first, second), key=lambda r: r.status_code == 200)
    assert busy.status_code == 429, busy.text
    assert "already running" in busy.json()["error"]["message"] and int(busy.headers["Retry-After"]) >= 1
    assert done.status_code == 200, done.text
    w = done.json()
    assert w["accepted"] is True and w["verdict"] == "accepted" and w["exit_code"] == 0 and w["breaks"] == []
    assert w["trace"] == TRACE and w["wall_s"] > 0
    rows = {t["tenant"]: t for t in w["tenants"]}
    assert set(rows) == {"A", "B", "C"} and rows["C"]["status"] == "added" and rows["C"]["before"] is None
    assert rows["A"]["before"]["requests"] + rows["B"]["before"]["requests"] == 24  # the trace, split
    assert rows["A"]["after"]["holds"] and rows["A"]["slo_after"] == {"ttft_p99_ms": 120000, "itl_p99_ms": 5000}
    assert rows["A"]["after"]["ttft_p99_ms"] > 0 and rows["C"]["after"]["requests"] >= 1
    assert w["runs"]["before"]["prefill"] == 1 and w["runs"]["after"]["decode"] == 1
    # the tenants' contracts reached the child (the front door's tenants, less their credentials)
    assert w["runs"]["before"]["contract_problems"] == []
    # free again: the next run is served
    again = await post(http, {"change": REFUSE, "trace": TRACE, "prefill": 1, "decode": 1})
    assert again.status_code == 200 and again.json()["accepted"] is False


async def test_a_refused_change_names_who_breaks_and_by_how_much(http: httpx2.AsyncClient) -> None:
    r = await post(http, {"change": REFUSE, "trace": TRACE})
    assert r.status_code == 200, r.text
    w = r.json()
    assert w["accepted"] is False and w["verdict"] == "refused" and w["exit_code"] == 3
    assert [b["tenant"] for b in w["breaks"]] == ["A"]
    assert "TTFT p99" in w["breaks"][0]["summary"] and "> 1 ms" in w["breaks"][0]["summary"]
    a = next(t for t in w["tenants"] if t["tenant"] == "A")
    assert a["status"] == "set" and a["slo_after"]["ttft_p99_ms"] == 1 and not a["after"]["holds"]


@pytest.mark.parametrize("change, says", [
    ("add_tenant: [unclosed\n", "not valid YAML"),
    ("pools: {gpus: 3}\n", "Extra inputs"),
    ("set_tenant: {name: nobody, weight: 2}\n", "no tenant 'nobody'"),
])
async def test_a_bad_change_is_a_400_with_the_clis_message(http: httpx2.AsyncClient, change: str, says: str) -> None:
    r = await post(http, {"change": change, "trace": TRACE})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert says in msg, msg
    assert str(Path(os.sep, "tmp")) not in msg and "\x1b[" not in msg  # no temporary path, no terminal colours


# --- refusals before any run --------------------------------------------------------------------------------------
async def test_admin_only(http: httpx2.AsyncClient) -> None:
    body = {"change": ACCEPT, "trace": TRACE}
    for key in (KEY_A, KEY_B):
        r = await post(http, body, key)
        assert r.status_code == 403 and "admin key" in r.json()["error"]["message"]
        assert clean(await http.get("/console/api/whatif/traces", headers=as_(key))).status_code == 403
    assert (await post(http, body, None)).status_code == 401
    assert (await post(http, body, "not-a-key")).status_code == 401
    assert clean(await http.get("/console/api/whatif/traces")).status_code == 401


async def test_the_trace_list_and_the_examples(http: httpx2.AsyncClient, traces: Path) -> None:
    d = clean(await http.get("/console/api/whatif/traces", headers=as_(ADMIN))).json()
    assert [t["name"] for t in d["traces"]] == [TRACE]  # notes.txt is not a trace
    assert d["traces"][0]["bytes"] == (traces / TRACE).stat().st_size
    assert d["tenants_file"] is True and d["tenants"] == ["A", "B"] and d["timeout_s"] == 60.0
    assert d["max_change_bytes"] == MAX_CHANGE_BYTES and d["running"] is False
    names = [e["name"] for e in d["examples"]]
    if HAS_EXAMPLES:
        assert names[0] == "add-analytics.yaml" and "tenants.yaml" not in names
        assert "add_tenant:" in d["examples"][0]["text"]
    else:
        assert names == ["builtin"]


async def test_traces_are_names_from_the_list_never_paths(http: httpx2.AsyncClient, traces: Path) -> None:
    for name in ("../traces/tiny.jsonl", str(traces / TRACE), "/etc/passwd", "sub/tiny.jsonl", ".hidden.jsonl",
                 "..", "tiny.jsonl\n"):
        r = await post(http, {"change": ACCEPT, "trace": name})
        assert r.status_code == 400, (name, r.text)
    for name in ("nope.jsonl", "notes.txt", "mooncake"):
        r = await post(http, {"change": ACCEPT, "trace": name})
        assert r.status_code == 404 and "no trace named" in r.json()["error"]["message"], (name, r.text)
    r = await post(http, {"change": ACCEPT, "trace": TRACE, "tenants": "/etc/passwd"})  # no other keys
    assert r.status_code == 400
    for bad in ({"prefill": -1}, {"decode": 0}, {"decode": "8"}, {"prefill": 5000}):
        assert (await post(http, {"change": ACCEPT, "trace": TRACE, **bad})).status_code == 400, bad


async def test_an_oversize_change_is_a_413(http: httpx2.AsyncClient) -> None:
    big = "# " + "x" * MAX_CHANGE_BYTES + "\n" + ACCEPT
    r = await post(http, {"change": big, "trace": TRACE})
    assert r.status_code == 413 and "64 KiB" in r.json()["error"]["message"]
    ok = ("#" * (MAX_CHANGE_BYTES - len(ACCEPT) - 1)) + "\n" + ACCEPT  # exactly at the limit
    assert len(ok.encode()) == MAX_CHANGE_BYTES
    r = await post(http, {"change": ok, "trace": "nope.jsonl"})  # past the size check: the trace's 404
    assert r.status_code == 404


async def test_without_a_tenants_file_the_answer_is_409(traces: Path) -> None:
    app = make(None)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as c:
        r = clean(await c.post("/console/api/whatif", json={"change": ACCEPT, "trace": TRACE}, headers=as_(ADMIN)))
        assert r.status_code == 409 and "--tenants" in r.json()["error"]["message"]
        d = clean(await c.get("/console/api/whatif/traces", headers=as_(ADMIN))).json()
        assert d["tenants_file"] is False and d["tenants"] == []


# --- the child process, stood in for ------------------------------------------------------------------------------
def fake(runner: WhatIfRunner, script: str) -> None:
    """The runner's command replaced by ``python -c script`` (it gets the same arguments)."""
    runner.command = (sys.executable, "-c", textwrap.dedent(script))


async def test_the_child_gets_private_files_and_no_credentials(http: httpx2.AsyncClient, runner: WhatIfRunner,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = tmp_path / "seen.json"
    fake(runner, f"""
        import json, os, stat, sys
        a = sys.argv[1:]
        t, c = a[a.index("--tenants") + 1], a[a.index("--change") + 1]
        mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)
        json.dump({{"argv": a, "tenants": open(t).read(), "change": open(c).read(), "modes": [mode(t), mode(c),
                   mode(os.path.dirname(c))], "env": sorted(os.environ)}}, open({str(seen)!r}, "w"))
        print(json.dumps({{"verdict": "accepted", "echo": {KEY_A!r} + " " + {PW_B!r}, "tenants": []}}))
    """)
    monkeypatch.setenv("SPLITSERVE_CONSOLE_ADMIN_KEYS", ADMIN)  # the front door's own credentials: not passed on
    r = await post(http, {"change": ACCEPT, "trace": TRACE, "prefill": 2, "decode": 3})
    assert r.status_code == 200, r.text
    assert r.json()["echo"] == "[REDACTED] [REDACTED]"  # what a child printed is scrubbed all the same
    s = json.loads(seen.read_text())
    assert s["modes"] == [0o600, 0o600, 0o700] and s["change"] == ACCEPT
    assert s["argv"][:2] == ["sim", "what-if"] and "--json" in s["argv"]
    assert s["argv"][s["argv"].index("--trace") + 1] == str(runner.folder() / TRACE)
    assert s["argv"][-4:] == ["--prefill", "2", "--decode", "3"]
    for secret in SECRETS:
        assert secret not in s["tenants"]
    assert "SPLITSERVE_CONSOLE_ADMIN_KEYS" not in s["env"]
    assert load_tenants(_write(tmp_path / "t.json", s["tenants"])).weight("A") == 2  # the same tenants
    assert not Path(s["argv"][s["argv"].index("--change") + 1]).parent.exists()  # removed after the run


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


async def test_a_crash_is_a_short_500_and_a_timeout_a_504(http: httpx2.AsyncClient, runner: WhatIfRunner,
                                                           tmp_path: Path) -> None:
    fake(runner, f"raise RuntimeError('boom with ' + {KEY_A!r})")
    r = await post(http, {"change": ACCEPT, "trace": TRACE})
    assert r.status_code == 500 and "exit 1" in r.json()["error"]["message"]
    fake(runner, "print('not json'); raise SystemExit(3)")
    r = await post(http, {"change": ACCEPT, "trace": TRACE})
    assert r.status_code == 500 and "no verdict" in r.json()["error"]["message"]
    pid_file = tmp_path / "pid"
    fake(runner, f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)")
    runner.timeout_s = 3.0  # the stand-in starts well within it (it must write its pid first)
    r = await post(http, {"change": ACCEPT, "trace": TRACE})
    assert r.status_code == 504 and "within 3 s" in r.json()["error"]["message"]
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed, and reaped
        os.kill(pid, 0)
    assert runner.describe()["running"] is False  # and the next run may start


def test_the_child_s_tenants_file_is_the_front_door_s_less_credentials(tmp_path: Path) -> None:
    raw = sanitized_tenants(TENANTS)
    assert "api_keys" not in raw["tenants"]["A"] and "password" not in raw["tenants"]["B"]
    back = load_tenants(_write(tmp_path / "t.json", json.dumps(raw)))
    for t in ("A", "B"):
        assert back.limits(t) == TENANTS.limits(t) and back.slo(t) == TENANTS.slo(t)
    assert back.contracts() == TENANTS.contracts() and back.defaults == TENANTS.defaults


def test_the_default_traces_are_the_simulator_s() -> None:
    from splitserve.sim.workload import TRACES_DIR

    assert default_traces_dir() == TRACES_DIR


async def test_the_front_door_service_wires_its_tenants_and_options(traces: Path) -> None:
    from splitserve.services.frontend.service import FrontendService

    svc = FrontendService("frontend-w", "nats://127.0.0.1:1", api_keys=KEYS, admin_keys=[ADMIN], tenants=TENANTS,
                          whatif_traces=traces, whatif_timeout_s=42.0, metrics_port=None)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=svc.app), base_url="http://t") as c:
        d = clean(await c.get("/console/api/whatif/traces", headers=as_(ADMIN))).json()
    assert [t["name"] for t in d["traces"]] == [TRACE] and d["timeout_s"] == 42.0 and d["tenants"] == ["A", "B"]
