"""The rendered NATS StatefulSet config run for real: three nats-servers from the cpu-dev overlay's nats.conf
(hostnames and ports mapped onto loopback, nothing else changed) with a generated auth block form one
JetStream cluster; `splitserve k8s lanes` creates the queue consumers on it with the router's credentials; and
the monitoring endpoints KEDA's JetStream scaler reads (`/varz` server names, `/jsz` consumer details with
their leader) report them as the scaler expects."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from splitserve import k8s
from splitserve.natsserver import child_preexec, free_port, nats_server_binary
from splitserve.tenancy import natsauth
from splitserve.tenancy.config import load_tenants
from tests.deploy.conftest import EXAMPLE_TENANTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.loads(r.read())


@pytest.fixture
def cluster(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> Iterator[dict[str, Any]]:
    docs = rendered["cpu-dev"]
    conf = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("nats-config"))
    text = conf["data"]["nats.conf"]
    cfg = load_tenants(EXAMPLE_TENANTS)
    auth = natsauth.prepare_stack_auth(tmp_path / "state", cfg)
    secrets = {s["metadata"]["name"]: s["stringData"] for s in k8s.secret_manifests(cfg, auth, "")}
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
        yield {"ports": ports, "secrets": secrets, "tenants": cfg}
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
