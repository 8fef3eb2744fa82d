"""End to end through the OpenAI-compatible front door of a real ``splitserve up`` (real model, every service
its own process), with the official ``openai`` client where a client would use it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import nats
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from splitserve import proto
from splitserve.natsserver import free_port
from splitserve.stackproc import StackProc, start_stack
from tests.procs import spawn_service, stop

pytestmark = pytest.mark.slow

PARIS: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    sp = start_stack(Path(tmp_path_factory.mktemp("stack")), "--http-port", "0", "--frontends", "2")
    try:
        assert sp.http_url, sp.output
        yield sp
    finally:
        rc = sp.stop()
        assert rc == 0, sp.output


@pytest.fixture(scope="module")
def client(stack: StackProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    ids = [m.id for m in client.models.list()]
    assert len(ids) == 1
    return ids[0]


def test_stack_prints_the_api_url_and_is_ready(stack: StackProc) -> None:
    assert any(line.strip().startswith(f"OpenAI API: {stack.http_url}/v1") for line in stack.output)
    r = httpx2.get(f"{stack.http_url}/readyz")
    assert r.status_code == 200, r.text
    assert r.json()["routers"] == ["router-0"] and r.json()["decoders"] == ["decode-0"]
    assert httpx2.get(f"{stack.http_url}/healthz").json() == {"status": "ok"}


def test_chat_non_streaming_answers_paris(client: openai.OpenAI, model: str) -> None:
    res = client.chat.completions.create(model=model, messages=PARIS, max_tokens=16, temperature=0)
    assert "Paris" in (res.choices[0].message.content or "")
    assert res.choices[0].finish_reason in ("stop", "length") and res.model == model
    u = res.usage
    assert u is not None and u.prompt_tokens > 0 and 0 < u.completion_tokens <= 16
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None and isinstance(u.prompt_tokens_details.cached_tokens, int)
    extras: dict[str, Any] = res.to_dict()["splitserve"]  # type: ignore[assignment]
    assert extras["decode_worker"] == "decode-0" and extras["route"] in ("direct", "disaggregated")
    assert extras["ttft_ms"] > 0


def test_chat_streaming_answers_paris_with_usage(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(model=model, messages=PARIS, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, usage, finish, roles = "", None, None, []
    for chunk in stream:
        if chunk.choices:
            d = chunk.choices[0].delta
            roles += [d.role] if d.role else []
            text += d.content or ""
            finish = chunk.choices[0].finish_reason or finish
        elif chunk.usage is not None:
            usage = chunk.usage
    assert "Paris" in text and roles == ["assistant"] and finish in ("stop", "length")
    assert usage is not None and usage.prompt_tokens_details is not None
    assert isinstance(usage.prompt_tokens_details.cached_tokens, int)


def test_completions_streaming(client: openai.OpenAI, model: str) -> None:
    stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0,
                                       stream=True)
    chunks = list(stream)
    assert chunks and all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks).strip()


def test_error_statuses(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=PARIS, n=2)
    assert bad.value.status_code == 400 and "n=1" in bad.value.message
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-4o", messages=PARIS)
    assert nf.value.status_code == 404
    with pytest.raises(openai.APIStatusError) as big:
        client.completions.create(model=model, prompt="hello " * 9000, max_tokens=2)
    assert big.value.status_code == 413
    assert isinstance(big.value.body, dict) and big.value.body["code"] == "context_length_exceeded"
    assert "tokens" in big.value.message


def test_request_id_is_used_and_echoed(stack: StackProc, model: str) -> None:
    r = httpx2.post(f"{stack.http_url}/v1/completions", headers={"X-Request-Id": "e2e-req-1"},
                    json={"model": model, "prompt": "Hello", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "e2e-req-1" and r.json()["id"] == "cmpl-e2e-req-1"
    assert r.json()["splitserve"]["request_id"] == "e2e-req-1"
    r = httpx2.get(f"{stack.http_url}/v1/models", headers={"X-Request-Id": "not valid!"})
    assert r.headers["x-request-id"] and r.headers["x-request-id"] != "not valid!"


async def _frontend_requests(url: str) -> set[str]:
    """The requests every front door (``up`` runs two on one port) lists in its next heartbeat."""
    nc = await nats.connect(url)
    try:
        open_: set[str] = set()
        for name in ("frontend-0", "frontend-1"):
            sub = await nc.subscribe(proto.Subjects.heartbeat("frontend", name))
            open_.update(proto.decode((await sub.next_msg(timeout=5)).data, proto.Heartbeat).active_requests)
        return open_
    finally:
        await nc.close()


def test_disconnect_mid_stream_leaves_the_server_healthy(stack: StackProc, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 400, "stream": True}
    assert stack.http_url
    with httpx2.Client(base_url=stack.http_url, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": "e2e-drop"}) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    n += 1
                    if n == 3:
                        break
        # The connection is closed mid-stream: the front door stops relaying and releases the request.
        deadline = time.monotonic() + 30
        while True:
            open_ = asyncio.run(_frontend_requests(stack.nats_url))
            if "e2e-drop" not in open_:
                break
            assert time.monotonic() < deadline, open_
            time.sleep(0.5)
        logs = stack.logs("frontend-0") + stack.logs("frontend-1")  # whichever accepted the connection
        assert '"cancel_request"' in logs and "e2e-drop" in logs
        assert http.get("/readyz").status_code == 200
        r2 = http.post("/v1/chat/completions", json={"model": model, "messages": PARIS, "max_tokens": 2})
        assert r2.status_code == 200, r2.text


def test_api_keys_401_and_tenant(stack: StackProc, model: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-test-1-0123456789": "acme"}))
    port = free_port()
    p = spawn_service("splitserve.services.frontend", "--api-keys", str(keys), "--port", str(port),
                      nats_url=stack.nats_url,
                      worker_id="frontend-keys", log_dir=tmp_path / "logs")
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx2.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            assert time.monotonic() < deadline and p.poll() is None, (tmp_path / "logs").glob("*")
            time.sleep(0.3)
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as ei:
            bad.chat.completions.create(model=model, messages=PARIS, max_tokens=2)
        assert ei.value.status_code == 401
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test-1-0123456789", max_retries=0, timeout=120)
        res = good.chat.completions.create(model=model, messages=PARIS, max_tokens=2)
        assert res.usage is not None and res.usage.completion_tokens >= 1
    finally:
        stop(p)


def test_metrics_and_top_show_the_cluster(stack: StackProc, client: openai.OpenAI, model: str) -> None:
    import json
    import subprocess
    import sys
    import time

    from prometheus_client.parser import text_string_to_metric_families

    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
    deadline = time.monotonic() + 30
    while True:
        assert stack.metrics_url  # /metrics is on its own loopback port, not the API's
        # Each request is counted by one front door (a queue group): a series summed over them is the cluster's,
        # as Prometheus sums it over pods
        samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        texts = [httpx2.get(u).text for u in stack.metrics_urls]
        text = "\n".join(texts)
        for part in texts:
            for fam in text_string_to_metric_families(part):
                for s in fam.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    samples[key] = samples.get(key, 0.0) + s.value
        ttft = sum(v for (name, lab), v in samples.items()
                   if name == "splitserve_ttft_seconds_count" and ("tenant", "default") in lab)
        if ttft >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ttft >= 1, text
    # a gauge from the heartbeats is the cluster's on every front door (summed here: one 1 per front door)
    assert any(name == "splitserve_worker_up" and ("worker", "decode-0") in lab and v == len(texts)
               for (name, lab), v in samples.items())
    assert any(name == "splitserve_tokens_total" for name, _ in samples)
    exe = str(Path(sys.executable).parent / "splitserve")
    cp = subprocess.run([exe, "top", "--nats-url", stack.nats_url, "--once", "--json", "--interval", "1.5"],
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    snap = json.loads(cp.stdout)
    roles = {w["role"] for w in snap["workers"]}
    assert {"router", "prefill", "decode"} <= roles
