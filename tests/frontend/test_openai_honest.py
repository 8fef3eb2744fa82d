"""An honest OpenAI API, in-process against a scripted backend: every field this server does not implement
is a 400 naming it (its neutral values pass); what it implements reaches the request (priority, session key,
logprobs, min_tokens, ignore_eos); server-cut generations say "abort"; the front door's own HTTP metrics and
ASGI server span."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2
import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from splitserve import proto
from splitserve.client import Delta
from splitserve.services.frontend import app as app_module
from splitserve.services.frontend import openai_api as oa
from splitserve.services.frontend.app import SESSION_HEADER, create_app, create_metrics_app
from tests.frontend.fakes import MODEL, FakeBackend, FakeStream, Script, make_result

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "Hi"}

# One value per unsupported field that asks for something this server cannot do.
NON_NEUTRAL: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "required",
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "response_format": {"type": "json_object"},
    "presence_penalty": 0.5,
    "frequency_penalty": -0.3,
    "repetition_penalty": 1.2,
    "logit_bias": {"50256": -100},
    "top_k": 40,
    "min_p": 0.05,
    "prompt_logprobs": 1,
    "use_beam_search": True,
    "length_penalty": 0.8,
    "stop_token_ids": [2],
    "bad_words": ["x"],
    "allowed_token_ids": [1, 2],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 10,
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a"],
    "guided_grammar": "root ::= 'a'",
    "structured_outputs": {"json": {}},
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high",
    "web_search_options": {},
    "store": True,
    "return_tokens_as_token_ids": True,
    "kv_transfer_params": {"do_remote_decode": True},
    "chat_template": "{{ x }}",
    "chat_template_kwargs": {"enable_thinking": True},
    "continue_final_message": True,
    "add_generation_prompt": False,
    "mm_processor_kwargs": {"x": 1},
}
NEUTRAL: dict[str, Any] = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                           "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "top_k": -1,
                           "min_p": 0.0, "store": False, "skip_special_tokens": True, "metadata": {"a": "b"},
                           "parallel_tool_calls": True, "service_tier": "auto"}


def test_every_unsupported_field_has_a_rejecting_value() -> None:
    assert set(NON_NEUTRAL) == set(oa.UNSUPPORTED)


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
async def http(backend: FakeBackend) -> AsyncIterator[httpx2.AsyncClient]:
    app = create_app(backend)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as c:
        yield c


@pytest.mark.parametrize("field", sorted(NON_NEUTRAL))
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_unsupported_field_is_a_400_naming_it(http: httpx2.AsyncClient, backend: FakeBackend, field: str,
                                                    path: str) -> None:
    body = {**(CHAT if "chat" in path else COMPLETION), field: NON_NEUTRAL[field]}
    r = await http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported_parameter" and f"'{field}'" in err["message"]
    assert backend.calls == []  # nothing was sent


async def test_neutral_values_of_unsupported_fields_pass(http: httpx2.AsyncClient, backend: FakeBackend) -> None:
    r = await http.post("/v1/chat/completions", json={**CHAT, **NEUTRAL})
    assert r.status_code == 200, r.text
    assert len(backend.calls) == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_cache_salt_is_passed_through(http: httpx2.AsyncClient, backend: FakeBackend, path: str) -> None:
    """vLLM's ``cache_salt`` reaches the request (the router combines it with the tenant's own salt)."""
    r = await http.post(path, json={**(CHAT if "chat" in path else COMPLETION), "cache_salt": "conversation-7"})
    assert r.status_code == 200, r.text
    args = backend.calls[-1][0]
    assert args.cache_salt == "conversation-7" and args.client_kwargs()["cache_salt"] == "conversation-7"
    r = await http.post(path, json=CHAT if "chat" in path else COMPLETION)
    assert "cache_salt" not in backend.calls[-1][0].client_kwargs()  # none sent: the request is unchanged
    for bad in ("", "x" * 257):
        r = await http.post(path, json={**(CHAT if "chat" in path else COMPLETION), "cache_salt": bad})
        assert r.status_code == 400, r.text


async def test_unknown_fields_are_ignored_and_logged_once(http: httpx2.AsyncClient,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The module's logger replaced by a recorder: structlog.testing.capture_logs misses a logger already cached
    # (cache_logger_on_first_use) by a front door service run earlier in this process.
    logs: list[dict[str, Any]] = []

    class Recorder:
        def __getattr__(self, level: str) -> Any:
            return lambda event, **kw: logs.append({"event": event, "log_level": level, **kw})

    monkeypatch.setattr(app_module, "log", Recorder())
    for _ in range(3):
        r = await http.post("/v1/chat/completions", json={**CHAT, "x_vendor_knob_7": 1})
        assert r.status_code == 200
    warned = [e for e in logs if e["event"] == "unknown_request_field_ignored"]
    assert [e["field"] for e in warned] == ["x_vendor_knob_7"]


async def test_implemented_fields_reach_the_request(http: httpx2.AsyncClient, backend: FakeBackend) -> None:
    r = await http.post("/v1/chat/completions", json={**CHAT, "priority": 3, "user": "alice", "min_tokens": 2,
                                                      "ignore_eos": True, "logprobs": True, "top_logprobs": 4,
                                                      "max_tokens": 9})
    assert r.status_code == 200, r.text
    args = backend.calls[-1][0]
    assert (args.priority, args.session_id, args.min_tokens, args.ignore_eos, args.logprobs, args.max_tokens) == \
        (3, "alice", 2, True, 4, 9)
    assert args.client_kwargs()["model"] == MODEL
    # the header is the session key, over the body's user
    await http.post("/v1/completions", json={**COMPLETION, "user": "alice", "logprobs": 2},
                    headers={SESSION_HEADER: "sess-9"})
    args = backend.calls[-1][0]
    assert args.session_id == "sess-9" and args.logprobs == 2 and args.client_kwargs()["session_id"] == "sess-9"


@pytest.mark.parametrize(("body", "param"), [
    ({"priority": 10}, "priority"), ({"priority": -1}, "priority"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
])
async def test_bad_values_of_implemented_fields(http: httpx2.AsyncClient, body: dict[str, Any], param: str) -> None:
    r = await http.post("/v1/chat/completions", json={**CHAT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("raw", ["cancelled", "expired"])
async def test_server_cut_generations_say_abort(http: httpx2.AsyncClient, backend: FakeBackend, raw: str) -> None:
    backend.script = Script(finish=raw)
    r = await http.post("/v1/chat/completions", json=CHAT)
    assert r.json()["choices"][0]["finish_reason"] == "abort"
    assert r.json()["splitserve"]["finish_reason"] == raw  # the internal reason stays visible


def _lp(token_id: int, token: str, lp: float) -> proto.TokenLogprob:
    return proto.TokenLogprob(token_id=token_id, token=token, logprob=lp,
                              top=[proto.TopLogprob(token_id=token_id, token=token, logprob=lp),
                                   proto.TopLogprob(token_id=99, token="zz", logprob=lp - 1)])


class LogprobStream(FakeStream):
    """Two text deltas (the first holding back a token with no text yet), then an EOS the deltas never carry."""

    async def _run(self) -> AsyncIterator[Delta]:
        lps = [_lp(1, "He", -0.1), _lp(2, "l", -0.2), _lp(3, "lo", -0.3), _lp(4, "</s>", -0.4)]
        yield Delta(self.request_id, 0, "", [1], [lps[0]])
        yield Delta(self.request_id, 1, "Hel", [2], [lps[1]])
        yield Delta(self.request_id, 2, "lo", [3], [lps[2]])
        res = make_result("Hello", request_id=self.request_id, completion_tokens=4)
        self.result = res.__class__(**{**res.__dict__, "logprobs": lps, "token_ids": [1, 2, 3, 4]})


async def test_logprobs_shapes_through_the_openai_client(backend: FakeBackend, monkeypatch: pytest.MonkeyPatch) \
        -> None:
    monkeypatch.setattr(backend, "generate", lambda args, **kw: LogprobStream(backend.script, kw["request_id"]))
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(backend)), base_url="http://t")
    client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http, max_retries=0)
    msgs: Any = CHAT["messages"]
    res = await client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=2)
    content = res.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [c.token for c in content] == ["He", "l", "lo", "</s>"]
    assert content[0].top_logprobs[0].token == "He" and content[0].bytes == list(b"He")
    streamed: list[str] = []
    async for chunk in await client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True,
                                                            top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += [c.token for c in chunk.choices[0].logprobs.content]
    assert streamed == ["He", "l", "lo", "</s>"]  # held-back and EOS tokens' logprobs are not lost
    comp = await client.completions.create(model=MODEL, prompt="x", logprobs=2)
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.tokens == ["He", "l", "lo", "</s>"] and lp.text_offset == [0, 2, 3, 5]
    assert lp.top_logprobs is not None and lp.top_logprobs[2] == {"lo": -0.3, "zz": -1.3}
    await http.aclose()


async def test_front_door_http_metrics(backend: FakeBackend) -> None:
    app = create_app(backend)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as http:
        await http.post("/v1/chat/completions", json=CHAT)
        assert (await http.get("/metrics")).status_code == 404  # not on the API port
    metrics = create_metrics_app(backend, app)  # /metrics is served on its own port (not the API's)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=metrics), base_url="http://t") as m:
        text = (await m.get("/metrics")).text
    assert 'http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 1.0' in text
    assert "http_request_duration_seconds_bucket" in text
    assert "splitserve_requests_total" in text  # the backend's cluster series are still there


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # the global provider can be set once per process: patch the getter instead
    original = trace.get_tracer_provider
    trace.get_tracer_provider = lambda: provider  # type: ignore[assignment]
    try:
        yield exporter
    finally:
        trace.get_tracer_provider = original  # type: ignore[assignment]


async def test_asgi_server_span_continues_the_callers_trace(backend: FakeBackend,
                                                            spans: InMemorySpanExporter) -> None:
    app = create_app(backend)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as http:
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        r = await http.post("/v1/chat/completions", json=CHAT, headers={"traceparent": parent})
        assert r.status_code == 200
        await http.get("/healthz")  # probes are not traced
    server = [s for s in spans.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    assert len(server) == 1, [s.name for s in spans.get_finished_spans()]
    s = server[0]
    assert s.context is not None and format(s.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    attrs = dict(s.attributes or {})
    assert attrs["gen_ai.request.model"] == MODEL and attrs["gen_ai.operation.name"] == "chat"
    assert attrs["request_id"] == r.headers["X-Request-Id"]
