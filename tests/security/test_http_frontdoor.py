"""The HTTP front door attacked from outside, one test per finding of "Tenants cannot touch each other".

Every test runs the real front door (``FrontendService``: uvicorn with the httptools parser on a free loopback
port, a real nats-server) and talks to it over real sockets; where a request must go through, a scripted
router and decoder answer on NATS (``tests.frontend.test_service.FakeCluster``). Found on main:

- ``/metrics`` (it names every tenant), ``/docs`` and ``/openapi.json`` were served to anyone, on the API port;
- a front door bound beyond loopback with no API keys said nothing;
- a socket sending its headers slowly was held for ever (slowloris);
- a key with a trailing newline (or other whitespace) was accepted; keys of any length were loaded;
- failed keys were never throttled;
- a deeply nested JSON body was a 500;
- an X-Session-Id of any length was taken (and its validation error echoed it).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from splitserve.natsserver import NatsServer
from splitserve.services.frontend.app import MAX_SESSION_ID_CHARS, AuthThrottle
from tests.frontend.test_service import MODEL, FakeCluster, cluster, frontend, until

__all__ = ["cluster"]  # the fixture, re-used from the front door's own service tests

KEY_A = "sk-acme-0123456789abcdef"
KEY_B = "sk-globex-0123456789abcdef"
KEYS = {KEY_A: "acme", KEY_B: "globex"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def raw_request(port: int, head: bytes, timeout: float = 5.0) -> bytes:
    """Send ``head`` (request line and headers, as given) on a fresh socket; what the server answers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), timeout)
    finally:
        writer.close()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


# --- /metrics, /docs, probes ----------------------------------------------------------------------------


async def test_metrics_and_docs_are_not_served_on_the_api_port(cluster: FakeCluster, nats_server: NatsServer) -> None:
    async with frontend(nats_server.url, api_keys=KEYS) as svc, httpx2.AsyncClient(base_url=svc.url) as http:
        await until(lambda: svc.readiness()[0])
        assert (await http.post("/v1/chat/completions", json=CHAT, headers=auth(KEY_A))).status_code == 200
        # Nothing a caller without a key (or with a tenant's key) can reach names a tenant.
        for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            for headers in ({}, auth(KEY_B)):
                r = await http.get(path, headers=headers)
                assert r.status_code == 404, (path, r.status_code)
                assert "acme" not in r.text
        for path in ("/healthz", "/readyz"):
            r = await http.get(path)
            assert r.status_code == 200 and "acme" not in r.text and "globex" not in r.text, r.text
        # The series are on their own port, on loopback.
        assert svc.metrics_url.startswith("http://127.0.0.1:") and str(svc.port) not in svc.metrics_url
        r = await http.get(svc.metrics_url)
        assert r.status_code == 200 and "splitserve_requests_total" in r.text
        assert (await http.get(svc.metrics_url.replace("/metrics", "/v1/models"), headers=auth(KEY_A))).status_code \
            == 404  # the metrics port serves nothing else
    async with frontend(nats_server.url, api_keys=KEYS, docs=True) as svc, \
            httpx2.AsyncClient(base_url=svc.url) as http:  # an operator can turn the docs on
        assert (await http.get("/docs")).status_code == 200
        assert "/v1/chat/completions" in (await http.get("/openapi.json")).json()["paths"]


