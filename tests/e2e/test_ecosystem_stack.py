"""A real ``splitserve up`` (hf engine, real model, two decoders, the session strategy) seen as the field sees
it: the official ``openai`` client for every implemented field (logprobs, ignore_eos, min_tokens, priority,
session key), a rejected field, /metrics by vLLM's names, the gen_ai.* attributes of the request's spans, and
every line every service wrote being JSON."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from splitserve.client import Client
from splitserve.obs import tracing
from splitserve.stackproc import StackProc, start_stack

pytestmark = pytest.mark.slow

PARIS: Any = [{"role": "user", "content": "What is the capital of France?"}]
SERVICES = ("router-0", "cache-index-0", "prefill-0", "decode-0", "decode-1", "frontend-0")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    sp = start_stack(Path(tmp_path_factory.mktemp("stack")), "--decode", "2", "--strategy", "session",
                     "--transport", "tcp", "--disagg-threshold", "64", "--frontends", "2", timeout=900)
    try:
        assert sp.http_url, sp.output
        yield sp
    finally:
        sp.stop()


@pytest.fixture(scope="module")
def client(stack: StackProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_report_max_model_len(stack: StackProc, model: str) -> None:
    card = httpx2.get(f"{stack.http_url}/v1/models").json()["data"][0]
    assert card["id"] == model and card["max_model_len"] == 8192


def test_chat_logprobs_greedy_top_is_the_chosen_token(client: openai.OpenAI, model: str) -> None:
    res = client.chat.completions.create(model=model, messages=PARIS, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=3)
    assert res.usage is not None and res.choices[0].logprobs is not None
    content = res.choices[0].logprobs.content or []
    assert len(content) == res.usage.completion_tokens > 0
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob) and c.logprob <= 0.0
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
    assert "Paris" in "".join(c.token for c in content)


def test_completion_logprobs_streamed_and_whole_agree(client: openai.OpenAI, model: str) -> None:
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0,
                                      logprobs=2)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert max(top, key=lambda k: top[k]) == tok
    streamed: list[str] = []
    for chunk in client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0,
                                           logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
            streamed += chunk.choices[0].logprobs.tokens
    assert streamed == lp.tokens


def test_disaggregated_route_carries_the_first_tokens_logprob(stack: StackProc) -> None:
    async def go() -> Any:
        async with Client(stack.nats_url) as c:
            return await c.complete("Tell me a story about a dragon. " * 8, max_tokens=4, logprobs=1,
                                    route="disaggregated")

    res = asyncio.run(go())
    assert res.route == "disaggregated" and res.prefill_worker
    assert res.logprobs is not None and [lp.token_id for lp in res.logprobs] == res.token_ids


def test_ignore_eos_and_min_tokens(client: openai.OpenAI, model: str) -> None:
    plain = client.chat.completions.create(model=model, messages=PARIS, max_tokens=40, temperature=0)
    assert plain.usage is not None and plain.choices[0].finish_reason == "stop"
    n = plain.usage.completion_tokens
    assert n < 30  # "The capital of France is Paris." then EOS
    forced: Any = client.chat.completions.create(model=model, messages=PARIS, max_tokens=n + 6, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == n + 6 and forced.choices[0].finish_reason == "length"
    longer: Any = client.chat.completions.create(model=model, messages=PARIS, max_tokens=40, temperature=0,
                                                 extra_body={"min_tokens": n + 3})
    assert longer.usage.completion_tokens >= n + 3


def test_session_key_sticks_to_one_decoder_and_priority_is_accepted(client: openai.OpenAI, model: str) -> None:
    def worker(**kw: Any) -> str:
        res: Any = client.completions.create(model=model, prompt="Hi", max_tokens=1, temperature=0, **kw)
        return str(res.to_dict()["splitserve"]["decode_worker"])

    for key in ("alice", "bob", "carol"):
        by_user = {worker(user=key) for _ in range(3)}
        by_header = {worker(extra_headers={"X-Session-Id": key}, extra_body={"priority": 2}) for _ in range(2)}
        assert len(by_user) == 1 and by_header == by_user, (key, by_user, by_header)


def test_unsupported_field_is_rejected_by_the_real_server(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=PARIS, max_tokens=4,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    body: Any = e.value.body
    assert body["param"] == "tools" and body["code"] == "unsupported_parameter"


def _completions_served(stack: StackProc) -> float:
    """POST /v1/completions answered 2xx, summed over the front doors (each counts the HTTP requests it served)."""
    from prometheus_client.parser import text_string_to_metric_families

    assert len(stack.metrics_urls) >= 2, stack.output
    want = {"handler": "/v1/completions", "method": "POST", "status": "2xx"}
    return sum(s.value for u in stack.metrics_urls for fam in text_string_to_metric_families(httpx2.get(u).text)
               for s in fam.samples if s.name == "http_requests_total" and s.labels == want)


def test_metrics_by_vllms_names(stack: StackProc, client: openai.OpenAI, model: str) -> None:
    served = _completions_served(stack)
    client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    deadline = time.monotonic() + 10
    while True:  # RequestFinished reaches the front door asynchronously
        # each front door's own loopback port, not the API's; the request is counted by one of them (a queue group)
        text = "\n".join(httpx2.get(u).text for u in stack.metrics_urls)
        if f'splitserve:generation_tokens_total{{model_name="{model}"}}' in text or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    for name in ("splitserve:time_to_first_token_seconds_bucket", "splitserve:inter_token_latency_seconds_bucket",
                 "splitserve:e2e_request_latency_seconds_bucket", "splitserve:request_queue_time_seconds_bucket",
                 "splitserve:prompt_tokens_total", "splitserve:generation_tokens_total",
                 "splitserve:prefix_cache_queries_total", "splitserve:prefix_cache_hits_total",
                 "splitserve:request_prompt_tokens_bucket", "splitserve:request_success_total",
                 "splitserve:num_requests_running"):
        assert f"{name}{{" in text and f'model_name="{model}"' in text, name
    # The HTTP series are each front door's own: the request was served by one of them.
    assert _completions_served(stack) == served + 1


def test_spans_carry_gen_ai_attributes(stack: StackProc, model: str) -> None:
    r = httpx2.post(f"{stack.http_url}/v1/chat/completions", timeout=120,
                    json={"model": model, "messages": PARIS, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    rid = r.json()["splitserve"]["request_id"]

    async def spans() -> list[dict[str, Any]]:
        import nats

        nc = await nats.connect(stack.nats_url)
        try:
            return tracing.spans_for_request(await tracing.read_spans(nc), rid)
        finally:
            await nc.close()

    want = {"client.generate", "router.request", "router.dispatch", "decode.stream"}
    deadline = time.monotonic() + 20
    while True:
        got = {s["name"]: s for s in asyncio.run(spans())}
        if want <= set(got) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert want <= set(got), sorted(got)
    for name in want:
        a = got[name]["attributes"]
        assert a["gen_ai.provider.name"] == "splitserve" and a["gen_ai.request.max_tokens"] == 5, (name, a)
        assert a["gen_ai.request.model"] == model and a["gen_ai.request.temperature"] == 0.0, (name, a)
    assert got["client.generate"]["attributes"]["gen_ai.operation.name"] == "chat"
    for name in ("client.generate", "decode.stream"):
        a = got[name]["attributes"]
        assert a["gen_ai.response.id"] == rid and a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0
    server = [s for s in tracing.spans_for_request(asyncio.run(_all(stack)), rid) if s["service"] == "frontend"
              and s["name"].startswith("POST")]
    assert server and server[0]["attributes"]["gen_ai.request.model"] == model


async def _all(stack: StackProc) -> list[dict[str, Any]]:
    import nats

    nc = await nats.connect(stack.nats_url)
    try:
        return await tracing.read_spans(nc)
    finally:
        await nc.close()


def test_every_line_of_every_service_log_is_json(stack: StackProc) -> None:
    # last in the module: the stack has loaded models, served requests and (below) shut down
    assert stack.stop() == 0
    for name in SERVICES:
        path = stack.state_dir / "logs" / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines()
        assert len(lines) >= 2, name  # at least: ready, stopped
        for i, line in enumerate(lines):
            try:
                obj = json.loads(line)
            except ValueError:
                pytest.fail(f"{name}.log line {i + 1} is not JSON: {line[:300]!r}")
            assert isinstance(obj, dict) and "event" in obj and "level" in obj, (name, line[:300])
