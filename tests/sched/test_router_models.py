"""A router serving several models (``--model NAME=PATH``, repeatable): a request is routed only among its
model's workers (prefill and decode), its prefix-cache lookups never hit another model's blocks, each model's
free decode slots are its own, and intake refuses an unknown model (naming the served ones) and a model the
tenant's contract leaves out. With one model, nothing changes: every worker is its worker."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace

from splitserve import proto
from splitserve.cache import batch, hash_token_blocks, stored
from splitserve.services.router.models import ModelTable, parse_model_arg, parse_model_policies
from splitserve.services.router.service import RouterService
from tests.recording_bus import RecordingBus

BS = 16
TOKENS = list(range(1000, 1000 + 40 * BS))
WORKERS = (("da", "decode", "alpha"), ("db", "decode", "beta"), ("dx", "decode", "gamma"),
           ("pa", "prefill", "alpha"), ("pb", "prefill", "beta"))


async def _router(tmp_path: Path, models: list[str] | None = None, tenants: str | None = None,
                  **kw: object) -> tuple[RouterService, RecordingBus]:
    tf = None
    if tenants is not None:
        tf = tmp_path / "tenants.yaml"
        tf.write_text(tenants)
    svc = RouterService("router-m", "nats://127.0.0.1:1", model=models or ["alpha=bundled", "beta=bundled"],
                        strategy="kvaware", disagg_threshold=10_000, max_stall_ms=None, queue=False,
                        tenants_file=str(tf) if tf else None, no_worker_wait_s=0.1, **kw)  # type: ignore[arg-type]
    if tenants is not None:
        svc.models.load_tokenizers()  # (for intake; before the workers are heard: it takes seconds)
    svc.make_policy()
    svc.wq = SimpleNamespace(pending_by_tenant=lambda pool=None: {})  # type: ignore[assignment]  # (--no-queue)
    bus = RecordingBus()
    svc.bus = bus  # type: ignore[assignment]
    for wid, role, model in WORKERS:
        await svc.on_heartbeat(proto.Heartbeat(
            worker_id=wid, role=role, seq=0, pid=1, interval_ms=1000, model=model, max_model_len=2048,
            load=proto.WorkerLoad(free_blocks=1000, total_blocks=1000, max_seqs=4)), None)  # type: ignore[arg-type]
    return svc, bus


def _req(rid: str, model: str | None, tenant: str = "A", route: str = "auto") -> proto.GenerateRequest:
    return proto.GenerateRequest(request_id=rid, tenant=tenant, prompt_token_ids=TOKENS, model=model, route=route,
                                 sampling=proto.SamplingParams(max_tokens=4),
                                 stream_subject=proto.Subjects.stream(tenant, rid))


async def _route(svc: RouterService, bus: RecordingBus, req: proto.GenerateRequest) -> list[object]:
    before = len(bus.published)
    assert await svc._route(req, list(TOKENS), None, trace.INVALID_SPAN) is not None
    return [m for _, m in bus.published[before:] if isinstance(m, (proto.PrefillJob, proto.DecodeJob))]


async def test_a_request_goes_only_to_its_models_workers(tmp_path: Path) -> None:
    svc, bus = await _router(tmp_path)
    for i in range(6):  # round after round: the other model's decoder (and an unserved model's) never
        for model, decoder in (("alpha", "da"), ("beta", "db")):
            (job,) = await _route(svc, bus, _req(f"r{model}{i}", model))
            assert isinstance(job, proto.DecodeJob) and job.decoder_id == decoder
    for model, prefiller, decoder in (("alpha", "pa", "da"), ("beta", "pb", "db")):
        before = len(bus.published)
        (job,) = await _route(svc, bus, _req(f"d{model}", model, route="disaggregated"))
        assert isinstance(job, proto.PrefillJob)  # the prefiller and the KV's decoder serve the same model
        subject = next(s for s, m in bus.published[before:] if m is job)
        assert (subject, job.decode.decoder_id) == (proto.Subjects.prefill_job(prefiller), decoder)


async def test_no_cache_hit_across_models(tmp_path: Path) -> None:
    svc, bus = await _router(tmp_path)
    salts = {m: svc._cache_salt(_req("x", m)) for m in ("alpha", "beta")}
    assert salts["alpha"] != salts["beta"] and all(s.startswith("t:A|m:") for s in salts.values())
    ev = batch("da", 0, ts_ms=0.0, events=[stored(hash_token_blocks(TOKENS, BS, cache_salt=salts["alpha"]),
                                                 block_size=BS)])
    await svc.on_kv_events(proto.decode(proto.encode(ev), proto.KvEventBatch), None)  # type: ignore[arg-type]
    (a,) = await _route(svc, bus, _req("ra", "alpha"))
    (b,) = await _route(svc, bus, _req("rb", "beta"))
    assert isinstance(a, proto.DecodeJob) and isinstance(b, proto.DecodeJob)
    assert a.cache_salt == salts["alpha"] and a.decision["cached_tokens"] > 0
    assert b.cache_salt == salts["beta"] and b.decision["cached_tokens"] == 0


async def test_each_model_has_its_own_free_slots(tmp_path: Path) -> None:
    svc, bus = await _router(tmp_path)
    now = svc.clock()
    alpha, beta = svc.free_slots(now, "alpha"), svc.free_slots(now, "beta")
    assert alpha == beta > 0 and svc.free_slots(now, "gamma") == 0
    for i in range(alpha):
        await _route(svc, bus, _req(f"r{i}", "alpha"))
    assert svc.free_slots(now, "alpha") == 0 and svc.free_slots(now, "beta") == beta  # alpha full, beta not


class _Msg(SimpleNamespace):
    reply = ""
    headers = None


async def _intake(svc: RouterService, bus: RecordingBus, req: proto.GenerateRequest) -> list[object]:
    before = len(bus.published)
    await svc._intake(req, _Msg(), trace.INVALID_SPAN)  # type: ignore[arg-type]
    return [m for _, m in bus.published[before:] if not isinstance(m, proto.Accepted)]


async def test_intake_refuses_an_unknown_model_and_one_the_tenant_may_not_use(tmp_path: Path) -> None:
    svc, bus = await _router(tmp_path, tenants="tenants:\n  A:\n    models: [alpha]\n  B: {}\n")
    (err,) = await _intake(svc, bus, _req("r1", "nope"))
    assert isinstance(err, proto.StreamError) and err.code == proto.ErrorCode.MODEL_NOT_FOUND
    assert "alpha" in err.message and "beta" in err.message and not err.retryable
    (err,) = await _intake(svc, bus, _req("r2", "beta"))
    assert isinstance(err, proto.StreamError) and err.code == proto.ErrorCode.MODEL_NOT_ALLOWED
    (job,) = await _intake(svc, bus, _req("r3", "alpha"))  # allowed: routed to alpha's decoder
    assert isinstance(job, proto.DecodeJob) and job.decoder_id == "da"
    (job,) = await _intake(svc, bus, _req("r4", "beta", tenant="B"))  # no models list: every model
    assert isinstance(job, proto.DecodeJob) and job.decoder_id == "db"
    (job,) = await _intake(svc, bus, _req("r5", None, tenant="B"))  # none named: the first, the default
    assert isinstance(job, proto.DecodeJob) and job.decoder_id == "da"


async def test_one_model_takes_every_worker_and_any_name(tmp_path: Path) -> None:
    svc, bus = await _router(tmp_path, models=["bundled"])
    assert svc.models.single and svc.models.default.name == ModelTable().default.name
    seen = set()
    for i in range(6):
        for job in await _route(svc, bus, _req(f"r{i}", "whatever-the-caller-says")):
            assert isinstance(job, proto.DecodeJob)
            seen.add(job.decoder_id)
    assert seen == {"da", "db", "dx"}
    assert svc._cache_salt(_req("x", None)) == "t:A"  # the salts of a single-model router are as before


@pytest.mark.parametrize(("arg", "want"), [
    (None, (None, None)), ("bundled", (None, None)), ("/m/x", (None, "/m/x")), ("org/m", (None, "org/m")),
    ("a=bundled", ("a", None)), ("chat=/models/x", ("chat", "/models/x")), ("n=org/m", ("n", "org/m")),
])
def test_model_arguments(arg: str | None, want: tuple[str | None, str | None]) -> None:
    assert parse_model_arg(arg) == want


def test_model_names_are_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        ModelTable(["a=bundled", "a=bundled"])
    with pytest.raises(ValueError, match="empty"):
        parse_model_arg("=bundled")


async def test_each_model_routes_by_its_own_strategy_and_threshold(tmp_path: Path) -> None:
    """beta disaggregates from 0 uncached tokens and routes round robin; alpha keeps the router's settings
    (kvaware, 10,000 tokens: the same prompt decodes in place)."""
    svc, bus = await _router(tmp_path, model_policies={"beta": ("roundrobin", 0)})
    (a,) = await _route(svc, bus, _req("ra", "alpha"))
    (b,) = await _route(svc, bus, _req("rb", "beta"))
    assert isinstance(a, proto.DecodeJob) and a.route == proto.Route.DIRECT and a.decision["strategy"] == "kvaware"
    assert isinstance(b, proto.PrefillJob) and b.decode.decision["strategy"] == "roundrobin"
    assert b.decode.route == proto.Route.DISAGGREGATED and b.decode.decision["reason"] != "forced"
    described = svc.policy.describe()
    assert described["strategy"] == "kvaware" and described["models"]["beta"]["disagg"]["min_uncached_tokens"] == 0
    # one prefix index and one pending ledger for both: a worker's load is its load, whichever policy sent work
    assert svc.policy.of("beta").index is svc.policy.of("alpha").index is svc.index
    assert svc.policy.of("beta").pending is svc.policy.of("alpha").pending


@pytest.mark.parametrize(("policies", "message"), [
    ({"gamma": ("kvaware", None)}, "'gamma': model 'gamma' is not served here"),
    ({"beta": ("fastest", None)}, "unknown routing strategy 'fastest'"),
    ({"beta": (None, -1)}, "must be >= 0"),
])
async def test_per_model_settings_are_checked(tmp_path: Path, policies: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await _router(tmp_path, model_policies=policies)


def test_per_model_arguments() -> None:
    got = parse_model_policies(["a=kvaware", "b/2=prefixaware"], ["a=64", "c=0"])
    assert got == {"a": ("kvaware", 64), "b/2": ("prefixaware", None), "c": (None, 0)}
    for bad, message in ((["kvaware"], "NAME=VALUE"), (["a="], "NAME=VALUE")):
        with pytest.raises(ValueError, match=message):
            parse_model_policies(bad, [])
    with pytest.raises(ValueError, match="whole number"):
        parse_model_policies([], ["a=many"])


# --- LoRA adapters: a request's ``model`` may name an adapter a worker has loaded ----------------------------

ADAPTER_WORKERS = (("d1", "decode", "alpha", ["x"]), ("d2", "decode", "alpha", []), ("d3", "decode", "beta", ["y"]),
                   ("p1", "prefill", "alpha", ["x"]), ("p2", "prefill", "alpha", []))


async def _adapter_router(tmp_path: Path, models: list[str] | None = None, workers: tuple[Any, ...] = ADAPTER_WORKERS,
                          **kw: Any) -> tuple[RouterService, RecordingBus]:
    tf = tmp_path / "tenants.yaml"
    tf.write_text("tenants:\n  A: {}\n  C:\n    models: [alpha]\n")
    svc = RouterService("router-l", "nats://127.0.0.1:1", model=models or ["alpha=bundled", "beta=bundled"],
                        strategy="roundrobin", disagg_threshold=10_000, max_stall_ms=None, queue=False,
                        tenants_file=str(tf), no_worker_wait_s=0.1, **kw)
    svc.models.load_tokenizers()
    svc.make_policy()
    svc.wq = SimpleNamespace(pending_by_tenant=lambda pool=None: {})  # type: ignore[assignment]
    bus = RecordingBus()
    svc.bus = bus  # type: ignore[assignment]
    for wid, role, model, adapters, *rest in workers:
        available, active = (rest + [[], 0])[:2] if rest else ([], 0)
        await svc.on_heartbeat(proto.Heartbeat(
            worker_id=wid, role=role, seq=0, pid=1, interval_ms=1000, model=model, max_model_len=2048,
            adapters=adapters, adapters_available=available,
            load=proto.WorkerLoad(max_seqs=16, active_seqs=active)), None)  # type: ignore[arg-type]
    return svc, bus


async def test_an_adapter_request_goes_only_where_the_adapter_is_loaded(tmp_path: Path) -> None:
    svc, bus = await _adapter_router(tmp_path)
    base_salt = svc._cache_salt(_req("s", "alpha"))
    for i in range(4):
        (job,) = await _intake(svc, bus, _req(f"x{i}", "x"))
        assert isinstance(job, proto.DecodeJob) and (job.decoder_id, job.lora) == ("d1", "x")
        assert job.cache_salt != base_salt  # its cached blocks are the adapter's, never the base model's
        (job,) = await _intake(svc, bus, _req(f"y{i}", "y"))
        assert isinstance(job, proto.DecodeJob) and (job.decoder_id, job.lora) == ("d3", "y")
    seen = set()
    for i in range(4):  # the base model runs on every decoder of its model, adapters loaded or not
        (job,) = await _intake(svc, bus, _req(f"a{i}", "alpha"))
        assert isinstance(job, proto.DecodeJob) and job.lora is None
        seen.add(job.decoder_id)
    assert seen == {"d1", "d2"}
    before = len(bus.published)
    await _intake(svc, bus, _req("xd", "x", route="disaggregated"))
    subject, job = next((s, m) for s, m in bus.published[before:] if isinstance(m, proto.PrefillJob))
    assert subject == proto.Subjects.prefill_job("p1") and job.decode.lora == "x"  # the prefiller has it too


async def test_unknown_and_forbidden_adapters_are_refused(tmp_path: Path) -> None:
    svc, bus = await _adapter_router(tmp_path)
    (err,) = await _intake(svc, bus, _req("r1", "z"))
    assert isinstance(err, proto.StreamError) and err.code == proto.ErrorCode.MODEL_NOT_FOUND
    assert all(n in err.message for n in ("alpha", "beta", "x", "y"))
    (err,) = await _intake(svc, bus, _req("r2", "x", tenant="C"))  # C may use alpha, not its adapter x
    assert isinstance(err, proto.StreamError) and err.code == proto.ErrorCode.MODEL_NOT_ALLOWED
    req = _req("r3", "beta")
    req.lora = "x"  # named directly, on a model whose workers do not have it
    (err,) = await _intake(svc, bus, req)
    assert isinstance(err, proto.StreamError) and err.code == proto.ErrorCode.MODEL_NOT_FOUND and "'x'" in err.message


async def test_one_model_routes_an_adapter_name_to_its_adapter(tmp_path: Path) -> None:
    svc, bus = await _adapter_router(tmp_path, models=["bundled"])
    (job,) = await _intake(svc, bus, _req("r1", "x"))
    assert isinstance(job, proto.DecodeJob) and (job.decoder_id, job.lora) == ("d1", "x")
    (job,) = await _intake(svc, bus, _req("r2", "alpha"))  # the name its decoders announce: the one model
    assert isinstance(job, proto.DecodeJob) and job.lora is None
    (err,) = await _intake(svc, bus, _req("r3", "no-such-adapter"))  # a typo is refused, not served by the base
    assert isinstance(err, proto.StreamError) and err.code == proto.ErrorCode.MODEL_NOT_FOUND


async def test_on_demand_adapters_go_where_they_are_loaded_until_that_worker_is_much_busier(tmp_path: Path) -> None:
    """--max-loras: workers list the adapters they may load; a request goes to one with its adapter loaded (no
    load, no eviction) unless that one is much busier; round robin over all that may load it without affinity."""
    workers = (("d1", "decode", "alpha", ["x"], ["x", "y"], 0), ("d2", "decode", "alpha", [], ["x", "y"], 0))
    svc, bus = await _adapter_router(tmp_path, models=["alpha=bundled"], workers=workers)
    for i in range(4):
        (job,) = await _intake(svc, bus, _req(f"x{i}", "x"))
        assert isinstance(job, proto.DecodeJob) and (job.decoder_id, job.lora) == ("d1", "x")
        assert job.decision["detail"]["adapter"] == {"name": "x", "affinity": {"decode": "loaded",
                                                                               "prefill": "load"}}
    (job,) = await _intake(svc, bus, _req("y0", "y"))  # loaded nowhere: available on both, either loads it
    assert isinstance(job, proto.DecodeJob) and job.decision["detail"]["adapter"]["affinity"]["decode"] == "load"
    busy = (("d1", "decode", "alpha", ["x"], ["x", "y"], 12), ("d2", "decode", "alpha", [], ["x", "y"], 0))
    svc, bus = await _adapter_router(tmp_path, models=["alpha=bundled"], workers=busy)
    (job,) = await _intake(svc, bus, _req("xs", "x"))
    assert isinstance(job, proto.DecodeJob) and job.decision["detail"]["adapter"]["affinity"]["decode"] == "spill"
    svc, bus = await _adapter_router(tmp_path, models=["alpha=bundled"], workers=workers, lora_affinity=False)
    seen = set()
    for i in range(4):
        (job,) = await _intake(svc, bus, _req(f"rr{i}", "x"))
        assert isinstance(job, proto.DecodeJob)
        seen.add(job.decoder_id)
    assert seen == {"d1", "d2"}  # without affinity: round robin over every worker that may load it


async def test_a_router_that_just_started_waits_for_the_decoders_to_announce_the_name(tmp_path: Path) -> None:
    """A restarted router hears a request naming what the decoders announce before it has heard them: it waits
    (as it waits for a decoder) instead of refusing the very model the front door names."""
    svc, bus = await _adapter_router(tmp_path, models=["bundled"], workers=())
    svc.no_worker_wait_s = 5.0
    task = asyncio.ensure_future(_intake(svc, bus, _req("early", "alpha")))
    await asyncio.sleep(0.2)
    assert not task.done()
    await svc.on_heartbeat(proto.Heartbeat(worker_id="d1", role="decode", seq=0, pid=1, interval_ms=1000,
                                           model="alpha", max_model_len=2048,
                                           load=proto.WorkerLoad(max_seqs=4)), None)  # type: ignore[arg-type]
    (job,) = await asyncio.wait_for(task, 5)
    assert isinstance(job, proto.DecodeJob) and job.decoder_id == "d1"
