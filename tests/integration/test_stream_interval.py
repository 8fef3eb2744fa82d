"""A decoder's ``--stream-interval`` (real processes: nats-server, a router, mock-engine decoders).

N tokens per delta, as vLLM's option: the first token at once (time to first token is not traded), then N at a
time, the last ones just before the final; the caller gets every token, text and log-probability exactly once,
in order, the same as one token per delta. A request cancelled mid-stream still gets what was generated.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator

import pytest

from splitserve.client import Client, Delta, Result
from splitserve.natsserver import start_nats
from tests.procs import spawn_service, stop, wait_ready

pytestmark = pytest.mark.slow

PROMPT = "Tell me a story about the sea"


@pytest.fixture(scope="module")
def decoders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A nats-server of its own, a router and two decoders: one sends each token at once, one 4 at a time
    (roundrobin alternates them; each result says which decoder served it)."""
    tmp = tmp_path_factory.mktemp("stream-interval")
    srv = start_nats(tmp / "nats", port=None)
    url, logs = srv.url, tmp / "logs"
    env = dict(os.environ, SPLITSERVE_MOCK_STEP_MS="5")
    procs = [spawn_service("splitserve.services.router", "--disagg-threshold", "1000000000", nats_url=url,
                           worker_id="router-si", log_dir=logs),
             spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp", nats_url=url,
                           worker_id="decode-si1", log_dir=logs, env=env),
             spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp",
                           "--stream-interval", "4", nats_url=url, worker_id="decode-si4", log_dir=logs, env=env)]
    try:
        asyncio.run(wait_ready(url, ["router-si", "decode-si1", "decode-si4"], timeout=180))
        yield url
    finally:
        stop(*procs)
        srv.stop()


async def _stream(url: str, n: int, **kw: object) -> list[tuple[list[Delta], Result]]:
    """n requests, one at a time (roundrobin alternates the decoders): each one's deltas and result."""
    out = []
    async with Client(url, tenant="si", idle_timeout=60) as c:
        for _ in range(n):
            gen = c.generate(PROMPT, **kw)
            deltas = [d async for d in gen]
            assert gen.result is not None
            out.append((deltas, gen.result))
    return out


def _by_decoder(runs: list[tuple[list[Delta], Result]]) -> dict[str, list[tuple[list[Delta], Result]]]:
    got: dict[str, list[tuple[list[Delta], Result]]] = {}
    for deltas, res in runs:
        got.setdefault(res.decode_worker or "", []).append((deltas, res))
    assert set(got) == {"decode-si1", "decode-si4"}, set(got)
    return got


def test_n_tokens_per_delta_and_every_token_once(decoders: str) -> None:
    runs = _by_decoder(asyncio.run(_stream(decoders, 4, max_tokens=18, ignore_eos=True, logprobs=2, seed=7,
                                           temperature=0.8)))
    for wid, want in (("decode-si1", [1] * 18), ("decode-si4", [1, 4, 4, 4, 4, 1])):
        for deltas, res in runs[wid]:
            assert res.finish_reason == "length" and len(res.token_ids) == 18
            # Every token once, in order, with its text and its log-probability: as the final has them.
            assert [t for d in deltas for t in d.token_ids] == res.token_ids, wid
            assert "".join(d.text for d in deltas) == res.text, wid
            assert res.logprobs is not None and [lp for d in deltas for lp in d.logprobs or []] == res.logprobs
            # The first token alone (at once), then stream_interval at a time, the rest before the final.
            assert [len(d.token_ids) for d in deltas] == want, (wid, [len(d.token_ids) for d in deltas])
            assert [d.seq for d in deltas] == list(range(len(deltas)))
    # Same seed, same tokens: the interval changes how they travel, not what they are.
    assert runs["decode-si1"][0][1].token_ids == runs["decode-si4"][0][1].token_ids