async def test_open_front_door_beyond_loopback_warns_loudly(nats_server: NatsServer,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    async with frontend(nats_server.url, host="0.0.0.0"):
        pass
    err = capfd.readouterr().err
    assert "WARNING" in err and "0.0.0.0" in err and "NO API KEYS" in err
    for kw in ({"host": "0.0.0.0", "api_keys": KEYS}, {"host": "127.0.0.1"}):
        async with frontend(nats_server.url, **kw):
            pass
        assert "NO API KEYS" not in capfd.readouterr().err, kw


# --- keys ---------------------------------------------------------------------------------------------


async def test_a_key_is_compared_exactly(nats_server: NatsServer) -> None:
    async with frontend(nats_server.url, api_keys=KEYS) as svc:
        ok = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {KEY_A}\r\n\r\n"
        assert status_of(await raw_request(svc.port, ok.encode())) == 200
        # A trailing newline (bare LF inside the header), other whitespace the old .strip() removed, a
        # second space, a prefix of the key, two Authorization headers: all refused.
        bad = [f"Bearer {KEY_A}\n", f"Bearer {KEY_A}\x0b", f"Bearer {KEY_A}\x0c", f"Bearer \x0b{KEY_A}",
               f"Bearer  {KEY_A}", f"Bearer {KEY_A[:-1]}", f"Bearer {KEY_A}\x00"]
        for value in bad:
            head = (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: {value}\r\n\r\n")
            r = await raw_request(svc.port, head.encode("latin-1"))
            assert status_of(r) in (400, 401), (value, r[:200])
        twice = (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {KEY_A}\r\n"
                 f"Authorization: Bearer {KEY_B}\r\n\r\n")
        assert status_of(await raw_request(svc.port, twice.encode())) == 401


def test_a_keys_file_with_a_short_key_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"{KEY_A}: acme\nsk-short-1: globex\n")
    cp = subprocess.run([sys.executable, "-m", "splitserve.services.frontend", "--api-keys", str(keys), "--port", "0",
                         "--nats-url", "nats://127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2, cp.stderr  # a usage error, before anything starts
    out = " ".join((cp.stdout + cp.stderr).split())  # rich wraps the message in a box
    assert "globex" in out and "16" in out
    assert "sk-short-1" not in cp.stdout + cp.stderr  # the tenant is named, never the key


async def test_failed_keys_are_throttled_per_address(nats_server: NatsServer) -> None:
    async with frontend(nats_server.url, api_keys=KEYS) as svc, httpx2.AsyncClient(base_url=svc.url) as http:
        for i in range(10):
            r = await http.get("/v1/models", headers=auth(f"sk-guess-{i:016d}"))
            assert r.status_code == 401
        r = await http.get("/v1/models", headers=auth("sk-guess-another-one"))
        assert r.status_code == 429 and 50 <= int(r.headers["retry-after"]) <= 60
        assert r.json()["error"]["type"] == "rate_limit_error"
        # The right key from that address waits too (otherwise a guess would still tell right from wrong)...
        assert (await http.get("/v1/models", headers=auth(KEY_A))).status_code == 429
        # ...as do the console's key checks (another door to the same keys).
        assert (await http.get("/console/api/whoami", headers=auth(KEY_A))).status_code == 429
    # Bounded memory: the least recently failing addresses are forgotten first.
    t = [0.0]
    throttle = AuthThrottle(allowed=2, window_s=10, max_addresses=3, clock=lambda: t[0])
    for addr in ("a", "a", "b", "c", "d"):
        throttle.failed(addr)
    assert len(throttle._failures) == 3 and throttle.retry_after("a") is None  # "a" was evicted
    throttle.failed("d")
    assert throttle.retry_after("d") == 10
    t[0] = 10.0
    assert throttle.retry_after("d") is None  # the window ended


async def test_per_key_and_total_concurrency_limits(cluster: FakeCluster, nats_server: NatsServer) -> None:
    async with frontend(nats_server.url, api_keys=KEYS, per_key_concurrency=1) as svc, \
            httpx2.AsyncClient(base_url=svc.url) as http:
        await until(lambda: svc.readiness()[0])
        async with http.stream("POST", "/v1/completions", headers=auth(KEY_A),
                               json={"prompt": "hang on", "stream": True, "max_tokens": 9}) as held:
            assert held.status_code == 200
            r = await http.post("/v1/completions", headers=auth(KEY_A), json={"prompt": "x"})
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert (await http.post("/v1/completions", headers=auth(KEY_B), json={"prompt": "x"})).status_code == 200
        cluster.release.set()
        await until(lambda: not svc.active_requests())
        assert (await http.post("/v1/completions", headers=auth(KEY_A), json={"prompt": "x"})).status_code == 200
    async with frontend(nats_server.url, limit_concurrency=4) as svc:
        idle = [socket.create_connection(("127.0.0.1", svc.port)) for _ in range(4)]
        try:
            answer = await raw_request(svc.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert status_of(answer) == 503
        finally:
            for s in idle:
                s.close()


# --- bodies and headers -------------------------------------------------------------------------------


MALFORMED = {
    "deep array": b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "deep object": b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
    "huge integer": b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":' + b"9" * 5000 + b"}",
    "big integer": b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":' + b"9" * 300 + b"}",
    "huge float": b'{"messages":[{"role":"user","content":"hi"}],"temperature":1e999999}',
    "wrong types": b'{"messages":[{"role":5,"content":{"a":1}}]}',
    "messages a string": b'{"messages":"hi"}',
    "invalid utf-8": b'{"messages":[{"role":"user","content":"\xff\xfe"}]}',
    "lone surrogate": b'{"messages":[{"role":"user","content":"\\ud800"}]}',
    "not an object": b"[1, 2]",
    "empty": b"",
}


async def test_malformed_bodies_are_400_never_500(cluster: FakeCluster, nats_server: NatsServer) -> None:
    async with frontend(nats_server.url, api_keys=KEYS) as svc, httpx2.AsyncClient(base_url=svc.url) as http:
        await until(lambda: svc.readiness()[0])
        for name, body in MALFORMED.items():
            r = await http.post("/v1/chat/completions", content=body, headers={**auth(KEY_A),
                                                                                "content-type": "application/json"})
            assert r.status_code == 400, (name, r.status_code, r.text[:300])
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, name
        for ids in ("[" + "9" * 40 + "]", "[-1]"):  # token ids a 32-bit field cannot carry
            r = await http.post("/v1/completions", content=f'{{"prompt": {ids}}}', headers=auth(KEY_A))
            assert r.status_code == 400, (ids, r.text)
        # Oversize: refused from its declared length, before a byte of it is read.
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {64 * 1024 * 1024}\r\n\r\n")
        answer = await raw_request(svc.port, head.encode())
        assert status_of(answer) == 413 and b'"payload_too_large"' in answer
        # And a well-formed one still goes through.
        assert (await http.post("/v1/chat/completions", json=CHAT, headers=auth(KEY_A))).status_code == 200


async def test_caller_ids_are_bounded_and_never_echoed(cluster: FakeCluster, nats_server: NatsServer) -> None:
    async with frontend(nats_server.url, api_keys=KEYS) as svc, httpx2.AsyncClient(base_url=svc.url) as http:
        await until(lambda: svc.readiness()[0])
        long = "s" * 10_000
        for value in (long, "s" * (MAX_SESSION_ID_CHARS + 1), "tab\tinside"):
            r = await http.post("/v1/chat/completions", json=CHAT, headers={**auth(KEY_A), "X-Session-Id": value})
            assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-Id", r.text
            assert "sss" not in r.text and "sss" not in str(r.headers)
        ok = "s" * MAX_SESSION_ID_CHARS
        r = await http.post("/v1/chat/completions", json=CHAT, headers={**auth(KEY_A), "X-Session-Id": ok})
        assert r.status_code == 200 and cluster.requests[-1].session_id == ok
        assert ok not in r.text and ok not in str(r.headers)
        # An overlong request id is dropped for a fresh one, not echoed.
        r = await http.post("/v1/chat/completions", json=CHAT, headers={**auth(KEY_A), "X-Request-Id": "r" * 5000})
        assert r.status_code == 200 and len(r.headers["x-request-id"]) == 32 and "rrrr" not in r.text


async def test_slow_header_senders_are_cut_off(nats_server: NatsServer) -> None:
    timeout = 2.0
    async with frontend(nats_server.url, api_keys=KEYS, header_timeout_s=timeout) as svc:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        conns = [await asyncio.open_connection("127.0.0.1", svc.port) for _ in range(20)]
        silent = await asyncio.open_connection("127.0.0.1", svc.port)  # never sends a byte
        for i, (_, writer) in enumerate(conns):
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow-" + str(i).encode())

        async def trickle() -> None:  # one byte a second on every socket: each one "still sending"
            while True:
                await asyncio.sleep(1.0)
                for _, writer in conns:
                    if not writer.is_closing():
                        with contextlib.suppress(OSError):
                            writer.write(b"a")

        ticker = asyncio.create_task(trickle())
        try:
            async def closed_at(reader: asyncio.StreamReader) -> tuple[float, bytes]:
                data = await asyncio.wait_for(reader.read(), timeout + 5)  # EOF: the server closed it
                return loop.time() - t0, data

            results = await asyncio.gather(*(closed_at(r) for r, _ in [*conns, silent]))
        finally:
            ticker.cancel()
            for _, writer in [*conns, silent]:
                writer.close()
        for took, data in results:
            assert timeout - 0.5 <= took <= timeout + 3, took
            assert data == b"" or data.startswith(b"HTTP/1.1 408"), data[:100]
        # A normal request is unaffected (and a kept-alive connection gets a fresh deadline per request).
        async with httpx2.AsyncClient(base_url=svc.url) as http:
            assert (await http.get("/healthz")).status_code == 200
            await asyncio.sleep(timeout + 0.5)
            assert (await http.get("/healthz")).status_code == 200
        # Headers that never end are cut off by size as well as by time.
        r = await raw_request(svc.port, b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 200_000)
        assert r == b"" or status_of(r) == 431


def test_cli_documents_the_new_options() -> None:
    cp = subprocess.run([sys.executable, "-m", "splitserve.services.frontend", "--help"], capture_output=True,
                        text=True,
                        timeout=60, env={"COLUMNS": "200", "PATH": "", "TERM": "dumb"})
    text = cp.stdout
    for flag in ("--metrics-port", "--metrics-host", "--docs", "--limit-concurrency", "--per-key-concurrency",
                 "--header-timeout-s"):
        assert flag in text, flag
