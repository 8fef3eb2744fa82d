"""One front door, several served models (model pools): the HTTP layer in-process against a scripted backend
(what /v1/models lists, which model a request travels with, the 404 for an unknown one, the router's
model_not_found / model_not_allowed as HTTP statuses), and the front-door process's view of the decoders'
heartbeats (no NATS for those; one test over a real nats-server checks GenerateRequest.model on the wire)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import pytest
from nats.aio.msg import Msg

from splitserve import errors, proto
from splitserve.natsserver import NatsServer
from splitserve.proto import Accepted, ErrorCode, GenerateRequest, Heartbeat, StreamDelta, StreamFinal, Subjects
from splitserve.runtime.bus import Bus
from splitserve.services.frontend.app import FALLBACK_MAX_TOKENS, create_app
from splitserve.services.frontend.openai_api import GenerateArgs
from splitserve.services.frontend.service import FrontendService
from splitserve.tenancy.config import TenantsConfig
from tests.frontend.fakes import FakeBackend, Script
from tests.frontend.test_service import frontend, until

SMALL, BIG = "alpha-1b", "beta-8b"  # sorted: SMALL is the default
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(models={SMALL: 2048, BIG: 32768})


@pytest.fixture
async def http(backend: FakeBackend) -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(backend)), base_url="http://t") as c:
        yield c


# --- /v1/models -----------------------------------------------------------------------------------------


async def test_models_lists_every_served_model_with_its_context(http: httpx2.AsyncClient) -> None:
    r = await http.get("/v1/models")
    assert r.status_code == 200
    data = r.json()["data"]
    created = data[0]["created"]
    assert data == [{"id": name, "object": "model", "created": created, "owned_by": "splitserve", "root": name,
                     "parent": None, "max_model_len": n} for name, n in ((SMALL, 2048), (BIG, 32768))]
    for name, n in ((SMALL, 2048), (BIG, 32768)):
        card = await http.get(f"/v1/models/{name}")
        assert card.status_code == 200 and card.json()["id"] == name and card.json()["max_model_len"] == n
    r = await http.get("/v1/models/gamma-70b")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert f"Served models: {SMALL}, {BIG}." in r.json()["error"]["message"]


async def test_a_tenant_sees_only_the_models_and_adapters_its_contract_names(backend: FakeBackend) -> None:
    backend.adapters = {"beta-sql": BIG, "alpha-chat": SMALL}
    backend.tenants = TenantsConfig.model_validate({"tenants": {
        "narrow": {"api_keys": ["sk-narrow-0123456789"], "models": [SMALL, "alpha-chat"]},
        "wide": {"api_keys": ["sk-wide-0123456789ab"]}}})
    app = create_app(backend, api_keys={"sk-narrow-0123456789": "narrow", "sk-wide-0123456789ab": "wide"})
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as http:
        def listed(key: str) -> Any:
            return http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})

        narrow = [m["id"] for m in (await listed("sk-narrow-0123456789")).json()["data"]]
        wide = [m["id"] for m in (await listed("sk-wide-0123456789ab")).json()["data"]]
        assert narrow == [SMALL, "alpha-chat"] and wide == [SMALL, BIG, "alpha-chat", "beta-sql"]
        h = {"Authorization": "Bearer sk-narrow-0123456789"}
        for other in (BIG, "beta-sql"):
            r = await http.get(f"/v1/models/{other}", headers=h)
            assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed", r.text
        assert (await http.get("/v1/models/alpha-chat", headers=h)).json()["parent"] == SMALL
        assert (await http.get("/v1/models/gamma-70b", headers=h)).status_code == 404  # unknown: 404 as before


async def test_nothing_known_yet_is_503_for_a_card(backend: FakeBackend, http: httpx2.AsyncClient) -> None:
    backend.models, backend.model = {}, None
    assert (await http.get("/v1/models")).json()["data"] == []
    r = await http.get(f"/v1/models/{SMALL}")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_announced"
    assert r.headers["retry-after"] == "1"


# --- choosing the model ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_each_served_model_travels_with_its_request(http: httpx2.AsyncClient, backend: FakeBackend,
                                                          path: str, stream: bool) -> None:
    body: dict[str, Any] = {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "Once"}
    for name in (BIG, SMALL):
        r = await http.post(path, json={**body, "model": name, "stream": stream})
        assert r.status_code == 200, r.text
        assert f'"model":"{name}"' in r.text.replace(" ", "")  # the answer names the model asked for
        assert backend.calls[-1][0].model == name  # ... and the request travels with it (GenerateRequest.model)
        assert backend.calls[-1][0].client_kwargs()["model"] == name


async def test_no_model_named_is_the_first_served(http: httpx2.AsyncClient, backend: FakeBackend) -> None:
    r = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 200 and r.json()["model"] == SMALL
    assert backend.calls[-1][0].model == SMALL
    r = await http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200 and r.json()["model"] == SMALL and backend.calls[-1][0].model == SMALL


async def test_default_max_tokens_is_the_chosen_models_context(http: httpx2.AsyncClient,
                                                               backend: FakeBackend) -> None:
    for name, n in ((SMALL, 2048), (BIG, 32768)):
        assert (await http.post("/v1/chat/completions", json={"model": name, "messages": MESSAGES})).status_code == 200
        assert backend.calls[-1][0].max_tokens == n
    backend.models = {SMALL: 2048, BIG: None}  # a model that has not announced its context
    assert (await http.post("/v1/chat/completions", json={"model": BIG, "messages": MESSAGES})).status_code == 200
    assert backend.calls[-1][0].max_tokens == FALLBACK_MAX_TOKENS


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_unknown_model_is_404_listing_the_served_ones(http: httpx2.AsyncClient, backend: FakeBackend,
                                                            path: str, stream: bool) -> None:
    body: dict[str, Any] = {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "Once"}
    r = await http.post(path, json={**body, "model": "gamma-70b", "stream": stream})
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": f"The model 'gamma-70b' does not exist or you do not have access to it. "
                   f"Served models: {SMALL}, {BIG}.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert backend.calls == []


async def test_nothing_known_yet_goes_on_as_asked(http: httpx2.AsyncClient, backend: FakeBackend) -> None:
    # No decoder heard: no 404 (it could be wrong); the router decides. None named: the router's default.
    backend.models, backend.model = {}, None
    r = await http.post("/v1/completions", json={"prompt": "x", "model": "gamma-70b"})
    assert r.status_code == 200 and backend.calls[-1][0].model == "gamma-70b"
    r = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 200 and backend.calls[-1][0].model is None
    assert "model" not in backend.calls[-1][0].client_kwargs()
    assert backend.calls[-1][0].max_tokens == FALLBACK_MAX_TOKENS


async def test_one_model_served_is_as_before() -> None:
    backend = FakeBackend()  # one model, no served_models of its own: the single-model view
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(backend)), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert r.status_code == 200 and backend.calls[-1][0].model == backend.model
        assert backend.calls[-1][0].max_tokens == 8192
        r = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "model": "gpt-4o"})
        assert r.json()["error"]["message"] == "The model 'gpt-4o' does not exist or you do not have access to it."


# --- the router's refusals ------------------------------------------------------------------------------

REFUSALS = [(errors.ModelNotFound, 404, "invalid_request_error", "model_not_found",
             f"model 'gamma-70b' is not served; served: {SMALL}, {BIG}"),
            (errors.ModelNotAllowed, 403, "permission_error", "model_not_allowed",
             f"tenant 'default' may not use model '{BIG}'")]


@pytest.mark.parametrize(("cls", "status", "typ", "code", "message"), REFUSALS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("when", ["first-message", "send"])
async def test_router_model_refusals_get_their_status(http: httpx2.AsyncClient, backend: FakeBackend,
                                                      cls: type[errors.SplitserveError], status: int, typ: str,
                                                      code: str, message: str, stream: bool, when: str) -> None:
    exc = cls(message)
    assert exc.code in (ErrorCode.MODEL_NOT_FOUND, ErrorCode.MODEL_NOT_ALLOWED)
    if when == "first-message":  # the router's answer to the request (awaited before any header is sent)
        backend.script = Script(error=exc, error_at=0)
    else:  # raised while sending it

        def refuse(_: GenerateArgs) -> None:
            raise exc

        backend.on_generate = refuse
    r = await http.post("/v1/chat/completions", json={"model": BIG, "messages": MESSAGES, "stream": stream})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"] == {"message": message, "type": typ, "param": "model", "code": code}
    assert "retry-after" not in r.headers  # not retryable
    if when == "first-message":
        assert backend.streams[0].closed and backend.cancelled == []


async def test_the_openai_client_raises_not_found_and_permission_denied(backend: FakeBackend) -> None:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(backend)), base_url="http://t")
    client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http, max_retries=0)
    backend.script = Script(error=errors.ModelNotAllowed("not for you"), error_at=0)
    with pytest.raises(openai.PermissionDeniedError, match="not for you"):
        await client.chat.completions.create(model=BIG, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    backend.script = Script(error=errors.ModelNotFound("not served"), error_at=0)
    with pytest.raises(openai.NotFoundError, match="not served"):
        await client.completions.create(model=SMALL, prompt="x")
    with pytest.raises(openai.NotFoundError, match="Served models"):
        await client.completions.create(model="gamma-70b", prompt="x")
    await http.aclose()


# --- LoRA adapters ---------------------------------------------------------------------------------------


async def test_adapters_are_listed_with_their_parent_and_may_be_asked_for(backend: FakeBackend,
                                                                          http: httpx2.AsyncClient) -> None:
    backend.adapters = {"sql-lora": BIG}
    data = (await http.get("/v1/models")).json()["data"]
    assert [(m["id"], m["parent"], m["max_model_len"]) for m in data] == [
        (SMALL, None, 2048), (BIG, None, 32768), ("sql-lora", BIG, 32768)]
    card = (await http.get("/v1/models/sql-lora")).json()
    assert (card["id"], card["parent"], card["root"]) == ("sql-lora", BIG, "sql-lora")  # no worker path leaks
    r = await http.post("/v1/chat/completions", json={"model": "sql-lora", "messages": MESSAGES})
    assert r.status_code == 200 and r.json()["model"] == "sql-lora"
    args, _, _ = backend.calls[-1]
    assert args.model == "sql-lora"  # the router resolves its base model (and the workers that have it)
    r = await http.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
    assert r.status_code == 404 and "sql-lora" in r.json()["error"]["message"]


def test_adapters_are_what_live_decoders_have_loaded() -> None:
    svc = service()
    now = time.monotonic()
    svc.registry.observe(decoder("d0", BIG, 4096).model_copy(update={"adapters": ["b-lora", "a-lora"]}), now)
    svc.registry.observe(decoder("d1", SMALL, 4096).model_copy(update={"adapters": ["c-lora"]}), now)
    svc.registry.observe(decoder("p0", SMALL, 4096, role="prefill").model_copy(update={"adapters": ["p-only"]}),
                         now)
    assert svc.served_adapters == {"a-lora": BIG, "b-lora": BIG, "c-lora": SMALL}


# --- the front-door process's view of the heartbeats --------------------------------------------------


def decoder(wid: str, model: str | None, max_model_len: int | None, role: str = "decode") -> Heartbeat:
    return Heartbeat(worker_id=wid, role=role, seq=1, interval_ms=60_000, pid=1, model=model,  # type: ignore[arg-type]
                     max_model_len=max_model_len)


def service(**kw: Any) -> FrontendService:
    return FrontendService("frontend-m", "nats://127.0.0.1:1", log_level="WARNING", **kw)


def test_served_models_are_what_live_decoders_announce() -> None:
    svc = service()
    assert svc.served_models == {} and svc.model_name is None and svc.max_model_len is None
    now = time.monotonic()
    svc.registry.observe(decoder("router-0", "tokenizer-name", None, role="router"), now)
    assert svc.served_models == {} and svc.model_name == "tokenizer-name"  # the router's name is no served one
    for wid, model, n in (("d0", BIG, 32768), ("d1", SMALL, 4096), ("d2", SMALL, 2048), ("d3", None, 999),
                          ("d4", "gamma-70b", None)):
        svc.registry.observe(decoder(wid, model, n), now)
    svc.registry.observe(decoder("p0", "prefill-only", 1, role="prefill"), now)
    assert svc.served_models == {SMALL: 2048, BIG: 32768, "gamma-70b": None}
    assert list(svc.served_models) == sorted(svc.served_models)
    assert (svc.model_name, svc.served_model_name, svc.max_model_len) == (SMALL, SMALL, 2048)
    ready, detail = svc.readiness()
    assert detail["model"] == SMALL and detail["models"] == [SMALL, BIG, "gamma-70b"]


def test_the_routers_default_model_comes_first() -> None:
    """A request naming no model goes to the routers' default (their first --model, which their heartbeats
    name), not to whichever name sorts first."""
    svc = service()
    now = time.monotonic()
    for wid, model in (("d0", SMALL), ("d1", BIG)):
        svc.registry.observe(decoder(wid, model, 4096), now)
    svc.registry.observe(decoder("router-0", BIG, None, role="router"), now)
    assert list(svc.served_models) == [BIG, SMALL] and svc.model_name == BIG


def test_one_served_model_is_as_before() -> None:
    svc = service()
    now = time.monotonic()
    for wid, n in (("d0", 100), ("d1", 80)):
        svc.registry.observe(decoder(wid, SMALL, n), now)
    assert svc.served_models == {SMALL: 80}
    assert (svc.model_name, svc.served_model_name, svc.max_model_len) == (SMALL, SMALL, 80)
    assert svc.readiness()[1]["models"] == [SMALL]


def test_a_configured_model_name_is_the_one_served() -> None:
    svc = service(model_name="public-name")
    assert svc.served_models == {"public-name": None} and svc.model_name == "public-name"
    now = time.monotonic()
    svc.registry.observe(decoder("d0", SMALL, 2048), now)
    svc.registry.observe(decoder("d1", BIG, 32768), now)
    assert svc.served_models == {"public-name": 2048} and svc.max_model_len == 2048
    assert svc.readiness()[1]["models"] == ["public-name"]


class _Recorder:
    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    def generate(self, prompt: object, **kw: Any) -> object:
        self.kwargs = kw
        return object()


class _Connected:
    class nc:  # noqa: N801
        is_connected = True


def _args(model: str | None) -> GenerateArgs:
    return GenerateArgs(kind="completion", prompt="x", max_tokens=1, temperature=0.0, top_p=1.0, seed=None,
                        stop=[], stream=False, include_usage=False, model=model)


@pytest.mark.parametrize(("configured", "announced", "sent", "expected"), [
    (None, SMALL, BIG, BIG),  # the chosen model travels as is
    (None, SMALL, None, None),
    ("public-name", SMALL, "public-name", None),  # an alias no decoder announces: the router's default
    (SMALL, SMALL, SMALL, SMALL),  # a configured name the decoders announce: routed by it
])
def test_the_model_reaches_the_client(configured: str | None, announced: str, sent: str | None,
                                      expected: str | None) -> None:
    svc = service(model_name=configured)
    svc.registry.observe(decoder("d0", announced, 100), time.monotonic())
    recorder = _Recorder()
    svc._client, svc.bus = recorder, _Connected()  # type: ignore[assignment]
    svc.generate(_args(sent), tenant="acme", request_id="r1")
    assert recorder.kwargs.get("model") == expected


async def test_generate_request_model_over_nats(nats_server: NatsServer) -> None:
    """Two decoders of two models beating on a real NATS: /v1/models lists both and each request's
    GenerateRequest.model is the model asked for (the first one when none is named)."""
    bus = await Bus.connect(nats_server.url, "pools-cluster")
    seen: list[GenerateRequest] = []

    async def on_request(req: GenerateRequest, msg: Msg) -> None:
        seen.append(req)
        await bus.respond(msg, Accepted(request_id=req.request_id, router_id="router-m", prompt_tokens=1))
        await bus.publish(req.stream_subject, StreamDelta(request_id=req.request_id, seq=0, token_ids=[0], text="ok"))
        await bus.publish(req.stream_subject, StreamFinal(
            request_id=req.request_id, seq=1, token_ids=[0], text="ok", finish_reason="stop",
            usage=proto.Usage(prompt_tokens=1, completion_tokens=1), route=proto.Route.DIRECT,
            prefill_worker=None, decode_worker="decode-m"))

    async def beat() -> None:
        seq = 0
        while True:
            seq += 1
            for role, wid, model, n in (("router", "router-m", "tok", None), ("decode", "decode-a", SMALL, 2048),
                                        ("decode", "decode-b", BIG, 32768)):
                await bus.publish(Subjects.heartbeat(role, wid), Heartbeat(
                    worker_id=wid, role=role, seq=seq, interval_ms=200, pid=1, model=model,  # type: ignore[arg-type]
                    max_model_len=n))
            await asyncio.sleep(0.2)

    await bus.subscribe(Subjects.REQUEST_ALL, GenerateRequest, on_request, queue=Subjects.ROUTER_QUEUE,
                        concurrent=True)
    beating = asyncio.create_task(beat())
    try:
        async with frontend(nats_server.url) as svc, httpx2.AsyncClient(base_url=svc.url, timeout=10) as http:
            await until(lambda: len(svc.served_models) == 2 and svc.readiness()[0])
            listed = (await http.get("/v1/models")).json()["data"]
            assert [(m["id"], m["max_model_len"]) for m in listed] == [(SMALL, 2048), (BIG, 32768)]
            ready = (await http.get("/readyz")).json()
            assert ready["model"] == SMALL and ready["models"] == [SMALL, BIG]
            for name in (BIG, SMALL):
                r = await http.post("/v1/chat/completions", json={"model": name, "messages": MESSAGES})
                assert r.status_code == 200 and r.json()["model"] == name, r.text
                assert seen[-1].model == name
            assert seen[-1].sampling.max_tokens == 2048
            r = await http.post("/v1/completions", json={"prompt": "x", "stream": True})
            assert r.status_code == 200 and seen[-1].model == SMALL
            n = len(seen)
            r = await http.post("/v1/completions", json={"prompt": "x", "model": "gamma-70b"})
            assert r.status_code == 404 and f"{SMALL}, {BIG}" in r.json()["error"]["message"]
            assert len(seen) == n  # refused here, never sent
    finally:
        beating.cancel()
        await bus.nc.close()
