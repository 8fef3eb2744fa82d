"""Per-tenant prefix-cache salts (``TenantsConfig.cache_salt``) and their wiring: the wire fields, the router's
index lookups and the jobs it dispatches, the route explain dry run."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry import trace

from splitserve import proto
from splitserve.cache import batch, hash_token_blocks, stored
from splitserve.services.router import explain as explain_mod
from splitserve.services.router.service import RouterService
from splitserve.tenancy import MAX_REQUEST_CACHE_SALT, TenantsConfig, combine_cache_salt, load_tenants
from tests.recording_bus import RecordingBus

TENANT = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True)
REQUEST_SALT = st.one_of(st.none(), st.text(max_size=MAX_REQUEST_CACHE_SALT))
# what vLLM accepts as a cache_salt (entrypoints/generate/base/protocol.py: validate_cache_salt)
VLLM_SALT = re.compile(r"^[^@/\\\x00]{1,128}$")


def _config(tmp_path: Path) -> TenantsConfig:
    f = tmp_path / "tenants.yaml"
    f.write_text("tenants:\n  A: {}\n  B: {}\n  C:\n    cache_group: support\n  D:\n    cache_group: support\n"
                 "  support: {}\n")
    return load_tenants(f)


def test_each_tenant_has_its_own_salt_by_default(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert cfg.cache_salt("A") == "t:A" and cfg.cache_salt("B") == "t:B"
    assert cfg.cache_salt("A") == cfg.cache_salt("A")  # deterministic: every router and worker agrees
    # without a tenants file, isolation per tenant name still holds
    assert TenantsConfig.open_mode().cache_salt("A") == "t:A" != TenantsConfig.open_mode().cache_salt("B")


def test_a_cache_group_shares_one_salt_and_is_no_tenants_salt(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert cfg.cache_salt("C") == cfg.cache_salt("D") == "g:support"
    assert cfg.cache_salt("support") == "t:support" != cfg.cache_salt("C")  # a tenant named like the group
    assert cfg.cache_group("C") == "support" and cfg.cache_group("A") is None


def test_a_request_salt_refines_the_tenants_salt(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    a1, a2 = cfg.cache_salt("A", "conv-1"), cfg.cache_salt("A", "conv-2")
    assert a1 != a2 and a1 != cfg.cache_salt("A") and a1.startswith("t:A:")
    assert cfg.cache_salt("A", "conv-1") == a1
    assert cfg.cache_salt("B", "conv-1") != a1  # the same request salt in another tenant: another scope
    assert cfg.cache_salt("C", "x") == cfg.cache_salt("D", "x") != cfg.cache_salt("C")  # within the group
    assert cfg.cache_salt("A", "") == cfg.cache_salt("A")  # empty: no salt (as vLLM hashes it)


def test_cache_group_is_validated(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text("tenants:\n  A:\n    cache_group: 'not a token'\n")
    with pytest.raises(ValueError, match="cache_group"):
        load_tenants(f)
    with pytest.raises(ValueError):
        combine_cache_salt("x", "A")


@given(a=TENANT, b=TENANT, ra=REQUEST_SALT, rb=REQUEST_SALT)
def test_no_request_salt_reaches_another_tenants_scope(a: str, b: str, ra: str | None, rb: str | None) -> None:
    """Whatever salts two tenants send, their cache salts differ: a tenant cannot pick another's scope."""
    cfg = TenantsConfig.open_mode()
    sa, sb = cfg.cache_salt(a, ra), cfg.cache_salt(b, rb)
    if a != b:
        assert sa != sb
    else:
        assert (sa == sb) == ((ra or None) == (rb or None) or _same_digest(ra, rb))
    assert VLLM_SALT.match(sa), sa  # usable as vLLM's own cache_salt


@given(tenant=TENANT, group=TENANT, r=REQUEST_SALT)
def test_group_and_tenant_scopes_never_meet(tenant: str, group: str, r: str | None) -> None:
    assert combine_cache_salt("t", tenant, r) != combine_cache_salt("g", group, r)
    assert combine_cache_salt("t", tenant, r).startswith(f"t:{tenant}")


def _same_digest(ra: str | None, rb: str | None) -> bool:
    return bool(ra) and bool(rb) and combine_cache_salt("t", "x", ra) == combine_cache_salt("t", "x", rb)


# ---------------------------------------------------------------------------------------------- the wire