def test_a_cancelled_request_gets_every_token_generated(decoders: str) -> None:
    """A cancel between two sends: the tokens generated since the last one reach the caller before the
    final (in a delta), not only in the final."""

    async def run() -> list[tuple[list[Delta], Result]]:
        out = []
        async with Client(decoders, tenant="si-cancel", idle_timeout=60) as c:
            for _ in range(2):
                gen = c.generate(PROMPT, max_tokens=2000, ignore_eos=True)
                deltas: list[Delta] = []
                cancelled = False
                async for d in gen:  # on after the cancel: what was sent before it reached the decoder
                    deltas.append(d)
                    if not cancelled and sum(len(x.token_ids) for x in deltas) >= 5:
                        # Between two sends (2.5 steps of 5 ms after one): some tokens are generated and unsent.
                        await asyncio.sleep(0.0125)
                        await gen.cancel()
                        cancelled = True
                assert gen.result is not None
                out.append((deltas, gen.result))
        return out

    runs = _by_decoder(asyncio.run(run()))
    for wid, [(deltas, res)] in runs.items():
        assert res.finish_reason == "cancelled", (wid, res.finish_reason)
        assert 5 <= len(res.token_ids) < 2000, wid
        assert [t for d in deltas for t in d.token_ids] == res.token_ids, wid
        assert "".join(d.text for d in deltas) == res.text, wid


def test_a_sequence_handed_over_with_tokens_unsent_resumes_from_the_last_sent(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A draining decoder hands its streams over between two sends (tokens generated, not sent): the next
    decoder resumes from the last token the caller has, so the caller's tokens are the uninterrupted run's, each
    once, seq numbers unbroken."""
    tmp = tmp_path_factory.mktemp("stream-interval-handover")
    srv = start_nats(tmp / "nats", port=None)
    url, logs = srv.url, tmp / "logs"
    env = dict(os.environ, SPLITSERVE_MOCK_STEP_MS="40")
    common = ("--engine", "mock", "--transport", "tcp", "--stream-interval", "4")
    leaving = spawn_service("splitserve.services.decode", *common, "--drain-timeout-s", "1", nats_url=url,
                            worker_id="decode-h1", log_dir=logs, env=env)
    procs = [spawn_service("splitserve.services.router", "--disagg-threshold", "1000000000", nats_url=url,
                           worker_id="router-h", log_dir=logs), leaving,
             spawn_service("splitserve.services.decode", *common, nats_url=url, worker_id="decode-h2", log_dir=logs,
                           env=env)]

    async def run() -> None:
        await wait_ready(url, ["router-h", "decode-h1", "decode-h2"], timeout=180)
        async with Client(url, tenant="si-h", idle_timeout=60) as c:
            reference = await c.generate(PROMPT, max_tokens=90, temperature=0.9, seed=3).collect()
            # roundrobin: each decoder gets some of the three
            gens = [c.generate(PROMPT, max_tokens=90, temperature=0.9, seed=3) for _ in range(3)]
            its = [g.__aiter__() for g in gens]
            firsts = [[await it.__anext__(), await it.__anext__()] for it in its]  # 1 token, then 4
            await asyncio.sleep(0.05)  # a step past a send: tokens are unsent when the drain's bound ends
            leaving.send_signal(signal.SIGTERM)  # 90 tokens at 40 ms: longer than its 1 s drain bound
            rests = [[d async for d in it] for it in its]
        for g, first, rest in zip(gens, firsts, rests, strict=True):
            res, deltas = g.result, [*first, *rest]
            assert res is not None and res.decode_worker == "decode-h2", res
            assert [d.seq for d in deltas] == list(range(len(deltas)))
            assert [t for d in deltas for t in d.token_ids] == res.token_ids == reference.token_ids
            assert "".join(d.text for d in deltas) == res.text == reference.text

    try:
        asyncio.run(run())
        assert leaving.wait(30) == 0
        handed = [json.loads(ln) for ln in (logs / "decode-h1.log").read_text().splitlines()
                  if '"handed_over"' in ln]
        assert handed and handed[0]["requests"], handed  # some of the three were on it, and moved
    finally:
        stop(*procs)
        srv.stop()
