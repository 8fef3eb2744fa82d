"""End to end through the real CLI: ``splitserve up`` (NATS + router + cache index + prefill + decode, each
its own process, real model, real KV bytes between processes) and ``splitserve generate`` / the client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from splitserve import errors, proto
from splitserve.client import Client
from splitserve.stackproc import StackProc, start_stack
from tests.procs import cancel_mid_stream, heartbeat_of, kill_worker_mid_stream

pytestmark = pytest.mark.slow

SPLITSERVE = str(Path(sys.executable).parent / "splitserve")
# Long enough to cross the threshold below (disaggregated), the same words short go direct.
LONG = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
        "Constantinople. ") * 6 + "Summarise this in one sentence:"
THRESHOLD = "64"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    # No migration: a request whose only decoder dies ends with worker_died (what the death test checks). With
    # migration on, the supervisor's restart of the decoder (a few seconds) may come within the router's wait for
    # a decoder, and the request continue there instead.
    sp = start_stack(Path(tmp_path_factory.mktemp("stack")), "--disagg-threshold", THRESHOLD, "--max-migrations", "0")
    try:
        yield sp
    finally:
        rc = sp.stop()
        assert rc == 0, sp.output


def _generate(
    stack: StackProc, *args: str, timeout: float = 300
) -> tuple[list[dict], subprocess.CompletedProcess[str]]:
    cp = subprocess.run([SPLITSERVE, "generate", "--nats-url", stack.nats_url, "--json", *args],
                        capture_output=True, text=True, timeout=timeout)
    return [json.loads(line) for line in cp.stdout.splitlines() if line.startswith("{")], cp


def _reference_greedy(prompt_ids: list[int], n: int) -> list[int]:
    """Plain transformers greedy generation of the same model: the ground truth for both paths. (From the GGUF's
    converted folder, the one the workers load: tests/engines/test_model_export.py shows it holds the GGUF's
    weights tensor for tensor, and transformers dequantises a GGUF in ~11 CPU-s against 0.1 s for the folder.)"""
    import torch
    from transformers import AutoModelForCausalLM

    from splitserve.engines.hf_export import ensure_hf_folder

    model = AutoModelForCausalLM.from_pretrained(ensure_hf_folder(None), dtype=torch.float32, local_files_only=True)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_chat_answers_paris(stack: StackProc) -> None:
    objs, cp = _generate(stack, "--chat", "What is the capital of France?", "--max-tokens", "24")
    assert cp.returncode == 0, cp.stderr
    final = objs[-1]
    assert final["type"] == "final"
    assert "Paris" in final["text"]
    for key in ("request_id", "route", "prefill_worker", "decode_worker", "token_ids", "text", "finish_reason",
                "usage", "ttft_ms"):
        assert key in final
    assert final["usage"]["prompt_tokens"] > 0 and final["usage"]["completion_tokens"] == len(final["token_ids"])
    deltas = [o for o in objs if o["type"] == "delta"]
    assert "".join(d["text"] for d in deltas) == final["text"]
    assert [d["seq"] for d in deltas] == list(range(len(deltas)))


def test_disaggregated_equals_direct_equals_transformers(stack: StackProc) -> None:
    n = "16"
    d_objs, cp = _generate(stack, LONG, "--max-tokens", n)
    assert cp.returncode == 0, cp.stderr
    disagg = d_objs[-1]
    assert disagg["route"] == "disaggregated"
    assert disagg["prefill_worker"] == "prefill-0"
    assert disagg["decode_worker"] == "decode-0"
    # The same prompt forced down the direct path (decoder prefills locally).
    async def direct() -> dict:
        async with Client(stack.nats_url) as c:
            r = await c.complete(LONG, max_tokens=int(n), route="direct")
            return r.to_dict()
    direct_res = asyncio.run(direct())
    assert direct_res["route"] == "direct" and direct_res["prefill_worker"] is None
    assert disagg["token_ids"] == direct_res["token_ids"]
    from splitserve.services.router.tokenize import PromptTokenizer

    ids = PromptTokenizer(None).token_ids(proto.GenerateRequest(request_id="x", tenant="t",
                                                                prompt=LONG))
    assert disagg["usage"]["prompt_tokens"] == len(ids)
    assert disagg["token_ids"] == _reference_greedy(ids, int(n))[: len(disagg["token_ids"])]


def test_seeded_sampling_is_reproducible_across_paths(stack: StackProc) -> None:
    async def run(route: str) -> list[int]:
        async with Client(stack.nats_url) as c:
            r = await c.complete(LONG, max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, route=route)
            return r.token_ids
    a = asyncio.run(run("disaggregated"))
    b = asyncio.run(run("direct"))
    assert a == b


def test_stop_string_and_length(stack: StackProc) -> None:
    objs, cp = _generate(stack, "--chat", "Count from 1 to 20 separated by commas.", "--max-tokens", "40",
                         "--stop", "5")
    assert cp.returncode == 0, cp.stderr
    final = objs[-1]
    assert final["finish_reason"] == "stop" and "5" not in final["text"]
    objs, _ = _generate(stack, "Once upon a time", "--max-tokens", "3")
    assert objs[-1]["finish_reason"] == "length" and len(objs[-1]["token_ids"]) == 3


def test_prompt_too_long_is_a_clear_error(stack: StackProc) -> None:
    objs, cp = _generate(stack, "hello " * 9000, "--max-tokens", "2")
    assert cp.returncode == 1  # a runtime failure (2 is for usage errors)
    assert objs[-1]["type"] == "error" and objs[-1]["code"] == "prompt_too_long"
    assert "tokens" in objs[-1]["message"]


def test_concurrent_requests_all_complete(stack: StackProc) -> None:
    async def go() -> list[str]:
        async with Client(stack.nats_url) as c:
            rs = await asyncio.gather(*[c.complete(f"Tell me a fact about the number {i}.", chat=True,
                                                   max_tokens=8) for i in range(4)])
            return [r.finish_reason for r in rs]
    assert all(r in ("stop", "length") for r in asyncio.run(go()))


def test_malformed_job_to_worker_is_dropped_and_worker_survives(stack: StackProc) -> None:
    async def go() -> None:
        nc = await nats.connect(stack.nats_url)
        await nc.publish("ss.decode.decode-0.job", b"{not json")
        await nc.publish("ss.prefill.prefill-0.job", b'{"v": 7}')
        resp = await nc.request("ss.decode.decode-0.reserve", b'{"v": 1, "kind": "kv_reserve_request"}', timeout=5)
        err = proto.decode(resp.data, proto.StreamError)
        assert err.code == proto.ErrorCode.BAD_REQUEST
        await nc.close()
    asyncio.run(go())
    objs, cp = _generate(stack, "Hello", "--max-tokens", "2")
    assert cp.returncode == 0, cp.stderr
    assert '"bad_message"' in stack.logs("decode-0")


def _decoder_idle(stack: StackProc, timeout: float = 20.0) -> bool:
    async def go() -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hb = await heartbeat_of(stack.nats_url, "decode-0")
            if hb.load.active_seqs == 0 and not hb.active_requests:
                return True
            await asyncio.sleep(0.3)
        return False
    return asyncio.run(go())


def test_cancel_mid_stream_ends_with_cancelled_and_frees_the_decoder(stack: StackProc) -> None:
    res = asyncio.run(cancel_mid_stream(stack.nats_url))
    reason, tokens = res.finish_reason, res.usage.completion_tokens
    assert reason == "cancelled"
    assert 3 <= tokens < 200
    assert _decoder_idle(stack)


def test_abandoned_stream_is_cancelled_server_side(stack: StackProc) -> None:
    async def go() -> None:
        async with Client(stack.nats_url) as c:
            async for d in c.generate("Write a very long story about a castle.", chat=True, max_tokens=2000):
                if d.seq == 2:
                    break  # the caller walks away; the generator's cleanup cancels the request
            await asyncio.sleep(0.5)
    asyncio.run(go())
    assert _decoder_idle(stack)


def test_deadline_expires_mid_stream(stack: StackProc) -> None:
    async def go() -> tuple[str, int]:
        async with Client(stack.nats_url) as c:
            r = await c.complete("Write a very long story about a ship.", chat=True, max_tokens=2000, timeout=2.0)
            return r.finish_reason, r.usage.completion_tokens
    reason, tokens = asyncio.run(go())
    assert reason == "expired"
    assert 0 < tokens < 200
    assert _decoder_idle(stack)


def test_sync_client_streams_completes_and_cancels_on_break(stack: StackProc) -> None:
    from splitserve.client import SyncClient

    with SyncClient(stack.nats_url) as c:
        assert "Paris" in c.complete("What is the capital of France?", chat=True, max_tokens=16).text
        seen = []
        for d in c.generate("Write a very long story about a forest.", chat=True, max_tokens=2000):
            seen.append(d.seq)
            if len(seen) == 3:
                break
    assert seen == [0, 1, 2]
    assert _decoder_idle(stack)


def test_submit_then_result(stack: StackProc) -> None:
    async def go() -> None:
        async with Client(stack.nats_url, tenant="jobs") as c:
            rid = await c.submit("What is the capital of France?", chat=True, max_tokens=16)
            res = await c.result(rid, wait=120)
            assert res is not None and "Paris" in res.text and res.finish_reason in ("stop", "length")
            assert res.usage.completion_tokens == len(res.token_ids)
            assert await c.result("no-such-job") is None
            assert await c.result(rid, tenant="other") is None  # results are kept per tenant
    asyncio.run(go())
    cp = subprocess.run([SPLITSERVE, "submit", "--nats-url", stack.nats_url, "--max-tokens", "4", "Hello"],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    rid = cp.stdout.strip()
    cp = subprocess.run([SPLITSERVE, "result", "--nats-url", stack.nats_url, "--wait", "120", "--json", rid],
                        capture_output=True, text=True, timeout=180)
    assert cp.returncode == 0, cp.stderr
    final = json.loads(cp.stdout)
    assert final["request_id"] == rid and len(final["token_ids"]) == 4
    cp = subprocess.run([SPLITSERVE, "result", "--nats-url", stack.nats_url, "nope"], capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode == 3


def test_a_resent_request_is_reaccepted_not_run_twice(stack: StackProc) -> None:
    async def go() -> list[int]:
        async with Client(stack.nats_url) as c:
            gen = c.generate("Write a short story about a fox.", chat=True, max_tokens=24, request_id="dup-req-1")
            it = gen.__aiter__()
            seqs = [(await it.__anext__()).seq]
            accepted = await c._send(gen.request)  # what a client re-sends after a reconnect
            assert accepted.request_id == "dup-req-1"
            seqs += [d.seq async for d in it]
            assert gen.result is not None and gen.result.usage.completion_tokens == 24
            return seqs
    assert asyncio.run(go()) == list(range(24))
    assert stack.logs("router-0").count('"duplicate_request_reattached"') == 1
    assert stack.logs("decode-0").count('"request_id": "dup-req-1"') >= 1
    # The decoder publishes the final, then its end, then logs "finished": the client may read its result first.
    deadline = time.monotonic() + 15
    while True:
        finished = [ln for ln in stack.logs("decode-0").splitlines() if '"finished"' in ln and "dup-req-1" in ln]
        if finished or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # a second run would have logged by now too
    finished = [ln for ln in stack.logs("decode-0").splitlines() if '"finished"' in ln and "dup-req-1" in ln]
    assert len(finished) == 1  # decoded once


def test_worker_death_mid_request_is_a_terminal_error_then_recovers(stack: StackProc) -> None:
    async def go() -> None:
        async with Client(stack.nats_url, idle_timeout=60) as c:
            _, err = await kill_worker_mid_stream(c, stack.nats_url)
        assert isinstance(err, errors.WorkerDied), err
        assert "decode-0" in err.message
    t0 = time.monotonic()
    asyncio.run(go())
    assert time.monotonic() - t0 < 60
    # The supervisor restarts the decoder; the stack serves again.
    deadline = time.monotonic() + 240
    while True:
        objs, cp = _generate(stack, "Hello", "--max-tokens", "2", timeout=120)
        if cp.returncode == 0:
            break
        assert time.monotonic() < deadline, cp.stderr
        time.sleep(2)
