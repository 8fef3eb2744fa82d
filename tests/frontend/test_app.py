"""The HTTP surface in-process (ASGI, no sockets, no NATS) against a scripted backend: status codes, headers,
response and SSE shapes, auth, request ids, and what a client disconnect releases."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from splitserve import errors
from splitserve.client import Delta
from splitserve.proto import ErrorCode
from splitserve.services.frontend.app import create_app, load_api_keys
from tests.frontend.fakes import MODEL, FakeBackend, FakeStream, Script, make_result

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
async def http(backend: FakeBackend) -> AsyncIterator[httpx2.AsyncClient]:
    app = create_app(backend)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as c:
        yield c


def sse_events(body: str) -> list[Any]:
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    out: list[Any] = []
    for block in body.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# --- plain requests -------------------------------------------------------------------------------------


async def test_chat_non_streaming(http: httpx2.AsyncClient, backend: FakeBackend) -> None:
    r = await http.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "max_tokens": 4, "user": "x"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"][0]["message"]["content"] == "Hello, world"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    assert body["splitserve"]["decode_worker"] == "decode-0"
    args, tenant, rid = backend.calls[0]
    assert tenant == "default" and args.max_tokens == 4 and args.temperature == 0.0
    assert r.headers["x-request-id"] == rid and body["id"] == f"chatcmpl-{rid}"
    assert backend.streams[0].closed and backend.cancelled == []


async def test_completions_non_streaming(http: httpx2.AsyncClient) -> None:
    r = await http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion" and r.json()["choices"][0]["text"] == "Hello, world"


async def test_model_may_be_omitted_but_must_match(http: httpx2.AsyncClient) -> None:
    assert (await http.post("/v1/chat/completions", json={"messages": CHAT["messages"]})).status_code == 200
    r = await http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "The model 'gpt-4o' does not exist or you do not have access to it.",
                                 "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


async def test_n_2_is_a_clear_400(http: httpx2.AsyncClient, backend: FakeBackend) -> None:
    r = await http.post("/v1/chat/completions", json={**CHAT, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "only n=1 is supported" in r.json()["error"]["message"]
    assert backend.calls == []


async def test_bad_json_and_unknown_route(http: httpx2.AsyncClient) -> None:
    r = await http.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = await http.get("/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "x-request-id" in r.headers


@pytest.mark.parametrize(("code", "status"), [(ErrorCode.PROMPT_TOO_LONG, 413), (ErrorCode.PAYLOAD_TOO_LARGE, 413),
                                              (ErrorCode.QUOTA_EXCEEDED, 429), (ErrorCode.NO_WORKERS, 503),
                                              (ErrorCode.BUSY, 503), (ErrorCode.WORKER_DIED, 503),
                                              (ErrorCode.TIMEOUT, 503), (ErrorCode.EXPIRED, 503),
                                              (ErrorCode.BAD_REQUEST, 400), (ErrorCode.INTERNAL, 500)])
@pytest.mark.parametrize("stream", [False, True])
async def test_router_errors_get_their_status(http: httpx2.AsyncClient, backend: FakeBackend, code: ErrorCode,
                                              status: int, stream: bool) -> None:
    backend.script = Script(error=errors.SplitserveError("nope", code=code, retry_after_s=4), error_at=0)
    r = await http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"] == "nope"
    if status in (429, 503):
        assert r.headers["retry-after"] == "4"
    assert backend.streams[0].closed and r.headers["x-request-id"]


async def test_error_raised_when_sending_is_mapped(http: httpx2.AsyncClient, backend: FakeBackend) -> None:
    def refuse(_: object) -> None:
        raise errors.Unavailable("not connected to NATS")
    backend.on_generate = refuse
    r = await http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "NATS" in r.json()["error"]["message"]


# --- streaming ------------------------------------------------------------------------------------------


async def test_chat_streaming_shapes(http: httpx2.AsyncClient) -> None:
    r = await http.post("/v1/chat/completions", json={**CHAT, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = sse_events(r.text)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Hello, world"
    finish = chunks[-2]
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["usage"] is None
    assert finish["splitserve"]["route"] == "direct"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_completions_streaming_without_usage(http: httpx2.AsyncClient) -> None:
    r = await http.post("/v1/completions", json={"prompt": "x", "stream": True})
    chunks = sse_events(r.text)[:-1]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hello", ",", " world", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)


async def test_error_after_first_token_is_an_error_event(http: httpx2.AsyncClient, backend: FakeBackend) -> None:
    backend.script = Script(error=errors.WorkerDied("decode-0 died"), error_at=2)
    r = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    ev = sse_events(r.text)
    assert ev[-2] == {"error": {"message": "decode-0 died", "type": "server_error", "param": None,
                                "code": "worker_died"}}
    assert backend.cancelled == []  # the server ended it; nothing to cancel


# --- request ids, auth, readiness ---------------------------------------------------------------------


async def test_request_id_header_is_used_when_valid(http: httpx2.AsyncClient, backend: FakeBackend) -> None:
    r = await http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "my-req_1"})
    assert r.headers["x-request-id"] == "my-req_1" and backend.calls[-1][2] == "my-req_1"
    assert r.json()["id"] == "chatcmpl-my-req_1"
    r = await http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "bad id.with dots"})
    assert r.headers["x-request-id"] != "bad id.with dots" and backend.calls[-1][2] == r.headers["x-request-id"]
    assert (await http.get("/healthz", headers={"X-Request-Id": "h1"})).headers["x-request-id"] == "h1"


async def test_auth(tmp_path: Path, backend: FakeBackend) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("sk-alpha-0123456789: acme\nsk-beta-0123456789: globex\n")
    app = create_app(backend, api_keys=load_api_keys(keys))
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as c:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic sk-alpha-0123456789"},
                        {"Authorization": "Bearer  sk-alpha-0123456789"},
                        {"Authorization": "Bearersk-alpha-0123456789"}):
            r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # Auth is checked before the body: a bad key with a bad body is still 401.
        r = await c.post("/v1/chat/completions", json={"n": 2}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        assert (await c.get("/v1/models")).status_code == 401
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "bearer sk-beta-0123456789"})
        assert r.status_code == 200 and backend.calls[-1][1] == "globex"
        assert (await c.get("/healthz")).status_code == 200  # probes need no key


def test_api_key_files(tmp_path: Path) -> None:
    p = tmp_path / "keys.json"
    p.write_text(json.dumps({"k1-0123456789abcdef": "t1"}))
    assert load_api_keys(p) == {"k1-0123456789abcdef": "t1"}
    for bad in ("[1, 2]", "{}", '{"k-0123456789abcdef": "no.dots"}', '{"k-0123456789abcdef": 3}', '{"k1": "t1"}',
                '{"k-0123456789abcdef\\n": "t1"}', '{"k-0123 456789abcdef": "t1"}'):
        p.write_text(bad)
        with pytest.raises(ValueError):
            load_api_keys(p)


async def test_models_health_readiness(http: httpx2.AsyncClient, backend: FakeBackend) -> None:
    r = await http.get("/v1/models")
    assert r.json() == {"object": "list", "data": [{"id": MODEL, "object": "model", "created": r.json()["data"][0][
        "created"], "owned_by": "splitserve", "root": MODEL, "parent": None, "max_model_len": 8192}]}
    assert (await http.get(f"/v1/models/{MODEL}")).status_code == 200
    assert (await http.get("/v1/models/other")).status_code == 404
    assert (await http.get("/healthz")).json() == {"status": "ok"}
    assert (await http.get("/health")).json() == {"status": "ok"}
    assert (await http.get("/readyz")).status_code == 200
    backend.ready = False
    r = await http.get("/readyz")
    assert r.status_code == 503 and r.json()["missing"] == ["decode"]


# --- the official client ----------------------------------------------------------------------------


async def test_openai_client_parses_everything(backend: FakeBackend) -> None:
    app = create_app(backend)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t")
    client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http, max_retries=0)
    res = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert res.choices[0].message.content == "Hello, world"
    assert res.usage is not None and res.usage.prompt_tokens_details is not None
    assert res.usage.prompt_tokens_details.cached_tokens == 3
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == "Hello, world" and usage is not None and usage.total_tokens == 10
    backend.script = Script(error=errors.QuotaExceeded("over quota", retry_after_s=1), error_at=0)
    with pytest.raises(openai.RateLimitError):
        await client.completions.create(model=MODEL, prompt="x")
    backend.script = Script(error=errors.WorkerDied("died"), error_at=1)
    with pytest.raises(openai.APIError, match="died"):
        async for _ in await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                            stream=True):
            pass
    await http.aclose()


# --- disconnects -------------------------------------------------------------------------------------


class RawCall:
    """Drives the ASGI app directly, so the test decides when the client disconnects."""

    def __init__(self, path: str, body: dict[str, Any]) -> None:
        self.scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                      "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                      "query_string": b"", "root_path": "", "server": ("t", 80), "client": ("c", 1),
                      "headers": [(b"host", b"t"), (b"content-type", b"application/json"),
                                  (b"x-request-id", b"gone-1")]}
        self.body = json.dumps(body).encode()
        self.sent: list[MutableMapping[str, Any]] = []
        self.gone = asyncio.Event()
        self.got_body = asyncio.Event()
        self._body_sent = False

    async def receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, msg: MutableMapping[str, Any]) -> None:
        self.sent.append(msg)
        if msg["type"] == "http.response.body" and msg.get("body"):
            self.got_body.set()


@pytest.mark.parametrize("when", ["mid_stream", "before_first_token", "non_streaming"])
async def test_disconnect_closes_the_stream_and_calls_cancel(backend: FakeBackend, when: str) -> None:
    hang = 2 if when == "mid_stream" else 0
    backend.script = Script(deltas=["a", "b", "c"], hang_after=hang)
    app = create_app(backend)
    call = RawCall("/v1/chat/completions", {**CHAT, "stream": when != "non_streaming"})
    task = asyncio.create_task(app(call.scope, call.receive, call.send))
    if when == "mid_stream":
        await asyncio.wait_for(call.got_body.wait(), 5)
    else:
        for _ in range(100):
            if backend.streams and backend.streams[0].started:
                break
            await asyncio.sleep(0.01)
    call.gone.set()
    await asyncio.wait_for(task, 5)  # returns promptly instead of waiting for tokens that never come
    st = backend.streams[0]
    assert st.closed and st.yielded == hang
    assert backend.cancelled == ["gone-1"]
    assert app.state.inflight == {}


async def test_duplicate_request_id_in_flight_is_409(backend: FakeBackend) -> None:
    backend.script = Script(hang_after=0)
    app = create_app(backend)
    call = RawCall("/v1/chat/completions", {**CHAT, "stream": True})
    task = asyncio.create_task(app(call.scope, call.receive, call.send))
    for _ in range(100):
        if app.state.inflight:
            break
        await asyncio.sleep(0.01)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "gone-1"})
    assert r.status_code == 409
    call.gone.set()
    await asyncio.wait_for(task, 5)


async def test_bugs_are_openai_shaped_500s_with_the_request_id(backend: FakeBackend) -> None:
    def broken(_: object) -> None:
        raise RuntimeError("kaboom")

    backend.on_generate = broken
    backend.readiness = lambda: 1 / 0  # type: ignore[assignment,method-assign,return-value]
    app = create_app(backend)
    transport = httpx2.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx2.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "b1"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert r.headers["x-request-id"] == "b1" and "request b1" in r.json()["error"]["message"]
        assert "kaboom" not in r.text  # internals stay in the log
        r = await c.get("/readyz", headers={"X-Request-Id": "b2"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal" and r.headers["x-request-id"] == "b2"
    assert app.state.inflight == {}


async def test_oversized_and_non_object_bodies(http: httpx2.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    r = await http.post("/v1/completions", content=b"[1, 2]")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    # curl -d sends application/x-www-form-urlencoded: still read as JSON
    r = await http.post("/v1/completions", content=b'{"prompt": "x"}',
                        headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200
    monkeypatch.setattr("splitserve.services.frontend.app.MAX_BODY_BYTES", 100)
    r = await http.post("/v1/completions", json={"prompt": "x" * 200})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


class SlowClient(RawCall):
    """A caller whose first body write blocks until ``release`` (its socket buffer is full, say)."""

    def __init__(self, path: str, body: dict[str, Any]) -> None:
        super().__init__(path, body)
        self.release = asyncio.Event()

    async def send(self, msg: MutableMapping[str, Any]) -> None:
        await super().send(msg)
        if msg["type"] == "http.response.body" and msg.get("body"):
            await self.release.wait()


class PacedStream(FakeStream):
    """Deltas one loop turn apart, as they come off NATS."""

    async def _run(self) -> AsyncIterator[Delta]:
        for i, text in enumerate(self.script.deltas):
            await asyncio.sleep(0)
            self.yielded += 1
            yield Delta(request_id=self.request_id, seq=i, text=text, token_ids=[i])
        self.result = make_result("".join(self.script.deltas), request_id=self.request_id)
        self.closed = True


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_deltas_coalesce_only_while_the_client_is_behind(backend: FakeBackend, kind: str) -> None:
    deltas = ["a", "b", "c", "d", "e"]
    backend.script = Script(deltas=deltas)
    backend.generate = lambda args, *, tenant, request_id: PacedStream(backend.script, request_id)  # type: ignore[method-assign]
    app = create_app(backend)
    path, body = ("/v1/chat/completions", CHAT) if kind == "chat" else ("/v1/completions", {"prompt": "x"})
    call = SlowClient(path, {**body, "stream": True})
    task = asyncio.create_task(app(call.scope, call.receive, call.send))
    await asyncio.wait_for(call.got_body.wait(), 5)  # the first delta went out; its write is stuck
    for _ in range(20):  # the rest of the stream arrives meanwhile
        await asyncio.sleep(0)
    call.release.set()
    await asyncio.wait_for(task, 5)
    writes = [m["body"].decode() for m in call.sent if m["type"] == "http.response.body" and m.get("body")]
    events = sse_events("".join(writes))[:-1]
    key = "delta" if kind == "chat" else "text"
    texts = [(c["choices"][0]["delta"].get("content") if kind == "chat" else c["choices"][0]["text"])
             for c in events if c["choices"] and (key != "delta" or "content" in c["choices"][0]["delta"])]
    # The first delta on its own (the client kept up), the four that piled up behind it as one event.
    assert texts[:3] == (["", "a", "bcde"] if kind == "chat" else ["a", "bcde", ""])
    assert "".join(t or "" for t in texts) == "abcde"


async def test_fast_client_gets_every_delta_as_its_own_event(backend: FakeBackend) -> None:
    backend.generate = lambda args, *, tenant, request_id: PacedStream(backend.script, request_id)  # type: ignore[method-assign]
    app = create_app(backend)
    call = RawCall("/v1/completions", {"prompt": "x", "stream": True})
    await asyncio.wait_for(app(call.scope, call.receive, call.send), 5)
    body = "".join(m["body"].decode() for m in call.sent if m["type"] == "http.response.body")
    assert [c["choices"][0]["text"] for c in sse_events(body)[:-1]] == ["Hello", ",", " world", ""]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("usage", [False, True])
def test_pre_encoded_text_events_match_the_plain_encoding(kind: str, usage: bool) -> None:
    from splitserve.services.frontend.app import sse, text_event_encoder
    from splitserve.services.frontend.openai_api import Responder

    r = Responder(kind=kind, request_id="r1", model='m "q" é', created=1, include_usage=usage)  # type: ignore[arg-type]
    enc = text_event_encoder(r)
    for text in ["Hello", ' "quoted" \\ back', "é 漢字 \n\t\x00 \u2028", ""]:
        assert enc(text) == sse(r.text_chunk(text))
