"""LoRA adapters on demand: the routing rule that prefers a worker with the adapter loaded
(``splitserve.routing.adapters``) and a worker's slots (``services.common.adapters``: load on first use, evict the
least recently used adapter no running sequence holds, wait when every slot is held)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from splitserve.engines import UnknownAdapter
from splitserve.engines.mock import MockEngine
from splitserve.routing import WorkerView
from splitserve.routing.adapters import SPILL_REQUESTS, adapter_candidates, adapter_views
from splitserve.services.common import adapters as slots_mod
from splitserve.services.common.adapters import AdapterBusy, AdapterSlots


def _v(wid: str, load: int = 0) -> WorkerView:
    return WorkerView(worker_id=wid, active_seqs=load)


def test_a_worker_with_the_adapter_loaded_is_preferred_until_it_is_much_busier() -> None:
    views = [_v("a", 3), _v("b", 0), _v("c", 1)]
    kept, why = adapter_candidates(views, {"a"})
    assert [v.worker_id for v in kept] == ["a"] and why == "loaded"  # 3 more requests: still there
    kept, why = adapter_candidates([_v("a", SPILL_REQUESTS + 1), _v("b", 0)], {"a"})
    assert [v.worker_id for v in kept] == ["a", "b"] and why == "spill"  # too busy: another may load it
    kept, why = adapter_candidates(views, set())
    assert len(kept) == 3 and why == "load"  # loaded nowhere: any of them loads it
    kept, why = adapter_candidates([_v("a", 50)], {"a"})
    assert [v.worker_id for v in kept] == ["a"] and why == "loaded"  # no other: the busy one
    views_, why_ = adapter_views([_v("d1"), _v("d2")], [_v("p1")], {"d2"}, affinity=False)
    assert len(views_) == 3 and why_ == {}  # affinity off (round robin over those that can load it)


class _Engine:
    """An engine's adapter calls, as the hf engine answers them: unload refused while a sequence holds it."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.in_use: set[str] = set()
        self.calls: list[str] = []

    def load_lora(self, name: str, path: str) -> None:
        self.calls.append(f"load {name}")
        self.loaded.append(name)

    def unload_lora(self, name: str) -> None:
        if name in self.in_use:
            raise ValueError(f"{name} in use")
        self.calls.append(f"unload {name}")
        self.loaded.remove(name)


async def _run(fn: Any, *args: Any) -> Any:
    return fn(*args)


MODULES = (("a", "/a"), ("b", "/b"), ("c", "/c"))


async def test_adapters_load_on_first_use_and_the_least_recently_used_free_one_goes() -> None:
    eng, slots = _Engine(), AdapterSlots(MODULES, 2, _run)
    await slots.ensure(eng, None)  # the base model: nothing
    await slots.ensure(eng, "a")
    await slots.ensure(eng, "b")
    await slots.ensure(eng, "a")  # a used again: b is now the least recently used
    await slots.ensure(eng, "c")
    assert eng.calls == ["load a", "load b", "unload b", "load c"] and slots.loaded() == ["a", "c"]
    eng.in_use = {"a"}  # a running sequence holds a: c goes instead, though a is older
    await slots.ensure(eng, "b")
    assert eng.calls[-2:] == ["unload c", "load b"] and sorted(slots.loaded()) == ["a", "b"]
    assert slots.loads == 4 and slots.available() == ["a", "b", "c"]
    with pytest.raises(UnknownAdapter, match="not served by this worker"):
        await slots.ensure(eng, "zzz")


async def test_a_load_waits_for_a_slot_and_gives_up_when_none_frees(monkeypatch: pytest.MonkeyPatch) -> None:
    eng, slots = _Engine(), AdapterSlots(MODULES, 1, _run)
    await slots.ensure(eng, "a")
    eng.in_use = {"a"}
    waiting = asyncio.ensure_future(slots.ensure(eng, "b"))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # every slot held: it waits
    eng.in_use = set()  # the sequence ended
    await asyncio.wait_for(waiting, 2)
    assert slots.loaded() == ["b"]
    monkeypatch.setattr(slots_mod, "LOAD_WAIT_S", 0.2)
    eng.in_use = {"b"}
    with pytest.raises(AdapterBusy):
        await slots.ensure(eng, "c")


