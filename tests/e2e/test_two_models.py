"""Two real models served at once by one stack (hf engine, ``up --config`` with a ``models:`` list): the bundled
SmolLM2-135M-Instruct with a LoRA adapter, and a second model derived from it (:mod:`splitserve.engines.derive`),
a prefiller and a decoder each. Every request's greedy tokens equal plain transformers' on that request's model
(transformers + peft for the adapter), disaggregated and direct, and run only on its model's workers; the OpenAI
API lists both models and the adapter (with its parent), refuses an unknown one (404, naming the served ones) and
one the tenant's contract leaves out (403); the SDK raises the same errors."""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from splitserve import errors, proto
from splitserve.client import Client
from splitserve.stackproc import StackProc, start_stack, wait_ready
from splitserve.tenancy import natsauth

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DERIVED = REPO / ".models" / "smollm2-26l"  # where `make models` puts them (reused when there)
ADAPTER_DIR = REPO / ".models" / "lora-a"
ADAPTER = "smollm2-lora-a"
BASE, SECOND = "smollm2", "smollm2/26l"  # (a name with '/': its queue lanes' token is derived, not the name)
PW = {"A": "tenant-a-password", "B": "tenant-b-password"}
# Long enough to cross the threshold (disaggregated on auto); the route is forced below anyway.
LONG = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
        "Constantinople. ") * 4 + "Summarise this in one sentence:"
N = 12


@pytest.fixture(scope="module")
def derived() -> Path:
    from splitserve.engines.derive import derive_model

    return derive_model(DERIVED)


@pytest.fixture(scope="module")
def adapter() -> Path:
    from splitserve.engines.lora import make_test_adapter

    return make_test_adapter(ADAPTER_DIR, seed=1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, derived: Path, adapter: Path) -> Iterator[StackProc]:
    tmp = Path(tmp_path_factory.mktemp("two-models"))
    (tmp / "stack.yaml").write_text(
        "engine: hf\ntransport: tcp\nfrontends: 1\ndisagg-threshold: 64\nmodels:\n"
        f"  - {{name: {BASE}, prefill: 1, decode: 1, lora_modules: {{{ADAPTER}: '{adapter}'}}}}\n"
        f"  - {{name: {SECOND}, model: '{derived}', prefill: 1, decode: 1}}\n")
    (tmp / "tenants.yaml").write_text(
        f"tenants:\n  A:\n    password: {PW['A']}\n    api_keys: [sk-a-1]\n    models: [{BASE}]\n"
        f"  B:\n    password: {PW['B']}\n    api_keys: [sk-b-1]\n")
    sp = start_stack(tmp / "state", "--config", str(tmp / "stack.yaml"), "--tenants", str(tmp / "tenants.yaml"),
                     timeout=600)
    try:
        yield sp
    finally:
        rc = sp.stop()
        assert rc == 0, sp.output


