"""LoRA adapters loaded and unloaded at runtime, as vLLM's API does it (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``), on a closed stack (``up --tenants``; mock engine: this is about the control plane):
only an admin key may do it, every decoder answers, ``/v1/models`` and routing follow, and a tenant can neither
call the endpoints nor reach the workers' ``ss.admin.lora`` subject with its own NATS credentials."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import nats
import pytest

from splitserve import errors
from splitserve.client import Client
from splitserve.stackproc import StackProc, start_stack
from splitserve.tenancy.consolekey import read_console_key

pytestmark = pytest.mark.slow

PW = "tenant-a-password"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    tmp = Path(tmp_path_factory.mktemp("lora-runtime"))
    (tmp / "tenants.yaml").write_text(f"tenants:\n  A:\n    password: {PW}\n    api_keys: [sk-a-1]\n")
    sp = start_stack(tmp / "state", "--engine", "mock", "--transport", "tcp", "--prefill", "0", "--decode", "2",
                     "--frontends", "1", "--max-loras", "1", "--lora-modules", "boot=/adapters/boot",
                     "--tenants", str(tmp / "tenants.yaml"))
    try:
        yield sp
    finally:
        assert sp.stop() == 0, sp.output


async def _listed(http: httpx2.AsyncClient, name: str, present: bool) -> dict[str, str | None]:
    deadline = time.monotonic() + 10  # heartbeats carry the change (every 0.5 s)
    while True:
        data = (await http.get("/v1/models", headers={"Authorization": "Bearer sk-a-1"})).json()["data"]
        cards = {m["id"]: m["parent"] for m in data}
        if (name in cards) == present or time.monotonic() > deadline:
            return cards
        await asyncio.sleep(0.2)


async def test_an_operator_loads_and_unloads_an_adapter_at_runtime(stack: StackProc) -> None:
    admin = {"Authorization": f"Bearer {read_console_key(stack.state_dir)}"}
    body = {"lora_name": "rt-sql", "lora_path": "/adapters/rt-sql"}
    async with httpx2.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 401
        tenant = await http.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer sk-a-1"})
        assert tenant.status_code == 403  # a tenant's API key is no operator's
        r = await http.post("/v1/load_lora_adapter", json=body, headers=admin)
        assert r.status_code == 200, r.text
        assert [(w["worker"], w["ok"]) for w in r.json()["workers"]] == [("decode-0", True), ("decode-1", True)]
        cards = await _listed(http, "rt-sql", True)
        assert cards["rt-sql"] == cards["boot"] and cards["rt-sql"] is not None  # listed, with its parent
        chat = await http.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-a-1"},
                               json={"model": "rt-sql", "messages": MESSAGES, "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["model"] == "rt-sql"
        again = await http.post("/v1/load_lora_adapter", json={**body, "lora_path": "/elsewhere"}, headers=admin)
        assert again.status_code == 400 and "another path" in again.text  # a name is one adapter
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "rt-sql"}, headers=admin)
        assert r.status_code == 200, r.text
        cards = await _listed(http, "rt-sql", False)
        assert "rt-sql" not in cards and "boot" in cards
        gone = await http.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-a-1"},
                               json={"model": "rt-sql", "messages": MESSAGES, "max_tokens": 4})
        assert gone.status_code == 404
        missing = await http.post("/v1/unload_lora_adapter", json={"lora_name": "never"}, headers=admin)
        assert missing.status_code == 400 and "not served" in missing.text


async def test_on_demand_slots_serve_every_adapter_one_at_a_time(stack: StackProc) -> None:
    """--max-loras 1, two decoders, three adapters: each request loads its adapter where it runs (the least
    recently used one is unloaded to make room); nothing is refused."""
    admin = {"Authorization": f"Bearer {read_console_key(stack.state_dir)}"}
    async with httpx2.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        for name in ("other", "third"):
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"/adapters/{name}"},
                                headers=admin)
            assert r.status_code == 200, r.text
            await _listed(http, name, True)
    async with Client(stack.nats_url, user="A", password=PW) as c:
        for name in ("boot", "other", "third") * 2:
            res = await c.complete("hello", model=name, max_tokens=2, ignore_eos=True)
            assert res.usage.completion_tokens == 2
        with pytest.raises(errors.ModelNotFound):
            await c.complete("hello", model="no-such-adapter", max_tokens=2)
    logs = stack.logs("decode-0") + stack.logs("decode-1")
    assert logs.count('"adapter_loaded"') >= 3 and '"adapter_unloaded"' in logs  # loaded on use, LRU out


async def test_a_tenant_cannot_reach_the_workers_admin_subject(stack: StackProc) -> None:
    refused: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        refused.append(exc)

    nc = await nats.connect(stack.nats_url, user="A", password=PW, error_cb=on_error)
    try:
        await nc.publish("ss.admin.lora", b'{"kind":"lora_admin_request","action":"unload","lora_name":"boot"}')
        await nc.flush()
        await asyncio.sleep(0.5)
    finally:
        await nc.close()
    assert any("permissions violation" in str(e).lower() and "ss.admin.lora" in str(e) for e in refused), refused
