"""SLO admission on a real stack: ``splitserve up --engine mock --strategy slo --slo-admission --tenants FILE`` (every
service its own process, real NATS with one user per tenant; a mock decoder whose step grows with its batch).

``tight`` promises its requests a first token within 400 ms; ``open`` promises nothing. A burst of tight's
requests far beyond what the decoder can start within that time must be answered early: the ones that can still
meet the target are served, and the rest are refused at once with ``slo_unattainable`` and a Retry-After, instead
of being queued and served seconds late. The same burst from ``open`` (no targets) is all accepted and served.
Through the front door the refusal is an HTTP 429 with a Retry-After header.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from splitserve import errors
from splitserve.client import Client
from splitserve.stackproc import StackProc, start_stack

pytestmark = pytest.mark.slow

PW = {"tight": "tight-password-1", "open": "open-password-1"}
TTFT_MS = 400.0
BURST = 48
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    tmp = tmp_path_factory.mktemp("slo")
    tenants = tmp / "tenants.yaml"
    tenants.write_text(
        "tenants:\n"
        f"  tight:\n    password: {PW['tight']}\n    api_keys: [sk-tight-1]\n    slo: {{ttft_p99_ms: {TTFT_MS:g}}}\n"
        f"  open:\n    password: {PW['open']}\n    max_queued: 500\n")
    # 16 slots; a step of 10 ms + 2 ms per running sequence: a full batch of 60-token requests runs ~2.5 s
    env = dict(os.environ, SPLITSERVE_MOCK_STEP_MS="10", SPLITSERVE_MOCK_STEP_MS_PER_SEQ="2")
    sp = start_stack(tmp / "state", "--engine", "mock", "--prefill", "0", "--decode", "1", "--frontends", "1",
                     "--tenants", str(tenants), "--strategy", "slo", "--slo-admission", env=env)
    try:
        yield sp
    finally:
        sp.stop()


async def _burst(url: str, tenant: str) -> tuple[list[float], list[tuple[float, errors.SplitserveError]]]:
    """(TTFTs of the served requests in ms, (answer time in ms, error) of the refused ones)."""
    served: list[float] = []
    refused: list[tuple[float, errors.SplitserveError]] = []

    async def one(c: Client, i: int) -> None:
        t0 = time.perf_counter()
        try:
            res = await c.complete(f"{tenant} burst request {i}", max_tokens=MAX_TOKENS)
        except errors.SplitserveError as exc:
            refused.append(((time.perf_counter() - t0) * 1000, exc))
            return
        assert res.ttft_ms is not None and len(res.token_ids) == MAX_TOKENS
        served.append(res.ttft_ms)

    async with Client(url, user=tenant, password=PW[tenant], idle_timeout=120) as c:
        await c.complete(f"{tenant} warm", max_tokens=4)
        await asyncio.gather(*(one(c, i) for i in range(BURST)))
    return served, refused


async def test_a_burst_past_the_slo_is_refused_early_not_served_late(stack: StackProc) -> None:
    url = stack.nats_url
    served, refused = await _burst(url, "tight")
    print(f"tight: {len(served)} served (TTFT p50 {statistics.median(served):.0f} ms, max {max(served):.0f} ms, "
          f"{sum(t > TTFT_MS for t in served)} over the target), "
          f"{len(refused)} refused (answered in p50 {statistics.median(t for t, _ in refused) if refused else 0:.0f}"
          f" ms)")
    assert refused and served, (len(served), len(refused))
    assert all(isinstance(e, errors.SloUnattainable) for _, e in refused), [e for _, e in refused][:3]
    assert all(e.retryable and e.retry_after_s is not None and e.retry_after_s >= 1 for _, e in refused)
    assert "400 ms" in str(refused[0][1]) and "retry in" in str(refused[0][1])
    # refused early: well before a served request's turn would have come (a full batch takes seconds)
    assert statistics.median(t for t, _ in refused) < statistics.median(served) + 1000

    # A tenant without targets: the same burst is queued and served, however late.
    open_served, open_refused = await _burst(url, "open")
    print(f"open: {len(open_served)} served (TTFT p50 {statistics.median(open_served):.0f} ms, max "
          f"{max(open_served):.0f} ms), {len(open_refused)} refused")
    assert not open_refused and len(open_served) == BURST
    # What was admitted was admitted because it could start in time: on a quiet machine most meet the target
    # (p50 60-65 ms); how far a loaded one is off depends on its load (one CI run: p50 639 ms while four test
    # files shared 2 cores), so the bound is against the same burst without admission, in the same run: the
    # admitted requests' typical and worst TTFT are both far below the unadmitted ones'.
    assert statistics.median(served) < 0.5 * statistics.median(open_served), (sorted(served), sorted(open_served))
    assert max(served) < max(open_served), (sorted(served), sorted(open_served))
    assert max(open_served) > TTFT_MS  # the burst really was past what tight's target allows


def test_the_front_door_answers_429_with_retry_after(stack: StackProc) -> None:
    assert stack.http_url is not None
    url, auth = stack.http_url, {"Authorization": "Bearer sk-tight-1"}

    async def fill() -> None:  # keep the decoder's slots and queue full while the HTTP request comes
        async with Client(stack.nats_url, user="open", password=PW["open"], idle_timeout=120) as c:
            await asyncio.gather(*(c.complete(f"open filler {i}", max_tokens=MAX_TOKENS) for i in range(BURST)))

    with urllib.request.urlopen(urllib.request.Request(stack.http_url + "/v1/models", headers=auth),
                                timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]

    async def probe() -> tuple[int, dict[str, str], dict[str, object]]:
        await asyncio.sleep(1.0)  # open's burst fills the decoder's slots and the queue
        statuses: list[tuple[int, dict[str, str], dict[str, object]]] = []
        for i in range(8):  # while the decoder is full, a tight request cannot get its first token in time
            body = json.dumps({"model": model, "prompt": f"tight http {i}", "max_tokens": MAX_TOKENS}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json", **auth})
            statuses.append(await asyncio.to_thread(_post, req))
            if statuses[-1][0] == 429:
                return statuses[-1]
        return statuses[-1]

    async def both() -> tuple[int, dict[str, str], dict[str, object]]:
        filler = asyncio.ensure_future(fill())
        try:
            return await probe()
        finally:
            await filler

    status, headers, body = asyncio.run(both())
    assert status == 429, (status, body)
    assert int(headers["retry-after"]) >= 1
    err = body["error"]
    assert isinstance(err, dict) and err["code"] == "slo_unattainable", body


def _post(req: urllib.request.Request) -> tuple[int, dict[str, str], dict[str, object]]:
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())

