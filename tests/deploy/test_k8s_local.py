"""The rendered NATS StatefulSet config run for real: three nats-servers from the cpu-dev overlay's nats.conf
(hostnames and ports mapped onto loopback, nothing else changed) with a generated auth block form one
JetStream cluster; `splitserve k8s lanes` creates the queue consumers on it with the router's credentials; and
the monitoring endpoints KEDA's JetStream scaler reads (`/varz` server names, `/jsz` consumer details with
their leader) report them as the scaler expects."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from splitserve import k8s
from splitserve.natsserver import child_preexec, free_port, nats_server_binary
from splitserve.tenancy import natsauth
from splitserve.tenancy.config import load_tenants
from tests.deploy.conftest import EXAMPLE_TENANTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def cluster(rendered: dict[str, list[dict[str, Any]]],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp_path = tmp_path_factory.mktemp("nats-cluster")
    docs = rendered["cpu-dev"]
    conf = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("nats-config"))
    text = conf["data"]["nats.conf"]
    cfg = load_tenants(EXAMPLE_TENANTS)
    auth = natsauth.prepare_stack_auth(tmp_path / "state", cfg)
    secrets = {s["metadata"]["name"]: s["stringData"]
               for s in k8s.secret_manifests(cfg, auth, EXAMPLE_TENANTS.read_text())}
    n = len(re.findall(r"nats://nats-\d+\.nats:6222", text))
    assert n == 3
    ports = [(free_port(), free_port(), free_port()) for _ in range(n)]  # client, cluster, monitor
    procs = []
    for i, (client, route, monitor) in enumerate(ports):
        root = tmp_path / f"nats-{i}"
        (root / "auth").mkdir(parents=True)
        (root / "auth" / "auth.conf").write_text(secrets[k8s.AUTH_SECRET][k8s.AUTH_KEY])
        c = text.replace("listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{client}")
        c = c.replace("http: 0.0.0.0:8222", f"http: 127.0.0.1:{monitor}")
        c = c.replace("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{route}")
        for j, (_, r, _) in enumerate(ports):
            c = c.replace(f"nats://nats-{j}.nats:6222", f"nats://127.0.0.1:{r}")
        c = c.replace("/data/", f"{root}/data/").replace("/var/run/nats/", f"{root}/")
        assert "0.0.0.0" not in c and ".nats:" not in c, "the test's mapping missed part of the config"
        (root / "conf").mkdir()
        (root / "conf" / "nats.conf").write_text(c)
        procs.append(subprocess.Popen([nats_server_binary(), "-c", str(root / "conf" / "nats.conf")],
                                      stdout=open(root / "log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                      env={"POD_NAME": f"nats-{i}"}, preexec_fn=child_preexec))
    try:
        deadline = time.monotonic() + 60
        for i, (_, _, monitor) in enumerate(ports):
            while True:  # JetStream healthy: the cluster formed and elected a meta leader
                try:
                    if get_json(f"http://127.0.0.1:{monitor}/healthz").get("status") == "ok":
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, (tmp_path / f"nats-{i}" / "log").read_text()[-2000:]
                time.sleep(0.2)
        yield {"ports": ports, "secrets": secrets, "tenants": cfg, "auth": auth}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


async def test_rendered_config_forms_a_jetstream_cluster_keda_can_read(cluster: dict[str, Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ports, secrets = cluster["ports"], cluster["secrets"]
    for i, (_, _, monitor) in enumerate(ports):
        varz = get_json(f"http://127.0.0.1:{monitor}/varz")
        assert varz["server_name"] == f"nats-{i}", "KEDA finds a consumer's leader by server name"
        assert varz["max_payload"] == 8 * 1024 * 1024
    jsz = get_json(f"http://127.0.0.1:{ports[0][2]}/jsz")
    assert jsz["meta_cluster"]["cluster_size"] == 3
    # The router's init container, with the router's credentials from its Secret
    creds = secrets[k8s.role_secret_name("router")]
    monkeypatch.setenv(natsauth.ENV_USER, creds["user"])
    monkeypatch.setenv(natsauth.ENV_PASSWORD, creds["password"])
    url = f"nats://127.0.0.1:{ports[1][0]}"  # any server will do
    names = await k8s.ensure_lanes(url, cluster["tenants"], ack_wait_s=30.0, wait_s=20.0)
    # What KEDA's nats-jetstream scaler requests: account $G, consumer details; it keeps the leader's view
    leaders: dict[str, str] = {}
    for i, (_, _, monitor) in enumerate(ports):
        acc = get_json(f"http://127.0.0.1:{monitor}/jsz?acc=$G&consumers=true&config=true")
        for a in acc.get("account_details", []):
            for st in a.get("stream_detail", []):
                if st["name"] != "SS_QUEUE":
                    continue
                for c in st.get("consumer_detail", []):
                    if c.get("cluster", {}).get("leader") == f"nats-{i}":
                        leaders[c["name"]] = f"nats-{i}"
                        assert c["num_pending"] + c["num_ack_pending"] == 0  # KEDA's lag of an idle lane
    assert sorted(leaders) == sorted(names), "every lane the triggers name has a leader reporting it"


# --- the cpu-dev pods as local processes ---------------------------------------------------------------


def pod_processes(docs: list[dict[str, Any]], secrets: dict[str, dict[str, str]], nats_url: str, root: Path,
                  http_port: int, metrics_port: int = 0) -> list[tuple[str, list[str], dict[str, str]]]:
    """Every container of the cpu-dev render (one pod per workload, init containers first) as a local command
    line and environment: the ConfigMap, fieldRefs and Secret references resolved as the kubelet would, the
    mounted files laid out under ``root``. Only what a laptop cannot be is changed: loopback addresses, the
    HTTP port, one NATS URL (the services take one until multi-URL support lands)."""
    cms = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    out = []
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet") or d["metadata"]["name"] == "nats":
            continue
        pod = f"{d['metadata']['name']}-0"
        spec = d["spec"]["template"]["spec"]
        # The tenants file each pod mounts: the Secret its own volume names (routers and front doors differ).
        secret_of = {v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            tenants_file = None
            for m in c.get("volumeMounts", []):
                if m["mountPath"] == "/etc/splitserve/tenants":
                    tenants_file = root / secret_of[m["name"]] / k8s.TENANTS_KEY
                    tenants_file.parent.mkdir(exist_ok=True)
                    tenants_file.write_text(secrets[secret_of[m["name"]]][k8s.TENANTS_KEY])
            env: dict[str, str] = {}
            for src in c.get("envFrom", []):
                env.update(cms[src["configMapRef"]["name"]])
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "fieldRef" in ref:
                    env[e["name"]] = {"metadata.name": pod, "status.podIP": "127.0.0.1"}[ref["fieldRef"]["fieldPath"]]
                elif "secretKeyRef" in ref:
                    env[e["name"]] = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
                else:
                    env[e["name"]] = e["value"]
            home = root / pod
            home.mkdir(exist_ok=True)
            env.update(SPLITSERVE_NATS_URL=nats_url, SPLITSERVE_HOME=str(home), HOME=str(home))
            def var(m: re.Match[str], env: dict[str, str] = env) -> str:
                return env[m.group(1)]

            args = [re.sub(r"\$\((\w+)\)", var, a) for a in c.get("args", [])]
            if "/etc/splitserve/tenants/tenants.yaml" in args:
                assert tenants_file is not None, f"{pod}/{c['name']} names a tenants file it does not mount"
                args = [str(tenants_file) if a == "/etc/splitserve/tenants/tenants.yaml" else a for a in args]
            if "--port" in args:
                args[args.index("--port") + 1] = str(http_port)
                args[args.index("--host") + 1] = "127.0.0.1"
            if "--metrics-port" in args:
                args[args.index("--metrics-port") + 1] = str(metrics_port)
                args[args.index("--metrics-host") + 1] = "127.0.0.1"
            cmd = c["command"]
            if cmd[0] == "python":
                argv = [sys.executable, *cmd[1:], *args]
            else:
                assert cmd[0] == "splitserve", cmd
                argv = [sys.executable, "-c", "from splitserve.cli import app; app()", *cmd[1:], *args]
            base = {k: v for k, v in os.environ.items() if not k.startswith(("SPLITSERVE_", "UCX_"))}
            out.append((f"{pod}/{c['name']}", argv, {**base, **env}))
    return out


def test_cpu_dev_pods_serve_a_tenant_through_the_front_door(cluster: dict[str, Any],
                                                            rendered: dict[str, list[dict[str, Any]]],
                                                            tmp_path: Path) -> None:
    """The cpu-dev overlay's containers, run as local processes exactly as rendered (commands, environment,
    Secrets), on the rendered NATS cluster: the front door turns ready and answers a tenant who uses nothing
    but its own Secret (API key and URL), and refuses an unknown key."""
    secrets = {**cluster["secrets"]}
    port, metrics_port = free_port(), free_port()
    nats_url = f"nats://127.0.0.1:{cluster['ports'][0][0]}"
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for name, argv, env in pod_processes(rendered["cpu-dev"], secrets, nats_url, tmp_path, port, metrics_port):
            log = tmp_path / (name.replace("/", "_") + ".log")
            p = subprocess.Popen(argv, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                 preexec_fn=child_preexec)
            if name.endswith("/queue-lanes"):  # an init container: runs to completion before its pod starts
                assert p.wait(120) == 0, log.read_text()[-2000:]
                continue
            procs.append((name, p, log))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        with httpx2.Client(base_url=base, timeout=5.0) as http:
            while True:
                for name, p, log in procs:
                    assert p.poll() is None, f"{name} exited {p.returncode}: {log.read_text()[-3000:]}"
                try:
                    r = http.get("/readyz")
                    if r.status_code == 200:
                        break
                except httpx2.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the front door never turned ready"
                time.sleep(1.0)
            tenant = secrets[k8s.tenant_secret_name("search")]
            assert tenant["OPENAI_BASE_URL"].endswith("/v1")
            auth = {"Authorization": f"Bearer {tenant['OPENAI_API_KEY']}"}
            models = http.get("/v1/models", headers=auth).json()["data"]
            body = {"model": models[0]["id"], "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": "What is the capital of France?"}]}
            r = http.post("/v1/chat/completions", json=body, timeout=120.0, headers=auth)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["choices"][0]["message"]["content"] and out["usage"]["completion_tokens"] > 0
            bad = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-nobody"})
            assert bad.status_code == 401
            assert http.get("/metrics").status_code == 404  # not on the API port: it names every tenant
            assert http.get(f"http://127.0.0.1:{metrics_port}/metrics").status_code == 200
        ready_logs = {n: log.read_text().count('"ready"') for n, _, log in procs}
        print("ready:", ready_logs)
    finally:
        for _, p, _ in procs:
            p.terminate()
        for _, p, _ in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
