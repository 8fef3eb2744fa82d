"""`splitserve k8s`: the Secrets (against a real nats-server: every service user and tenant can log in with
what its Secret holds, and only with that), the queue lanes the autoscaler's triggers name (created on a real
JetStream, usable by a router's own work queue), and the generated ScaledObjects (current with the committed
overlay, PromQL that parses and names series the front door really exports)."""

from __future__ import annotations

import asyncio
import os
import re
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


# --- pools (one prefill and one decode pool per model) ---------------------------------------------------

EXAMPLE_MODELS = K8S / "models.example.yaml"
TWO_MODELS = K8S / "overlays" / "two-models"
TWO_MODELS_ARGS = ("--config", "deploy/k8s/models.example.yaml", "--out", "deploy/k8s/overlays/two-models",
                   "--base", "../cpu-dev", "--tenants", "deploy/k8s/tenants.example.yaml", "-n", "splitserve-dev")


def _deploy_copy(tmp_path: Path) -> Path:
    """A copy of deploy/k8s to generate into (kustomize takes bases only as relative paths)."""
    import shutil

    shutil.copytree(K8S, tmp_path / "deploy" / "k8s")
    return tmp_path


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _example_files(tmp_path: Path, **kw: Any) -> dict[str, str]:
    models = k8s.load_models_file(EXAMPLE_MODELS)
    opts = k8s.PoolsOptions(templates=K8S / "base", namespace="splitserve-dev")
    return k8s.pools_files(models, opts, tenants=load_tenants(EXAMPLE_TENANTS), **kw)


def test_committed_two_models_overlay_is_what_the_command_generates(tmp_path: Path) -> None:
    root = _deploy_copy(tmp_path)
    r = cli("k8s", "pools", *TWO_MODELS_ARGS, cwd=root)
    assert r.returncode == 0, r.stderr
    made = root / "deploy" / "k8s" / "overlays" / "two-models"
    assert sorted(p.name for p in made.iterdir()) == sorted(p.name for p in TWO_MODELS.iterdir())
    for f in sorted(TWO_MODELS.iterdir()):
        assert (made / f.name).read_text() == f.read_text(), (
            f"deploy/k8s/overlays/two-models/{f.name} is stale: regenerate it with "
            f"`splitserve k8s pools {' '.join(TWO_MODELS_ARGS)}`")


def test_pools_one_prefill_and_decode_statefulset_per_model_with_its_args(tmp_path: Path) -> None:
    files = _example_files(tmp_path)
    docs = _docs(files["pools.yaml"])
    models = k8s.load_models_file(EXAMPLE_MODELS)
    assert models.names == ["smollm2", "smollm2/26l"] and models.max_loras == 2
    sts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    assert sorted(sts) == sorted(k8s.pool_name(r, m) for r in ("prefill", "decode") for m in models.names)
    for pool in models.pools:
        slug = k8s.model_slug(pool.name)
        for role in ("prefill", "decode"):
            name = k8s.pool_name(role, pool.name)
            s = sts[name]
            labels = s["spec"]["template"]["metadata"]["labels"]
            assert labels["app.kubernetes.io/name"] == role and labels[k8s.MODEL_LABEL] == slug
            assert s["spec"]["selector"]["matchLabels"][k8s.MODEL_LABEL] == slug
            assert s["spec"]["serviceName"] == name and "replicas" not in s["spec"], "KEDA owns the count"
            assert s["spec"]["template"]["metadata"]["annotations"][k8s.MODEL_NAME_ANNOTATION] == pool.name
            (c,) = [c for c in s["spec"]["template"]["spec"]["containers"] if c["name"] == role]
            args = c["args"]
            assert args.count("--model") == 1 and args[args.index("--model") + 1] == (pool.model or "bundled")
            assert args[args.index("--served-model-name") + 1] == pool.name
            loras = [args[i + 1] for i, a in enumerate(args) if a == "--lora-modules"]
            assert loras == [f"{n}={p}" for n, p in pool.lora_modules]
            assert ("--max-loras" in args) == bool(pool.lora_modules)
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert "/models" in mounts, "the model or its adapters are on the models volume"
        # each pool has its own headless Service and PDB, selecting only its model's pods
        for kind, sel in (("Service", ("spec", "selector")), ("PodDisruptionBudget", ("spec", "selector",
                                                                                    "matchLabels"))):
            for role in ("prefill", "decode"):
                (d,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == k8s.pool_name(role,
                                                                                                      pool.name)]
                got = d
                for key in sel:
                    got = got[key]
                assert got[k8s.MODEL_LABEL] == slug and got["app.kubernetes.io/name"] == role
    drops = _docs(files["drop-single-pool.yaml"])
    assert {(d["kind"], d["metadata"]["name"]) for d in drops} == {
        (k, r) for k in ("Service", "StatefulSet", "PodDisruptionBudget") for r in ("prefill", "decode")}
    assert all(d["$patch"] == "delete" for d in drops)
    # without a tenants file: fixed pools of the config's counts, no ScaledObjects
    fixed = k8s.pools_files(models, k8s.PoolsOptions(templates=K8S / "base"))
    assert "autoscale.yaml" not in fixed and "autoscale.yaml" not in fixed["kustomization.yaml"]
    assert {d["spec"]["replicas"] for d in _docs(fixed["pools.yaml"]) if d["kind"] == "StatefulSet"} == {1}