@functools.cache  # the bundled model's reference is wanted twice: computed once
def _reference(ref: str | None, n: int, adapter: Path | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of plain transformers on that model's files (None: the bundled model), with
    peft applying ``adapter`` when given."""
    import torch
    from transformers import AutoModelForCausalLM

    from splitserve.engines.hf_export import ensure_hf_folder
    from splitserve.services.router.tokenize import PromptTokenizer

    ids = PromptTokenizer(ref).token_ids(proto.GenerateRequest(request_id="x", tenant="t", prompt=LONG))
    # the bundled GGUF from its converted folder (its weights tensor for tensor: tests/engines/
    # test_model_export.py), not dequantised again here (~11 CPU-s a load)
    model = AutoModelForCausalLM.from_pretrained(ensure_hf_folder(ref), dtype=torch.float32, local_files_only=True)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return ids, out[0, len(ids):].tolist()


async def test_up_lists_its_pools_and_each_worker_announces_its_model(stack: StackProc, derived: Path) -> None:
    text = "\n".join(stack.output)
    assert f"2 model(s): {BASE} (bundled): 1 prefill + 1 decode; {SECOND} ({derived}): 1 prefill + 1 decode" in text
    user, password = natsauth.read_admin_credentials(stack.state_dir)  # a closed stack: the operator reads them
    hbs = await wait_ready(stack.nats_url, ["prefill-0", "decode-0", "prefill-1", "decode-1"], timeout=60,
                           user=user, password=password)
    assert {w: (hb.model, hb.adapters) for w, hb in hbs.items()} == {
        "prefill-0": (BASE, [ADAPTER]), "decode-0": (BASE, [ADAPTER]), "prefill-1": (SECOND, []),
        "decode-1": (SECOND, [])}


async def test_each_request_equals_transformers_on_its_own_model(stack: StackProc, derived: Path) -> None:
    workers = {BASE: ("prefill-0", "decode-0"), SECOND: ("prefill-1", "decode-1")}  # numbered in config order
    got: dict[str, list[int]] = {}
    async with Client(stack.nats_url, user="B", password=PW["B"]) as c:
        for model, ref in ((BASE, None), (SECOND, str(derived))):
            ids, want = await asyncio.to_thread(_reference, ref, N)
            for route in ("disaggregated", "direct"):
                r = await c.complete(LONG, model=model, route=route, max_tokens=N)
                assert r.route == route and r.usage.prompt_tokens == len(ids)
                assert r.token_ids == want[: len(r.token_ids)] and len(r.token_ids) > 2, (model, route)
                assert r.decode_worker == workers[model][1]
                assert r.prefill_worker == (workers[model][0] if route == "disaggregated" else None)
            got[model] = want
    assert got[BASE] != got[SECOND]  # two different models, not one under two names


async def test_an_adapter_request_equals_peft_and_leaves_the_base_model_as_it_was(stack: StackProc,
                                                                                   adapter: Path) -> None:
    ids, want = await asyncio.to_thread(_reference, None, N, adapter)
    _, base = await asyncio.to_thread(_reference, None, N)
    assert want != base  # the adapter changes the output of this prompt
    async with Client(stack.nats_url, user="B", password=PW["B"]) as c:
        for route in ("disaggregated", "direct", "disaggregated"):  # (the last: from the prefix cache)
            lora, plain = await asyncio.gather(c.complete(LONG, model=ADAPTER, route=route, max_tokens=N),
                                               c.complete(LONG, model=BASE, route=route, max_tokens=N))
            assert lora.token_ids == want[: len(lora.token_ids)] and len(lora.token_ids) > 2, route
            assert plain.token_ids == base[: len(plain.token_ids)], route  # decoded beside it, unchanged
            assert lora.decode_worker == "decode-0" and lora.prefill_worker == (
                "prefill-0" if route == "disaggregated" else None)


async def test_the_api_lists_both_and_refuses_unknown_and_forbidden_models(stack: StackProc) -> None:
    async with httpx2.AsyncClient(base_url=stack.http_url, timeout=300) as http:
        b, a = {"Authorization": "Bearer sk-b-1"}, {"Authorization": "Bearer sk-a-1"}
        listed = (await http.get("/v1/models", headers=b)).json()["data"]
        assert {(m["id"], m["parent"]) for m in listed} == {(BASE, None), (SECOND, None), (ADAPTER, BASE)}
        assert all(m["max_model_len"] for m in listed)
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8,
                "temperature": 0}
        ok = await http.post("/v1/chat/completions", headers=b, json={**body, "model": SECOND})
        assert ok.status_code == 200 and ok.json()["model"] == SECOND
        unknown = await http.post("/v1/chat/completions", headers=b, json={**body, "model": "gpt-nope"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert BASE in unknown.json()["error"]["message"] and SECOND in unknown.json()["error"]["message"]
        forbidden = await http.post("/v1/chat/completions", headers=a, json={**body, "model": SECOND, "stream": True})
        assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "model_not_allowed"
        mine = await http.post("/v1/chat/completions", headers=a, json={**body, "model": BASE})
        assert mine.status_code == 200
    async with Client(stack.nats_url, user="A", password=PW["A"]) as c:
        with pytest.raises(errors.ModelNotAllowed, match=SECOND):
            await c.complete("hello", model=SECOND, max_tokens=2)
        with pytest.raises(errors.ModelNotFound, match=BASE):
            await c.complete("hello", model="gpt-nope", max_tokens=2)
        assert (await c.complete("hello", max_tokens=2)).decode_worker == "decode-0"  # none named: the default


async def test_usage_splits_each_tenant_by_model_and_adapter(stack: StackProc) -> None:
    """``splitserve usage --by adapter``: each request counted under its own model and adapter, token for token,
    whichever worker or route served it."""
    async with Client(stack.nats_url, user="B", password=PW["B"]) as c:
        lora = await c.complete(LONG, model=ADAPTER, route="disaggregated", max_tokens=N)
        second = await c.complete(LONG, model=SECOND, route="direct", max_tokens=N)
    exe = str(Path(sys.executable).with_name("splitserve"))

    def usage(by: str) -> list[dict[str, Any]]:
        out = subprocess.run([exe, "usage", "--nats-url", stack.nats_url, "--tenant", "B", "--by", by, "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rows: list[dict[str, Any]] = json.loads(out.stdout)
        return rows

    rows = {(r["model"], r["adapter"]): r for r in usage("adapter")}
    assert set(rows) <= {(BASE, None), (BASE, ADAPTER), (SECOND, None)}, rows  # every one attributed
    assert rows[(BASE, ADAPTER)]["completion_tokens"] >= lora.usage.completion_tokens
    assert rows[(SECOND, None)]["prompt_tokens"] >= second.usage.prompt_tokens
    by_model = {r["model"]: r for r in usage("model")}
    assert by_model[BASE]["requests"] > rows[(BASE, ADAPTER)]["requests"] >= 1  # (earlier base requests too)
    assert by_model[SECOND]["completion_tokens"] == rows[(SECOND, None)]["completion_tokens"]