async def test_without_a_capacity_every_adapter_is_loaded_at_start() -> None:
    eng = MockEngine.load()
    slots = AdapterSlots(MODULES, 0, _run)
    for name, path in MODULES:
        eng.load_lora(name, path)
    slots.started(eng.loras())
    await slots.ensure(eng, "b")
    assert slots.loaded() == ["a", "c", "b"] and slots.loads == 0  # nothing loaded on demand


def test_a_job_is_admitted_only_when_its_adapter_can_be_ready_without_waiting() -> None:
    """The decoder steps its batch on (which frees slots) rather than admit a job that would wait for one."""
    slots = AdapterSlots(MODULES, 2, _run)
    slots.started(["a", "b"])
    assert slots.can_admit(None, {"a", "b"}) and slots.can_admit("a", {"a", "b"})  # base, or loaded already
    assert not slots.can_admit("c", {"a", "b"})  # every slot held by running sequences: not now
    assert slots.can_admit("c", {"a"})  # b is free to evict
    assert slots.can_admit("zzz", {"a", "b"})  # not served here: refused at once, never waits
    assert AdapterSlots(MODULES, 0, _run).can_admit("c", {"a", "b"})  # no capacity: everything loaded at start


class _AsyncEngine(_Engine):
    """The vllm engine's adapter calls: coroutines on the event loop (vLLM's add_lora / remove_lora)."""

    async def load_lora(self, name: str, path: str) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        super().load_lora(name, path)

    async def unload_lora(self, name: str) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        super().unload_lora(name)

    def loras(self) -> list[str]:
        return list(self.loaded)


async def test_vllm_workers_slots_run_the_engines_coroutines_and_answer_the_operator() -> None:
    """A vLLM worker's slots have no capacity (vLLM does the LRU itself): every adapter registered at start is
    loaded; the operator's runtime load and unload go through to the engine's async calls."""
    from types import SimpleNamespace

    from splitserve.proto.admin import LoraAdminReply, LoraAdminRequest
    from splitserve.services.common.adapters import on_lora_admin
    from splitserve.services.common.vllm_worker import run_on_loop

    eng = _AsyncEngine()
    for name, path in MODULES[:2]:
        await eng.load_lora(name, path)
    slots = AdapterSlots(MODULES[:2], 0, run_on_loop)
    slots.started(eng.loras())
    await slots.ensure(eng, "a")
    with pytest.raises(UnknownAdapter):
        await slots.ensure(eng, "c")
    replies: list[LoraAdminReply] = []

    async def respond(_: Any, reply: LoraAdminReply) -> None:
        replies.append(reply)

    svc = SimpleNamespace(model_name="m", adapters=slots, engine=eng, worker_id="decode-0",
                          b=SimpleNamespace(respond=respond))
    await on_lora_admin(svc, LoraAdminRequest(action="load", lora_name="c", lora_path="/c"), None)  # type: ignore[arg-type]
    assert replies[-1].ok and eng.loaded == ["a", "b", "c"] and sorted(replies[-1].adapters) == ["a", "b", "c"]
    eng.in_use.add("a")
    await on_lora_admin(svc, LoraAdminRequest(action="unload", lora_name="a"), None)  # type: ignore[arg-type]
    assert not replies[-1].ok and "in use" in replies[-1].message and "a" in slots.loaded()
    eng.in_use.clear()
    await on_lora_admin(svc, LoraAdminRequest(action="unload", lora_name="a"), None)  # type: ignore[arg-type]
    assert replies[-1].ok and sorted(slots.loaded()) == ["b", "c"] and slots.available() == ["b", "c"]
    assert await run_on_loop(eng.loras) == ["b", "c"]  # a plain function is called as it is