def test_pools_router_serves_every_model_and_creates_every_models_lanes(tmp_path: Path) -> None:
    (patch,) = _docs(_example_files(tmp_path)["router-models.yaml"])
    pod = patch["spec"]["template"]["spec"]
    (router,) = pod["containers"]
    args = router["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--model"] == [
        "smollm2=bundled", "smollm2/26l=/models/smollm2-26l"], "one NAME=PATH per model, the default first"
    assert "$(SPLITSERVE_MODEL)" not in args and args[:2] == ["--worker-id", "$(POD_NAME)"]
    (lanes,) = pod["initContainers"]
    la = lanes["args"]
    assert [la[i + 1] for i, a in enumerate(la) if a == "--model-name"] == ["smollm2", "smollm2/26l"]
    assert {v["name"] for v in pod["volumes"]} == {"models"}, "the routers load the second model's tokenizer"


def test_pools_router_gets_each_models_own_policy_and_its_cli_takes_it(tmp_path: Path) -> None:
    from tests.deploy.test_k8s_manifests import _cli

    f = tmp_path / "models.yaml"
    f.write_text("models:\n  - {name: chat, strategy: kvaware, disagg_threshold: 64}\n  - {name: code/7b, model: /m}\n")
    (patch,) = _docs(k8s.pools_files(k8s.load_models_file(f), k8s.PoolsOptions(templates=K8S / "base"))[
        "router-models.yaml"])
    args = patch["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a in ("--model-strategy", "--model-disagg-threshold")] == [
        "chat=kvaware", "chat=64"]
    argv = [str(EXAMPLE_TENANTS) if a.endswith("tenants.yaml") else "router-0" if a == "$(POD_NAME)" else
            "1" if a.startswith("$(") else a for a in args]
    argv[argv.index("--strategy") + 1] = "roundrobin"
    ctx = _cli("router").make_context("router", argv, resilient_parsing=False)
    assert ctx.params["model"] == ["chat=bundled", "code/7b=/m"]