def test_wire_fields_are_bounded_and_v1_compatible() -> None:
    req = proto.GenerateRequest(request_id="r", tenant="A", prompt="hi", cache_salt="s" * 256)
    assert proto.decode(proto.encode(req), proto.GenerateRequest).cache_salt == "s" * 256
    with pytest.raises(ValueError):
        proto.GenerateRequest(request_id="r", tenant="A", prompt="hi", cache_salt="s" * 257)
    job = proto.DecodeJob(request_id="r", tenant="A", prompt_token_ids=[1, 2], sampling=proto.SamplingParams(),
                          route=proto.Route.DIRECT, decoder_id="d", created_ms=0.0, cache_salt="t:A")
    assert proto.decode(proto.encode(job), proto.DecodeJob).cache_salt == "t:A"
    # a job from an older router (no cache_salt) still decodes: unsalted keys, as before
    old = job.model_dump(mode="json")
    del old["cache_salt"]
    assert proto.DecodeJob.model_validate(old).cache_salt is None


# ---------------------------------------------------------------------------------------------- the router


BS = 16
TOKENS = list(range(1000, 1000 + 40 * BS))


async def _router(tmp_path: Path) -> tuple[RouterService, RecordingBus]:
    f = tmp_path / "tenants.yaml"
    f.write_text("tenants:\n  A: {}\n  B: {}\n  C:\n    cache_group: g\n  D:\n    cache_group: g\n")
    svc = RouterService("router-salt", "nats://127.0.0.1:1", strategy="kvaware", disagg_threshold=10_000,
                        tenants_file=str(f))
    svc.make_policy()
    bus = RecordingBus()
    svc.bus = bus  # type: ignore[assignment]
    for wid in ("d0", "d1"):
        await svc.on_heartbeat(proto.Heartbeat(worker_id=wid, role="decode", seq=0, pid=1, interval_ms=1000,
                                               load=proto.WorkerLoad(free_blocks=1000, total_blocks=1000)),
                               None)  # type: ignore[arg-type]
    return svc, bus


async def _stored(svc: RouterService, worker: str, salt: str | None, seq: int) -> None:
    b = batch(worker, seq, ts_ms=0.0, events=[stored(hash_token_blocks(TOKENS, BS, cache_salt=salt), block_size=BS)])
    await svc.on_kv_events(proto.decode(proto.encode(b), proto.KvEventBatch), None)  # type: ignore[arg-type]


async def _route(svc: RouterService, bus: RecordingBus, tenant: str, rid: str,
                 salt: str | None = None) -> proto.DecodeJob:
    req = proto.GenerateRequest(request_id=rid, tenant=tenant, prompt_token_ids=TOKENS, cache_salt=salt,
                                sampling=proto.SamplingParams(max_tokens=4))
    before = len(bus.published)
    assert await svc._route(req, list(TOKENS), None, trace.INVALID_SPAN) is not None
    msg = next(m for _, m in bus.published[before:] if isinstance(m, (proto.PrefillJob, proto.DecodeJob)))
    return msg.decode if isinstance(msg, proto.PrefillJob) else msg


async def test_router_looks_up_and_dispatches_with_the_tenants_salt(tmp_path: Path) -> None:
    svc, bus = await _router(tmp_path)
    await _stored(svc, "d1", svc.tenants.cache_salt("A"), 0)  # d1 holds A's copy of the prompt
    await _stored(svc, "d0", svc.tenants.cache_salt("C"), 0)  # d0 holds the group's copy
    a = await _route(svc, bus, "A", "ra")
    assert a.cache_salt == "t:A" and a.decoder_id == "d1" and a.decision["cached_tokens"] > 0
    b = await _route(svc, bus, "B", "rb")  # the same prompt from B: none of A's blocks count
    assert b.cache_salt == "t:B" and b.decision["cached_tokens"] == 0
    d = await _route(svc, bus, "D", "rd")  # D shares C's group
    assert d.cache_salt == "g:g" and d.decoder_id == "d0" and d.decision["cached_tokens"] > 0
    own = await _route(svc, bus, "A", "ra2", salt="conv-1")  # a request salt: another scope within A
    assert own.cache_salt == svc.tenants.cache_salt("A", "conv-1") and own.decision["cached_tokens"] == 0


async def test_explain_salts_its_lookup(tmp_path: Path) -> None:
    """The dry run looks up the blocks a real request of that tenant would."""
    svc, _ = await _router(tmp_path)
    await _stored(svc, "d1", svc.tenants.cache_salt("A"), 0)
    now = time.monotonic()
    hbs = svc.registry.live("decode", now)
    held = {}
    for tenant in ("A", "B"):
        req = proto.RouteExplainRequest(tenant=tenant, prompt_token_ids=TOKENS, strategies=["kvaware"])
        rep = explain_mod.answer("r", svc.policy.default, req, list(TOKENS), hbs, svc._view, now,
                                 cache_salt=svc.tenants.cache_salt(tenant, req.cache_salt))
        held[tenant] = max(w.cached_blocks for w in rep.workers)
    assert held == {"A": len(TOKENS) // BS, "B": 0}
