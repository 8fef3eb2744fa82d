"""`splitserve k8s`: the Secrets (against a real nats-server: every service user and tenant can log in with
what its Secret holds, and only with that), the queue lanes the autoscaler's triggers name (created on a real
JetStream, usable by a router's own work queue), and the generated ScaledObjects (current with the committed
overlay, PromQL that parses and names series the front door really exports)."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from splitserve import k8s, proto
from splitserve.natsserver import start_nats
from splitserve.obs.metrics import ClusterMetrics
from splitserve.proto import Heartbeat, WorkerLoad
from splitserve.runtime.bus import Bus, NotAuthorized
from splitserve.runtime.workqueue import NUM_CLASSES, WorkQueue
from splitserve.tenancy import natsauth
from splitserve.tenancy.config import TenantsConfig, load_tenants
from tests.deploy.conftest import EXAMPLE_TENANTS, K8S, ROOT


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """The real `splitserve` command in its own process (in-process runs would leave structlog printing to
    the test runner's closed capture stream)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", "from splitserve.cli import app; app(prog_name='splitserve')",
                           *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def secrets_by_name(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["stringData"] for d in docs}


# --- secrets -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_secrets_cli_prints_every_secret_and_keeps_passwords_across_runs(tmp_path: Path) -> None:
    args = ["k8s", "secrets", "--tenants", str(EXAMPLE_TENANTS), "--state-dir", str(tmp_path / "st"), "-n", "ns1"]
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    docs = [d for d in yaml.safe_load_all(first.stdout) if d]
    names = secrets_by_name(docs)
    roles = {k8s.role_secret_name(r) for r in natsauth.SERVICE_ROLES}
    assert set(names) == {k8s.AUTH_SECRET, k8s.TENANTS_SECRET, k8s.FRONTEND_TENANTS_SECRET, *roles,
                          "splitserve-tenant-batch", "splitserve-tenant-search"}
    assert all(d["metadata"]["namespace"] == "ns1" and d["type"] == "Opaque" for d in docs)
    # The services' tenants files: the same tenants and limits, no NATS credentials; API keys for front doors.
    full = load_tenants(EXAMPLE_TENANTS)
    for secret, keys in ((k8s.TENANTS_SECRET, False), (k8s.FRONTEND_TENANTS_SECRET, True)):
        cfg = TenantsConfig.model_validate(yaml.safe_load(names[secret][k8s.TENANTS_KEY]))
        assert cfg.defaults == full.defaults and set(cfg.tenants) == set(full.tenants)
        for name, spec in cfg.tenants.items():
            assert spec.password is None and spec.nkey is None
            assert spec.weight == full.tenants[name].weight
            assert spec.api_keys == (full.tenants[name].api_keys if keys else [])
    search = names["splitserve-tenant-search"]
    assert search["OPENAI_API_KEY"] == "sk-search-example-1"
    assert search["OPENAI_BASE_URL"] == "http://frontend.ns1.svc/v1"
    assert search["SPLITSERVE_NATS_URL"].split(",")[0] == "nats://nats-0.nats.ns1.svc:4222"
    out = tmp_path / "secrets.yaml"
    again = cli(*args, "-o", str(out))
    assert again.returncode == 0 and out.read_text() == first.stdout, "a re-run must not rotate the passwords"
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_secrets_cli_refuses_a_bad_tenants_file(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text("tenants:\n  'a.b': {}\n")
    r = cli("k8s", "secrets", "--tenants", str(bad), "--state-dir", str(tmp_path / "st"))
    assert r.returncode == 2 and "a.b" in r.stderr and "--tenants" in r.stderr
    assert not (tmp_path / "st").exists(), "nothing generated for a file that does not load"


def test_tenant_secret_names_are_valid_and_distinct() -> None:
    names = [k8s.tenant_secret_name(t) for t in ("search", "Search", "search_team", "search-team", "_x", "A_B-9")]
    assert names[0] == "splitserve-tenant-search"
    assert len(set(names)) == len(names)
    import re

    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 253 for n in names)


async def test_secrets_log_in_to_a_real_nats_server_and_nothing_else_does(tmp_path: Path) -> None:
    tenants_file = tmp_path / "t.yaml"
    tenants_file.write_text("tenants:\n  alpha: {}\n  beta:\n    password: 'beta-secret-pw'\n"
                            "  gamma:\n    nkey: UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4\n")
    cfg = load_tenants(tenants_file)
    auth = natsauth.prepare_stack_auth(tmp_path / "st", cfg)
    docs = secrets_by_name(k8s.secret_manifests(cfg, auth, tenants_file.read_text()))
    assert natsauth.ENV_PASSWORD not in docs[k8s.tenant_secret_name("gamma")], "an nkey tenant's seed is its own"
    srv = start_nats(tmp_path / "nats", extra_config=docs[k8s.AUTH_SECRET][k8s.AUTH_KEY])
    try:
        for role in natsauth.SERVICE_ROLES:
            creds = docs[k8s.role_secret_name(role)]
            inbox = None if role == natsauth.ADMIN_ROLE else natsauth.service_inbox(role)
            bus = await Bus.connect(srv.url, role, user=creds["user"], password=creds["password"],
                                    inbox_prefix=inbox)
            try:  # each Secret carries its role's rights: the work queue is the routers' (and the operator's)
                await bus.nc.publish("ss.q.alpha.m-1.p0", b"{}")
                for _ in range(25):
                    await bus.nc.flush()
                    if bus.denied:
                        break
                    await asyncio.sleep(0.02)
                refused = any(d.subject == "ss.q.alpha.m-1.p0" for d in bus.denied)
                assert refused == (role not in ("router", natsauth.ADMIN_ROLE)), (role, bus.denied)
            finally:
                await bus.close()
        for tenant in ("alpha", "beta"):
            creds = docs[k8s.tenant_secret_name(tenant)]
            bus = await Bus.connect(srv.url, tenant, user=creds[natsauth.ENV_USER],
                                    password=creds[natsauth.ENV_PASSWORD],
                                    inbox_prefix=natsauth.tenant_inbox(tenant))
            await bus.close()
        with pytest.raises(NotAuthorized):
            await Bus.connect(srv.url, "x", user="alpha", password=docs[k8s.tenant_secret_name("beta")][
                natsauth.ENV_PASSWORD])
    finally:
        srv.stop()


# --- lanes ---------------------------------------------------------------------------------------------


async def test_lanes_creates_every_consumer_the_triggers_name_and_routers_bind_them(tmp_path: Path) -> None:
    cfg = load_tenants(EXAMPLE_TENANTS)
    auth = natsauth.prepare_stack_auth(tmp_path / "st", cfg)
    srv = start_nats(tmp_path / "nats", extra_config=auth.config)
    user, password = auth.credentials("router")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(natsauth.ENV_USER, user)
            mp.setenv(natsauth.ENV_PASSWORD, password)
            names = await k8s.ensure_lanes(srv.url, cfg, ack_wait_s=30.0, wait_s=10.0)
            again = await k8s.ensure_lanes(srv.url, cfg, ack_wait_s=30.0, wait_s=10.0)  # idempotent
            mp.setenv(natsauth.ENV_PASSWORD, "wrong-password")
            with pytest.raises(NotAuthorized):  # at once, not after wait_s of retries
                await k8s.ensure_lanes(srv.url, cfg, ack_wait_s=30.0, wait_s=60.0)
        assert names == again and len(names) == len(cfg.tenants) * NUM_CLASSES
        triggers = [t["metadata"]["consumer"] for so in k8s.scaled_objects(cfg) for t in so["spec"]["triggers"]
                    if t["type"] == "nats-jetstream"]
        assert sorted(set(triggers)) == sorted(names)
        # a router started afterwards (its own work queue, same ack wait) binds the same consumers
        bus = await Bus.connect(srv.url, "router-0", user=user, password=password,
                                inbox_prefix=natsauth.service_inbox("router"))  # as the router connects
        try:
            wq = WorkQueue(bus, ack_wait_s=30.0)
            await wq.setup()
            pool = proto.SINGLE_POOL  # a router serving one model
            for t in cfg.tenants:  # what a router does on a tenant's first request: no config clash
                for k in range(NUM_CLASSES):
                    await wq.lane(t, k, pool)
            for name in names:
                info = await wq.js.consumer_info("SS_QUEUE", name)
                assert info.config.ack_wait == 30.0 and info.num_pending == 0
        finally:
            await bus.close()
    finally:
        srv.stop()


@pytest.mark.slow
def test_lanes_cli_fails_clearly_without_nats(tmp_path: Path) -> None:
    r = cli("k8s", "lanes", "--tenants", str(EXAMPLE_TENANTS), "--nats-url", "nats://127.0.0.1:1", "--wait-s", "0")
    assert r.returncode == 1 and "lanes: FAILED" in r.stderr


# --- autoscale -----------------------------------------------------------------------------------------


def test_committed_autoscale_yaml_is_what_the_command_generates() -> None:
    r = cli("k8s", "autoscale", "--tenants", "deploy/k8s/tenants.example.yaml")
    assert r.returncode == 0, r.stderr
    committed = (K8S / "overlays" / "gpu-efa" / "autoscale.yaml").read_text()
    assert r.stdout == committed, ("deploy/k8s/overlays/gpu-efa/autoscale.yaml is stale: regenerate it with "
                                   "`splitserve k8s autoscale --tenants deploy/k8s/tenants.example.yaml`")


def test_scaled_objects_target_the_pools_with_queue_and_prometheus_triggers() -> None:
    cfg = load_tenants(EXAMPLE_TENANTS)
    policy = k8s.AutoscalePolicy(inflight_per_decoder=50, decoders_per_prefiller=3.0)
    so = {d["metadata"]["name"]: d for d in k8s.scaled_objects(cfg, policy)}
    assert set(so) == {"prefill", "decode"}
    for pool, d in so.items():
        assert d["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": pool}
        lanes = [t for t in d["spec"]["triggers"] if t["type"] == "nats-jetstream"]
        assert len(lanes) == len(cfg.tenants) * NUM_CLASSES
        assert {t["metadata"]["stream"] for t in lanes} == {"SS_QUEUE"}
        assert {t["metadata"]["lagThreshold"] for t in lanes} == {"50" if pool == "decode" else "150"}
        assert len({t["name"] for t in d["spec"]["triggers"]}) == len(d["spec"]["triggers"])
    kv = [t for t in so["decode"]["spec"]["triggers"] if t["name"] == "kv-occupancy"]
    assert kv[0]["metricType"] == "Value" and kv[0]["metadata"]["threshold"] == "0.75"
    with pytest.raises(ValueError, match="decode"):
        k8s.scaled_objects(cfg, k8s.AutoscalePolicy(decode_min=0))
    r = cli("k8s", "autoscale", "--tenants", str(EXAMPLE_TENANTS), "--kv-occupancy", "1.5")
    assert r.returncode == 2 and "KV occupancy" in r.stderr


def _selectors(expr: Any) -> list[Any]:
    found: list[Any] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
        for attr in ("expr", "lhs", "rhs", "param"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, str | int | float):
                visit(child)

    visit(expr)
    return found


def test_prometheus_queries_parse_and_name_series_the_front_door_exports() -> None:
    metrics = ClusterMetrics()
    metrics.on_heartbeat(Heartbeat(worker_id="decode-0", role="decode", seq=1, load=WorkerLoad(
        active_seqs=3, queued_requests=1, free_blocks=25, total_blocks=100, used_blocks=75)))
    metrics.on_heartbeat(Heartbeat(worker_id="prefill-0", role="prefill", seq=1,
                                   load=WorkerLoad(queued_prefill_tokens=4096)))
    exported = metrics.exposition().decode()
    queries = [t["metadata"]["query"] for so in k8s.scaled_objects(load_tenants(EXAMPLE_TENANTS))
               for t in so["spec"]["triggers"] if t["type"] == "prometheus"]
    assert len(queries) == 3
    for q in queries:
        sels = _selectors(promql_parser.parse(q))
        assert sels, q
        for sel in sels:
            assert f"\n{sel.name}{{" in exported, f"{sel.name} is not exported by the front door"
            labels = {m.name: m.value for m in sel.matchers.matchers}
            assert labels.get("role") in ("decode", "prefill") and labels.get("namespace") == "splitserve"
    # the occupancy the query computes, by hand, from what was exported: 1 - 25/100
    assert 'splitserve_worker_total_kv_blocks{role="decode",worker="decode-0"} 100.0' in exported
    assert not any("namespace" in q for q in (k8s.kv_occupancy_query(""), k8s.prefill_backlog_query("")))
