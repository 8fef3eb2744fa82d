"""deploy/k8s rendered by the real kubectl (kustomize) and checked: every object against the Kubernetes schemas
(kubernetes-validate, strict: an unknown field fails) or, for the CRDs, against the minimal schemas in
schemas/; then that the objects carry what the services need (their flags parsed by the services' own CLIs,
ports, probes against the real front door app, env, Secrets, resources, PDBs, the NATS cluster, anti-affinity)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import kubernetes_validate
import pytest
import typer

from splitserve import k8s
from splitserve.natsserver import DEFAULT_MAX_PAYLOAD, nats_server_binary
from splitserve.tenancy import natsauth
from tests.deploy.conftest import EXAMPLE_TENANTS, K8S, OVERLAYS, kustomize

K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests target (EKS standard support)
SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): SCHEMAS / "keda-scaledobject-v1alpha1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): SCHEMAS / "monitoring-podmonitor-v1.json",
}
TENANTS_PATH = "/etc/splitserve/tenants/tenants.yaml"
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
WORKLOADS = ("Deployment", "StatefulSet")


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert name in found, f"no {kind}/{name} in the render (have {sorted(found)})"
    return found[name]


def config(docs: list[dict[str, Any]]) -> dict[str, str]:
    cms = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("splitserve-config")]
    assert len(cms) == 1, [d["metadata"]["name"] for d in cms]
    return dict(cms[0]["data"])


def containers(workload: dict[str, Any], init: bool = True) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*(spec.get("initContainers", []) if init else []), *spec["containers"]]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def env_of(c: dict[str, Any], docs: list[dict[str, Any]]) -> dict[str, Any]:
    """name -> value (a string) or its valueFrom, envFrom ConfigMaps resolved from the render."""
    out: dict[str, Any] = {}
    cms = by_kind(docs, "ConfigMap")
    for src in c.get("envFrom", []):
        name = src["configMapRef"]["name"]
        assert name in cms, f"envFrom names ConfigMap {name}, not in the render"
        out.update(cms[name]["data"])
    for e in c.get("env", []):
        out[e["name"]] = e.get("value", e.get("valueFrom"))
    return out


def expand(args: list[str], env: dict[str, Any], pod_name: str = "pod-0") -> list[str]:
    def sub(m: re.Match[str]) -> str:
        v = env.get(m.group(1))
        assert v is not None, f"$({m.group(1)}) is not defined in the container's environment"
        if isinstance(v, dict):  # a fieldRef: what the kubelet would put there
            return pod_name
        return str(v)

    return [VAR.sub(sub, a) for a in args]


# --- render and schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_every_object_validates(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = rendered[overlay]
    kinds: dict[str, int] = {}
    for d in docs:
        kinds[d["kind"]] = kinds.get(d["kind"], 0) + 1
        key = (d["apiVersion"], d["kind"])
        if key in CRD_SCHEMAS:
            jsonschema.validate(d, json.loads(CRD_SCHEMAS[key].read_text()))
            continue
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']} ({d['apiVersion']}): no schema, neither Kubernetes' "
                        "nor in tests/deploy/schemas: add one")
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {d['kind']}/{d['metadata']['name']}: {'.'.join(map(str, exc.path))}: "
                        f"{exc.message}")
        assert d["metadata"].get("namespace") == ("splitserve-dev" if overlay == "cpu-dev" else "splitserve")
    print(f"{overlay}: {len(docs)} objects {dict(sorted(kinds.items()))}")
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "ConfigMap"} <= set(kinds)


def test_base_renders_on_its_own(kubectl: str) -> None:
    docs = kustomize(kubectl, K8S / "base")
    assert sorted(by_kind(docs, "StatefulSet")) == ["decode", "nats", "prefill"]
    assert sorted(by_kind(docs, "Deployment")) == ["cache-index", "frontend", "router"]


def test_a_crd_schema_refuses_a_typo() -> None:
    """The minimal CRD schemas are strict: a misspelt field or a trigger without its consumer fails."""
    schema = json.loads(CRD_SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")].read_text())
    good = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "decode"},
            "spec": {"scaleTargetRef": {"name": "decode"}, "triggers": [
                {"type": "nats-jetstream", "metadata": {"natsServerMonitoringEndpoint": "nats.x:8222",
                                                        "account": "$G", "stream": "S", "consumer": "c",
                                                        "lagThreshold": "5"}}]}}
    jsonschema.validate(good, schema)
    typo = json.loads(json.dumps(good))
    typo["spec"]["maxReplicas"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, schema)
    missing = json.loads(json.dumps(good))
    del missing["spec"]["triggers"][0]["metadata"]["consumer"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(missing, schema)


# --- what the services need ----------------------------------------------------------------------------


def _cli(module: str) -> Any:
    import importlib

    return typer.main.get_command(importlib.import_module(f"splitserve.services.{module}.__main__").app)


COMMANDS = {("python", "-m", f"splitserve.services.{m}"): m for m in ("router", "prefill", "decode", "cache_index",
                                                                      "frontend")}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_command_parses_with_the_services_own_cli(
        rendered: dict[str, list[dict[str, Any]]], overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each container's command line, $(VAR)s filled in from its environment, is accepted by the entry point
    it runs: a misspelt flag, a missing variable or a bad value fails here, not in the cluster."""
    from splitserve.cli import app as splitserve_app

    docs = rendered[overlay]
    for k in list(config(docs)):  # the process environment must not feed the CLIs' envvar options
        monkeypatch.delenv(k, raising=False)
    seen = set()
    for kind in WORKLOADS:
        for w in by_kind(docs, kind).values():
            for c in containers(w):
                env = env_of(c, docs)
                argv = expand(c.get("args", []), env, pod_name=f"{w['metadata']['name']}-0")
                argv = [str(EXAMPLE_TENANTS) if a == TENANTS_PATH else a for a in argv]
                cmd = tuple(c["command"])
                if cmd[0] == "nats-server":
                    continue  # checked by test_nats_config_is_accepted_by_nats_server
                if cmd[:3] in COMMANDS:
                    cli, name = _cli(COMMANDS[cmd[:3]]), COMMANDS[cmd[:3]]
                elif cmd[0] == "splitserve":
                    cli, name = typer.main.get_command(splitserve_app), "splitserve"
                    argv = [*cmd[1:], *argv]
                else:
                    pytest.fail(f"{w['metadata']['name']}/{c['name']}: unknown command {cmd}")
                try:
                    ctx = cli.make_context(name, list(argv), resilient_parsing=False)
                except Exception as exc:  # click's UsageError / BadParameter
                    pytest.fail(f"{overlay} {w['metadata']['name']}/{c['name']}: {argv}: {exc}")
                if name in ("prefill", "decode", "router", "cache_index", "frontend"):
                    assert ctx.params["worker_id"] == f"{w['metadata']['name']}-0"
                    assert env["SPLITSERVE_NATS_URL"], "the services find NATS through SPLITSERVE_NATS_URL"
                seen.add(name)
    assert seen == {"router", "prefill", "decode", "cache_index", "frontend", "splitserve"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_urls_name_every_server_of_the_statefulset(rendered: dict[str, list[dict[str, Any]]],
                                                        overlay: str) -> None:
    docs = rendered[overlay]
    sts, svc = one(docs, "StatefulSet", "nats"), one(docs, "Service", "nats")
    n = sts["spec"]["replicas"]
    assert n == 3 and sts["spec"]["serviceName"] == "nats" and svc["spec"]["clusterIP"] == "None"
    # TODO(multi-URL): the services take this comma-separated list once Bus.connect splits it (NATS cluster work).
    urls = config(docs)["SPLITSERVE_NATS_URL"].split(",")
    assert urls == [f"nats://nats-{i}.nats:4222" for i in range(n)]
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    cports = {p["name"]: p["containerPort"] for p in containers(sts)[0]["ports"]}
    assert ports == cports == {"client": 4222, "cluster": 6222, "monitor": 8222}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_is_an_r3_ready_jetstream_cluster(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = rendered[overlay]
    sts = one(docs, "StatefulSet", "nats")
    c = containers(sts)[0]
    vct = {t["metadata"]["name"]: t for t in sts["spec"]["volumeClaimTemplates"]}
    assert "data" in vct and vct["data"]["spec"]["resources"]["requests"]["storage"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    conf_cm = one(docs, "ConfigMap", pod_spec(sts)["volumes"][0]["configMap"]["name"])
    conf = conf_cm["data"]["nats.conf"]
    store = re.search(r"store_dir:\s*(\S+)", conf)
    assert store and store.group(1).startswith(mounts["data"] + "/"), "JetStream must store on the volume"
    routes = re.findall(r"nats://(nats-\d+)\.nats:6222", conf)
    assert routes == [f"nats-{i}" for i in range(sts["spec"]["replicas"])]
    assert re.search(r"^\s*jetstream\s*\{", conf, re.M)
    assert f"max_payload: {DEFAULT_MAX_PAYLOAD // (1024 * 1024)}MB" in conf
    assert "server_name: $POD_NAME" in conf and env_of(c, docs)["POD_NAME"] == {
        "fieldRef": {"fieldPath": "metadata.name"}}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["port"] == "monitor" and c[probe]["httpGet"]["path"].startswith("/healthz")
    pdb = one(docs, "PodDisruptionBudget", "nats")
    assert pdb["spec"]["maxUnavailable"] == 1, "R3 keeps a quorum with one server down, not two"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_monitor_is_not_open_to_tenants(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """The monitor port has no authentication and /connz shows every connection's subjects (request ids): the
    NetworkPolicy opens only the client port to everyone, the monitor only to KEDA's and the metrics' namespaces."""
    pol = one(rendered[overlay], "NetworkPolicy", "nats")
    for rule in pol["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        if 8222 in ports:
            sources = rule.get("from", [])
            assert sources, "the monitor port must not be open to every pod"
            assert all(set(src) == {"namespaceSelector"} for src in sources), sources
            names = {src["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for src in sources}
            assert names <= {"keda", "monitoring"}
        if not rule.get("from"):
            assert ports == {4222}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_config_is_accepted_by_nats_server(rendered: dict[str, list[dict[str, Any]]], overlay: str,
                                                example_secrets: list[dict[str, Any]], tmp_path: Path) -> None:
    """The rendered nats.conf with the generated auth block, laid out as the pod mounts them, passes the real
    nats-server's config check (`-t`)."""
    docs = rendered[overlay]
    sts = one(docs, "StatefulSet", "nats")
    c = containers(sts)[0]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod_spec(sts)["volumes"]}
    conf_path = c["command"][c["command"].index("--config") + 1]
    assert conf_path.startswith(mounts["config"] + "/")
    root = tmp_path / "root"
    conf = one(docs, "ConfigMap", vols["config"]["configMap"]["name"])["data"]["nats.conf"]
    auth_secret = {s["metadata"]["name"]: s for s in example_secrets}[vols["auth"]["secret"]["secretName"]]
    for item in vols["auth"]["secret"]["items"]:
        dst = root / mounts["auth"].lstrip("/") / item["path"]
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(auth_secret["stringData"][item["key"]])
    # where the pod keeps its data: point the check at a scratch directory
    conf = conf.replace(mounts["data"] + "/", str(tmp_path / "data") + "/")
    conf = conf.replace("/var/run/nats/", str(tmp_path) + "/")
    dst = root / conf_path.lstrip("/")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(conf)
    proc = subprocess.run([nats_server_binary(), "-t", "-c", str(dst)], capture_output=True, text=True, timeout=30,
                          env={"POD_NAME": "nats-0", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # and a broken include is caught by the same check (the test can fail)
    (root / mounts["auth"].lstrip("/") / "auth.conf").write_text("authorization { users = [ { user: ")
    bad = subprocess.run([nats_server_binary(), "-t", "-c", str(dst)], capture_output=True, text=True, timeout=30,
                         env={"POD_NAME": "nats-0", "PATH": "/usr/bin:/bin"})
    assert bad.returncode != 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_referenced_is_one_splitserve_k8s_secrets_makes(
        rendered: dict[str, list[dict[str, Any]]], overlay: str, example_secrets: list[dict[str, Any]]) -> None:
    made = {s["metadata"]["name"]: set(s["stringData"]) for s in example_secrets}
    role_of = {"router": "router", "prefill": "prefill", "decode": "decode", "cache-index": "cache_index",
               "frontend": "frontend"}
    refs = 0
    for kind in WORKLOADS:
        for w in by_kind(rendered[overlay], kind).values():
            for c in containers(w):
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        refs += 1
                        assert ref["key"] in made.get(ref["name"], set()), f"{w['metadata']['name']}: {ref}"
                        # each service authenticates as its own role
                        assert ref["name"] == f"splitserve-nats-{w['metadata']['name']}"
                        assert w["metadata"]["name"] in role_of
            for v in pod_spec(w).get("volumes", []):
                if "secret" in v:
                    refs += 1
                    keys = {i["key"] for i in v["secret"].get("items", [])} or made[v["secret"]["secretName"]]
                    assert keys <= made.get(v["secret"]["secretName"], set()), v
    assert refs >= 12


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_workload_mounts_only_its_own_secrets(rendered: dict[str, list[dict[str, Any]]], overlay: str,
                                                   example_secrets: list[dict[str, Any]]) -> None:
    """Least privilege: a pod gets its own role's NATS user and nothing else; the tenants file (without NATS
    credentials) only where it is read: limits in the routers, limits and API keys in the front doors."""
    allowed = {"nats": {k8s.AUTH_SECRET},
               "router": {k8s.role_secret_name("router"), k8s.TENANTS_SECRET},
               "frontend": {k8s.role_secret_name("frontend"), k8s.FRONTEND_TENANTS_SECRET},
               "cache-index": {k8s.role_secret_name("cache_index")},
               "prefill": {k8s.role_secret_name("prefill")},
               "decode": {k8s.role_secret_name("decode")}}
    seen: dict[str, set[str]] = {}
    for kind in WORKLOADS:
        for w in by_kind(rendered[overlay], kind).values():
            name = w["metadata"]["name"]
            refs: set[str] = set()
            for c in containers(w):
                refs |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                         if "secretKeyRef" in e.get("valueFrom", {})}
                refs |= {f["secretRef"]["name"] for f in c.get("envFrom", []) if "secretRef" in f}
            spec = pod_spec(w)
            refs |= {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
            refs |= {src["secret"]["name"] for v in spec.get("volumes", [])
                     for src in v.get("projected", {}).get("sources", []) if "secret" in src}
            assert name in allowed, f"{overlay}: a workload this test does not know: {name}"
            assert refs <= allowed[name], f"{overlay}/{name} mounts {sorted(refs - allowed[name])}"
            seen[name] = refs
    assert seen == allowed, "every workload mounts what it needs"
    made = {s["metadata"]["name"]: s["stringData"] for s in example_secrets}
    assert "password:" not in made[k8s.TENANTS_SECRET][k8s.TENANTS_KEY]
    assert "api_keys" not in made[k8s.TENANTS_SECRET][k8s.TENANTS_KEY]
    assert "api_keys" in made[k8s.FRONTEND_TENANTS_SECRET][k8s.TENANTS_KEY]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_resources_and_every_workload_a_pdb(rendered: dict[str, list[dict[str, Any]]],
                                                                overlay: str) -> None:
    docs = rendered[overlay]
    pdbs = by_kind(docs, "PodDisruptionBudget")
    for kind in WORKLOADS:
        for name, w in by_kind(docs, kind).items():
            for c in containers(w):
                r = c.get("resources", {})
                assert {"cpu", "memory"} <= set(r.get("requests", {})), f"{name}/{c['name']}: requests"
                assert "memory" in r.get("limits", {}), f"{name}/{c['name']}: memory limit"
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
            labels = w["spec"]["template"]["metadata"]["labels"]
            covering = [p for p in pdbs.values()
                        if p["spec"]["selector"]["matchLabels"].items() <= labels.items()]
            assert len(covering) == 1, f"{kind}/{name}: PDBs {[p['metadata']['name'] for p in covering]}"
            assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
            assert pod_spec(w)["automountServiceAccountToken"] is False


class _Backend:
    """Just enough of the front door's backend for its probe routes."""

    model_name = "m"
    max_model_len = 128

    def __init__(self, ready: bool) -> None:
        self.ready = ready

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        return self.ready, {"missing": [] if self.ready else ["decode"]}

    def metrics(self) -> bytes:
        return b"splitserve_worker_up 1\n"


@pytest.mark.parametrize("overlay", OVERLAYS)
async def test_front_door_service_ports_and_probes_hit_the_real_app(rendered: dict[str, list[dict[str, Any]]],
                                                                     overlay: str) -> None:
    from splitserve.services.frontend.app import create_app

    docs = rendered[overlay]
    dep, svc = one(docs, "Deployment", "frontend"), one(docs, "Service", "frontend")
    c = containers(dep)[0]
    args = c["args"]
    port = int(args[args.index("--port") + 1])
    assert args[args.index("--host") + 1] == "0.0.0.0"
    cports = {p["name"]: p["containerPort"] for p in c["ports"]}
    mport = int(args[args.index("--metrics-port") + 1])  # /metrics names every tenant: its own port
    assert cports == {"http": port, "metrics": mport} and mport != port
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    from splitserve.services.frontend.app import create_metrics_app

    for ready in (True, False):
        app = create_app(_Backend(ready))  # type: ignore[arg-type]
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as http:
            for probe, want in (("livenessProbe", 200), ("startupProbe", 200),
                                ("readinessProbe", 200 if ready else 503)):
                r = await http.get(c[probe]["httpGet"]["path"])
                assert r.status_code == want, (probe, ready, r.text)
            ann = dep["spec"]["template"]["metadata"]["annotations"]
            assert (await http.get(ann["prometheus.io/path"])).status_code == 404  # not on the API port
            assert ann["prometheus.io/port"] == str(mport)
        metrics_app = create_metrics_app(_Backend(ready), app)  # type: ignore[arg-type]
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=metrics_app), base_url="http://t") as http:
            assert (await http.get(ann["prometheus.io/path"])).status_code == 200


def test_cpu_dev_runs_the_hf_engine_on_small_pools(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["cpu-dev"]
    cfg = config(docs)
    assert cfg["SPLITSERVE_ENGINE"] == "hf" and cfg["SPLITSERVE_MODEL"] == "bundled"
    assert cfg["UCX_TLS"] == "tcp", "NIXL between pods: UCX's shared-memory transports cannot cross pods"
    assert one(docs, "StatefulSet", "prefill")["spec"]["replicas"] == 1
    assert one(docs, "StatefulSet", "decode")["spec"]["replicas"] == 1
    assert one(docs, "StatefulSet", "nats")["spec"]["replicas"] == 3
    for name in ("prefill", "decode"):
        r = containers(one(docs, "StatefulSet", name))[0]["resources"]
        assert "nvidia.com/gpu" not in r["requests"] and int(cfg["SPLITSERVE_THREADS"]) <= int(r["requests"]["cpu"])
    assert not by_kind(docs, "ScaledObject")


def test_gpu_efa_pools_get_gpus_efa_hugepages_and_separate_nodes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["gpu-efa"]
    cfg = config(docs)
    assert cfg["SPLITSERVE_ENGINE"] == "vllm" and cfg["SPLITSERVE_KV_BACKEND"] == "LIBFABRIC"
    assert cfg["SPLITSERVE_KV_CONNECTOR"] in ("nixl", "lmcache") and cfg["FI_PROVIDER"] == "efa"
    tp = int(cfg["SPLITSERVE_VLLM_TP"])
    for name, other in (("prefill", "decode"), ("decode", "prefill")):
        sts = one(docs, "StatefulSet", name)
        spec, c = pod_spec(sts), containers(sts)[0]
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        assert int(req["nvidia.com/gpu"]) == int(lim["nvidia.com/gpu"]) == tp, "one TP group per pod"
        assert int(req["vpc.amazonaws.com/efa"]) >= 1 and req["vpc.amazonaws.com/efa"] == lim["vpc.amazonaws.com/efa"]
        assert req["hugepages-2Mi"] == lim["hugepages-2Mi"], "hugepages: requests must equal limits"
        vols = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        hp = [n for n, v in vols.items() if v.get("emptyDir", {}).get("medium") == "HugePages"]
        assert hp and mounts[hp[0]] == "/dev/hugepages"
        anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert any(t["topologyKey"] == "kubernetes.io/hostname"
                   and t["labelSelector"]["matchLabels"]["app.kubernetes.io/name"] == other for t in anti)
        assert spec["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
        assert {t["key"] for t in spec["tolerations"]} >= {"nvidia.com/gpu"}
        assert "replicas" not in sts["spec"], "KEDA's HPA owns the pool sizes: an apply must not reset them"
        assert name in by_kind(docs, "ScaledObject")
        env = env_of(c, docs)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert mounts["models"] == "/models" and cfg["SPLITSERVE_MODEL"].startswith("/models/")
    router = one(docs, "Deployment", "router")
    assert {m["name"] for m in containers(router, init=False)[0]["volumeMounts"]} >= {"models"}, \
        "the routers tokenize with the served model"
    assert one(docs, "PersistentVolumeClaim", "splitserve-models")
    assert "requiredDuringSchedulingIgnoredDuringExecution" in \
        pod_spec(one(docs, "StatefulSet", "nats"))["affinity"]["podAntiAffinity"]


def test_router_replicas_share_one_queue_and_create_its_lanes_first(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay in OVERLAYS:
        router = one(rendered[overlay], "Deployment", "router")
        assert router["spec"]["replicas"] >= 2
        init = pod_spec(router)["initContainers"]
        assert [c["command"] for c in init] == [["splitserve", "k8s", "lanes"]]
        main = containers(router, init=False)[0]
        wait = lambda c: c["args"][c["args"].index("--queue-ack-wait-s") + 1]  # noqa: E731
        assert wait(init[0]) == wait(main), "the lanes must be created with the routers' ack wait"


def test_no_secret_material_in_the_repository() -> None:
    """Only references: the Secrets themselves come from `splitserve k8s secrets` at deploy time."""
    for path in K8S.rglob("*.yaml"):
        text = path.read_text()
        assert "kind: Secret\n" not in text, path
        assert natsauth.ENV_PASSWORD + "=" not in text, path