def test_pools_scaled_objects_use_only_their_models_lanes_and_workers(tmp_path: Path) -> None:
    files = _example_files(tmp_path)
    cfg = load_tenants(EXAMPLE_TENANTS)
    models = k8s.load_models_file(EXAMPLE_MODELS)
    so = {d["metadata"]["name"]: d for d in _docs(files["autoscale.yaml"])}
    assert sorted(so) == sorted(k8s.pool_name(r, m) for r in ("prefill", "decode") for m in models.names)
    pods = {m: {r: [f"{k8s.pool_name(r, m)}-{i}" for i in (0, 1, 12)] for r in ("prefill", "decode")}
            for m in models.names}
    all_lanes: set[str] = set()
    for model, pool in zip(models.names, proto.model_pools(models.names), strict=True):
        own = {proto.Subjects.queue_consumer(t, k, pool) for t in cfg.tenants for k in range(NUM_CLASSES)}
        all_lanes |= own
        for role in ("prefill", "decode"):
            d = so[k8s.pool_name(role, model)]
            assert d["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                                   "name": k8s.pool_name(role, model)}
            assert d["spec"]["minReplicaCount"] == 1 and d["metadata"]["namespace"] == "splitserve-dev"
            lanes = {t["metadata"]["consumer"] for t in d["spec"]["triggers"] if t["type"] == "nats-jetstream"}
            assert lanes == own, f"{model} {role}: its own lanes only"
            assert all(c.startswith("dispatch_") and c.endswith(tuple(f"_{pool}_p{k}" for k in range(NUM_CLASSES)))
                       for c in lanes)
            queries = [t["metadata"]["query"] for t in d["spec"]["triggers"] if t["type"] == "prometheus"]
            assert queries
            for q in queries:
                for sel in _selectors(promql_parser.parse(q)):
                    labels = {m.name: m.value for m in sel.matchers.matchers}
                    assert labels["namespace"] == "splitserve-dev" and labels["role"] == role
                    for other, by_role in pods.items():
                        for pod in by_role[role]:
                            assert bool(re.fullmatch(labels["worker"], pod)) == (other == model), (q, pod)
    assert len(all_lanes) == len(cfg.tenants) * NUM_CLASSES * 2, "two models: two disjoint sets of lanes"
    # the lanes the routers' init container creates are exactly the ones the triggers name
    assert sorted(n for _, _, n in k8s.queue_consumers(cfg, models.names)) == sorted(all_lanes)


def test_model_slugs_are_dns_safe_distinct_and_stable() -> None:
    names = ["smollm2", "smollm2/26l", "Smollm2", "smollm2-26l", "meta-llama/Llama-3.1-8B-Instruct", "a", "a-1",
             "x" * 256, "x" * 255, "///", "модель", "7b"]
    slugs = [k8s.model_slug(n) for n in names]
    assert slugs[0] == "smollm2" and slugs[3] == "smollm2-26l", "a name that is a slug already is kept"
    assert re.fullmatch(r"smollm2-26l-[0-9a-f]{8}", slugs[1])
    assert len(set(slugs)) == len(slugs)
    assert slugs == [k8s.model_slug(n) for n in names], "deterministic"
    for n in names:
        for role in ("prefill", "decode"):
            name = k8s.pool_name(role, n)
            # a StatefulSet's pods carry controller-revision-hash=<name>-<10>: a 63-character label value
            assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 52, name
    with pytest.raises(ValueError):
        k8s.pool_name("router", "smollm2")


@pytest.mark.parametrize(("text", "expected"), [
    ("models:\n  - {name: a}\n  - {name: a, model: /m}\n", "listed twice"),
    ("models:\n  - {name: a, decode: 0}\n", "decode must be a whole number >= 1"),
    ("models: []\n", "non-empty list"),
    ("decode: 2\n", "models:"),
    ("models:\n  - {name: a, gpus: 8}\n", "unknown key 'gpus'"),
    ("max_loras: -1\nmodels:\n  - {name: a}\n", "max_loras"),
    (f"models:\n  - {{name: a}}\n  - {{name: 'a-{'0' * 8}', decode: 1}}\n  - {{name: A}}\n", None),
])
def test_pools_refuses_a_bad_config_clearly(tmp_path: Path, text: str, expected: str | None) -> None:
    bad = tmp_path / "models.yaml"
    bad.write_text(text)
    if expected is None:  # names that fold together but stay distinct: fine
        assert len({k8s.model_slug(n) for n in k8s.load_models_file(bad).names}) == 3
        return
    with pytest.raises(ValueError, match=expected):
        k8s.load_models_file(bad)


@pytest.mark.slow
def test_pools_cli_refuses_a_bad_config_and_writes_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "models.yaml"
    bad.write_text("models:\n  - {name: a, decode: 0}\n  - {name: b}\n")
    r = cli("k8s", "pools", "--config", str(bad), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "--config" in r.stderr and "decode must be" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_two_models_overlay_builds_validates_and_every_command_parses(
        kubectl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The committed overlay rendered by the real kubectl: every object valid, one PDB per workload, the old
    one-model pools gone, and every container's command line accepted by its service's own CLI."""
    import json

    import jsonschema
    import kubernetes_validate

    from tests.deploy import test_k8s_manifests as manifests
    from tests.deploy.conftest import kustomize

    docs = kustomize(kubectl, TWO_MODELS)
    for d in docs:
        key = (d["apiVersion"], d["kind"])
        if key in manifests.CRD_SCHEMAS:
            jsonschema.validate(d, json.loads(manifests.CRD_SCHEMAS[key].read_text()))
        else:
            kubernetes_validate.validate(d, manifests.K8S_VERSION, strict=True)
        assert d["metadata"]["namespace"] == "splitserve-dev"
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert not {("StatefulSet", "prefill"), ("StatefulSet", "decode"), ("Service", "decode")} & names
    models = k8s.load_models_file(EXAMPLE_MODELS)
    for role in ("prefill", "decode"):
        for m in models.names:
            assert {("StatefulSet", k8s.pool_name(role, m)), ("ScaledObject", k8s.pool_name(role, m))} <= names
    # the base's (cpu-dev's) patches of its pools reach every model's pool: its small sizes
    small = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    for m in models.names:
        (c,) = small[k8s.pool_name("decode", m)]["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["requests"]["memory"] == "2Gi"
    # the manifests tests' own checks, on this render
    manifests.test_every_container_command_parses_with_the_services_own_cli({"two-models": docs}, "two-models",
                                                                           monkeypatch)
    manifests.test_every_container_has_resources_and_every_workload_a_pdb({"two-models": docs}, "two-models")


def test_pools_on_the_gpu_overlay_keep_its_gpus_and_drop_its_one_pool_autoscaler(
        kubectl: str, tmp_path: Path) -> None:
    from tests.deploy.conftest import kustomize

    root = _deploy_copy(tmp_path)
    r = cli("k8s", "pools", "--config", "deploy/k8s/models.example.yaml", "--out", "deploy/k8s/overlays/g",
            "--base", "../gpu-efa", "--tenants", "deploy/k8s/tenants.example.yaml", cwd=root)
    assert r.returncode == 0, r.stderr
    docs = kustomize(kubectl, root / "deploy" / "k8s" / "overlays" / "g")
    gpu = {d["metadata"]["name"]: d for d in kustomize(kubectl, K8S / "overlays" / "gpu-efa")
           if d["kind"] == "StatefulSet"}
    so = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "ScaledObject")
    assert so == sorted(k8s.pool_name(r, m) for r in ("prefill", "decode") for m in ("smollm2", "smollm2/26l"))
    for d in docs:
        if d["kind"] != "StatefulSet" or d["metadata"]["name"] == "nats":
            continue
        role = d["metadata"]["labels"]["app.kubernetes.io/name"]
        mine, theirs = d["spec"]["template"]["spec"], gpu[role]["spec"]["template"]["spec"]
        for key in ("tolerations", "affinity", "terminationGracePeriodSeconds"):
            assert mine[key] == theirs[key], (d["metadata"]["name"], key)
        assert mine["containers"][0]["resources"] == theirs["containers"][0]["resources"]
        assert sorted(v["name"] for v in mine["volumes"]) == sorted(v["name"] for v in theirs["volumes"])
        assert "replicas" not in d["spec"]
