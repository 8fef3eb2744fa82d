"""The router against a real nats-server, with no workers: malformed input, no workers, no router, payload
limits. Each failure gives the caller a precise terminal error and the router keeps serving."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from splitserve import errors, proto
from splitserve.client import Client
from splitserve.natsserver import NatsServer
from splitserve.proto import ErrorCode, StreamError
from tests.procs import spawn_service, stop, wait_ready

pytestmark = pytest.mark.slow  # loads the tokenizer in a real router process


@pytest.fixture(scope="module")
def router(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    p = spawn_service("splitserve.services.router", "--no-worker-wait-s", "1.0", nats_url=nats_server.url,
                      worker_id="router-t", log_dir=Path(tmp_path_factory.mktemp("logs")))
    try:
        asyncio.run(wait_ready(nats_server.url, ["router-t"], timeout=120))
        yield nats_server.url
    finally:
        stop(p)


async def _raw_request(url: str, subject: str, payload: bytes) -> StreamError:
    nc = await nats.connect(url)
    try:
        resp = await nc.request(subject, payload, timeout=10)
        return proto.decode(resp.data, StreamError)
    finally:
        await nc.close()


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"\x00\xffgarbage", ErrorCode.BAD_REQUEST),
        (b'{"v": 99, "kind": "generate_request"}', ErrorCode.UNSUPPORTED_VERSION),
        (b'{"v": 1, "request_id": "r1", "tenant": "acme", "stream_subject": "x"}', ErrorCode.BAD_REQUEST),
    ],
)
async def test_malformed_request_gets_error_reply_and_router_survives(router: str, payload: bytes,
                                                                     code: ErrorCode) -> None:
    err = await _raw_request(router, "ss.req.acme", payload)
    assert err.code == code
    assert err.message
    # Still serving: a valid request gets a precise (no-workers) answer.
    async with Client(router, tenant="acme") as c:
        with pytest.raises(errors.NoWorkers):
            await c.complete("hello", max_tokens=2)


async def test_no_decode_worker_is_a_clear_error_within_bounded_time(router: str) -> None:
    async with Client(router, tenant="acme") as c:
        t0 = time.monotonic()
        with pytest.raises(errors.NoWorkers) as ei:
            await c.complete("hello", max_tokens=2)
        took = time.monotonic() - t0
    assert "no live decode worker" in ei.value.message
    assert took < 10  # the router waits --no-worker-wait-s (1 s), never indefinitely


async def test_no_router_is_unavailable_at_once(fresh_nats: NatsServer) -> None:
    async with Client(fresh_nats.url, tenant="acme") as c:
        t0 = time.monotonic()
        with pytest.raises(errors.Unavailable) as ei:
            await c.complete("hello")
        assert time.monotonic() - t0 < 5
    assert "no router" in ei.value.message


async def test_unreachable_nats_is_a_clear_error() -> None:
    with pytest.raises(errors.Unavailable) as ei:
        async with Client("nats://127.0.0.1:1", tenant="acme"):
            pass
    assert "cannot connect" in ei.value.message


async def test_oversize_request_rejected_before_nats(router: str) -> None:
    async with Client(router, tenant="acme") as c:
        huge = "x " * (5 * 1024 * 1024)  # ~10 MB of text, over the 8 MiB max_payload
        with pytest.raises(errors.PayloadTooLarge) as ei:
            await c.complete(huge)
    assert "max_payload" in ei.value.message


def test_invalid_parameters_rejected_client_side() -> None:
    c = Client("nats://127.0.0.1:4222", tenant="acme")
    with pytest.raises(errors.BadRequest):
        c.generate("hi", max_tokens=0)
    with pytest.raises(ValueError):
        Client("nats://127.0.0.1:4222", tenant="bad.tenant")
