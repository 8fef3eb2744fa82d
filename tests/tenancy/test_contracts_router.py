"""The router's part of contracts, without NATS: the live capacity check from the workers' heartbeats (a decoder
dying over-commits the guarantees, its return fits them again) and the routers' share of a cap."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from splitserve import proto
from splitserve.services.router.service import RouterService


def _hb(wid: str, role: str, *, max_seqs: int | None = None, tps: float | None = None) -> proto.Heartbeat:
    return proto.Heartbeat(worker_id=wid, role=role, seq=1, pid=1,  # type: ignore[arg-type]
                           load=proto.WorkerLoad(max_seqs=max_seqs, prefill_tokens_per_s=tps))


@pytest.fixture
def router(tmp_path: Path) -> RouterService:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  a:\n    contract:\n      decode_slots: {guaranteed: 12}\n"
                       "      prefill_tokens_per_s: {guaranteed: 3000}\n  b: {}\n")
    svc = RouterService("router-c", "nats://127.0.0.1:1", queue=False, tenants_file=str(tenants))
    svc.make_policy()
    return svc


async def test_losing_a_decoder_overcommits_the_guarantees_and_its_return_fits_them(
        router: RouterService, capsys: pytest.CaptureFixture[str]) -> None:
    assert router.contracts_on
    for hb in (_hb("d0", "decode", max_seqs=8), _hb("d1", "decode", max_seqs=8), _hb("p0", "prefill", tps=4000.0)):
        router.registry.observe(hb, time.monotonic())
    router._check_contracts()
    assert router._contract_problems == []
    router.registry.workers.pop("d1")  # d1 died (reaped)
    router._check_contracts()
    assert router._contract_problems == ["guaranteed decode slots sum to 12 (a 12) but the decoders run 8"]
    assert "contracts_overcommitted" in capsys.readouterr().err
    router.registry.observe(_hb("d1", "decode", max_seqs=8), time.monotonic())
    router._check_contracts()
    assert router._contract_problems == []
    assert "contracts_fit" in capsys.readouterr().err


async def test_prefill_capacity_is_judged_only_once_every_prefiller_has_measured(router: RouterService) -> None:
    router.registry.observe(_hb("d0", "decode", max_seqs=16), time.monotonic())
    router.registry.observe(_hb("p0", "prefill", tps=2000.0), time.monotonic())
    router.registry.observe(_hb("p1", "prefill"), time.monotonic())  # not measured yet
    router._check_contracts()
    assert router._contract_problems == []
    router.registry.observe(_hb("p1", "prefill", tps=500.0), time.monotonic())
    router._check_contracts()
    assert router._contract_problems == [
        "guaranteed prefill sums to 3000 tokens/s (a 3000) but the prefillers do 2500"]


def test_the_routers_share_a_cap_by_their_rank(router: RouterService) -> None:
    assert router._router_share() == (0, 1)  # alone (it has not even heard itself yet)
    router.registry.observe(_hb("router-a", "router"), time.monotonic())
    router.registry.observe(_hb("router-z", "router"), time.monotonic())
    assert router._router_share() == (1, 3)
