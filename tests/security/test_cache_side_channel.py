"""The prefix cache as a side channel between tenants, attacked on a real closed stack.

``splitserve up --tenants FILE --engine mock --strategy kvaware`` (a real nats-server with the generated users,
the real router with its KV index replica, the cache-index service, a prefiller and two decoders). The mock
engine is not a model, but the prefix cache under attack is the real one: the workers' own
:class:`~splitserve.cache.store.PrefixKvStore` (``match`` before a prefill, ``insert`` after), their KV events,
the router's index fed by them, and ``usage.cached_tokens`` reported from the store's matches, exactly as with
the ``hf`` engine.

The attack: tenant B wants to know whether anyone asked prompt P. It sends P itself and reads
``cached_tokens`` (or the TTFT it buys): on the old behaviour (one cache for everyone, unsalted block hashes)
B's request landed on the decoder holding A's KV and reported ~all of P as cached. Now every block is keyed
by the tenant's cache salt, so B sees nothing of A's, while A keeps its own KV-aware hits; tenants in one
``cache_group`` share on purpose; and a request's own ``cache_salt`` splits a tenant's cache further.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from splitserve.client import Client, Result
from splitserve.stackproc import StackProc, start_stack

pytestmark = pytest.mark.slow

PW = {t: f"password-of-tenant-{t.lower()}" for t in ("A", "B", "C", "D")}
# ~1,000 tokens: far above the disaggregation threshold, so a miss goes through the prefiller (whose own
# store is attacked too) and a hit goes direct to the decoder holding it.
SECRET = ("Patient record 4471: the board approved the acquisition of the harbour company for forty million "
          "after the audit found nothing. ") * 40 + "Summarise the record."
SHARED = ("You are the support assistant of the Example company. Answer politely, cite the manual, never "
          "promise refunds, and escalate anything about safety. ") * 40 + "Hello!"
# The KV events of a finished request reach the router's index replica (a heartbeat-free path: ~ms).
SETTLE_S = 1.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    tmp = tmp_path_factory.mktemp("cache-side-channel")
    tenants = tmp / "tenants.yaml"
    tenants.write_text(
        "tenants:\n"
        f"  A:\n    password: {PW['A']}\n"
        f"  B:\n    password: {PW['B']}\n"
        f"  C:\n    password: {PW['C']}\n    cache_group: support-bots\n"
        f"  D:\n    password: {PW['D']}\n    cache_group: support-bots\n"
    )
    sp = start_stack(tmp / "state", "--prefill", "1", "--decode", "2", "--engine", "mock", "--strategy", "kvaware",
                     "--disagg-threshold", "256", "--tenants", str(tenants))
    try:
        yield sp
    finally:
        sp.stop()


async def _ask(url: str, tenant: str, prompt: str, **kw: object) -> Result:
    async with Client(url, user=tenant, password=PW[tenant]) as c:
        res = await c.complete(prompt, max_tokens=4, **kw)
    await asyncio.sleep(SETTLE_S)  # its KV events reach the router's index before the next request is routed
    return res


async def test_cached_prefixes_stay_within_their_tenant(stack: StackProc) -> None:
    url = stack.nats_url
    first = await _ask(url, "A", SECRET)
    again = await _ask(url, "A", SECRET)
    # KV-aware reuse survives within the tenant: the router found A's blocks (the workers' KV events carry
    # A-salted hashes, the router looks up A-salted hashes) and the decoder reused them.
    assert first.usage.cached_tokens == 0
    assert again.decision["cached_tokens"] > 0 and again.decode_worker == first.decode_worker
    assert again.usage.cached_tokens > 0.9 * again.usage.prompt_tokens

    # B sends the very same prompt: nothing of A's is visible, neither to routing nor in any worker's store
    # (the decoders' and the prefiller's: whichever path B's request takes, it computes everything).
    probe = await _ask(url, "B", SECRET)
    assert probe.usage.prompt_tokens == again.usage.prompt_tokens
    assert probe.decision["cached_tokens"] == 0
    assert probe.usage.cached_tokens == 0
    # ... and B's own repeat hits B's own blocks, so isolation did not simply turn caching off.
    assert (await _ask(url, "B", SECRET)).usage.cached_tokens > 0


async def test_a_cache_group_shares_on_purpose(stack: StackProc) -> None:
    url = stack.nats_url
    assert (await _ask(url, "C", SHARED)).usage.cached_tokens == 0
    shared = await _ask(url, "D", SHARED)  # D is in C's cache group: C's prefix is D's too
    assert shared.decision["cached_tokens"] > 0 and shared.usage.cached_tokens > 0.9 * shared.usage.prompt_tokens
    outsider = await _ask(url, "A", SHARED)  # not in the group
    assert outsider.decision["cached_tokens"] == 0 and outsider.usage.cached_tokens == 0


async def test_a_request_salt_splits_the_tenants_cache(stack: StackProc) -> None:
    url = stack.nats_url
    prompt = SECRET + " Use bullet points."
    base = await _ask(url, "A", prompt)
    hit = await _ask(url, "A", prompt)
    assert hit.usage.cached_tokens > 0  # (A's earlier SECRET blocks may count in base: same tenant, no salt)
    salted = await _ask(url, "A", prompt, cache_salt="conversation-1")
    assert salted.decision["cached_tokens"] == 0 and salted.usage.cached_tokens == 0
    again = await _ask(url, "A", prompt, cache_salt="conversation-1")
    assert again.usage.cached_tokens > 0.9 * again.usage.prompt_tokens  # the salt itself is honoured
    other = await _ask(url, "A", prompt, cache_salt="conversation-2")
    assert other.usage.cached_tokens == 0
    # A request salt never reaches another tenant's scope: B naming the salt A used finds nothing of A's.
    stolen = await _ask(url, "B", prompt, cache_salt="conversation-1")
    assert stolen.decision["cached_tokens"] == 0 and stolen.usage.cached_tokens == 0
    assert base.usage.prompt_tokens == stolen.usage.prompt_tokens
