"""``splitserve k8s``: what the Kubernetes deployment (deploy/k8s) needs that kustomize cannot write itself.

- ``secrets``: the Secrets of a deployment with a tenants file: nats-server's ``authorization`` block, one NATS
  user per service role (each with that role's least-privilege permissions, mounted only by that role's pods),
  the tenants file without NATS credentials for the routers (limits) and the front doors (limits and API keys),
  and one Secret per tenant with its credentials. Made by the code behind ``splitserve up --tenants``
  (:mod:`splitserve.tenancy.natsauth`), with the generated passwords kept in a state directory (mode 0600) so
  that a re-run prints the same ones.
- ``autoscale``: KEDA ScaledObjects for the prefill and decode pools. The request queue has one durable
  consumer per (tenant, priority class), so the JetStream triggers are generated from the tenants file; the
  Prometheus triggers read the front door's ``/metrics`` gauges (decoder KV occupancy, decode concurrency,
  prefill backlog). The README's Kubernetes section gives the reasoning.
- ``lanes``: creates those queue consumers before any request arrives (the routers' init container). The
  routers create them lazily, and KEDA's scaler reads a missing consumer's lag as the stream's last sequence
  number, which would scale both pools to their maximum.

The builders (:func:`secret_manifests`, :func:`scaled_objects`) are pure and return plain manifests; the
commands print YAML. Queue names come from the router's own work-queue module, so they cannot drift.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
import yaml

from splitserve.proto.subjects import Subjects
from splitserve.tenancy import natsauth
from splitserve.tenancy.config import TenantsConfig, load_tenants
from splitserve.tenancy.natsauth import StackAuth

app = typer.Typer(no_args_is_help=True, help="Kubernetes: Secrets, KEDA autoscaling and queue setup for deploy/k8s")

PART_OF = "splitserve"
LABELS = {"app.kubernetes.io/part-of": PART_OF}
AUTH_SECRET = "splitserve-nats-auth"
AUTH_KEY = "auth.conf"
TENANTS_SECRET = "splitserve-tenants"  # the routers' tenants file: limits only
FRONTEND_TENANTS_SECRET = "splitserve-tenants-frontend"  # the front doors': limits and API keys
TENANTS_KEY = "tenants.yaml"
# What a tenants file holds that no service needs: the tenants' own NATS credentials (services log in as their
# role). The API keys only the front door needs (it maps a bearer key to its tenant).
_NATS_CREDENTIALS = ("password", "nkey")
TENANT_ANNOTATION = "splitserve.io/tenant"
NATS_REPLICAS = 3  # deploy/k8s/base/nats.yaml
KEDA_API = "keda.sh/v1alpha1"
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")


# ------------------------------------------------------------------------------------------------ secrets


def role_secret_name(role: str) -> str:
    """The Secret holding a service role's NATS user and password (``cache_index`` -> ``...-cache-index``)."""
    natsauth.service_user(role)  # raises on an unknown role
    return f"splitserve-nats-{role.replace('_', '-')}"


def tenant_secret_name(tenant: str) -> str:
    """A tenant's Secret name. Tenant names allow capitals and '_', which object names do not: such a name is
    lowered and dashed, with a hash of the real name appended so that two tenants can never collide."""
    slug = re.sub(r"[^a-z0-9]+", "-", tenant.lower()).strip("-")
    if slug != tenant:
        slug = "-".join(p for p in (slug[:40], hashlib.sha256(tenant.encode()).hexdigest()[:8]) if p)
    return f"splitserve-tenant-{slug}"


def nats_urls(namespace: str, replicas: int = NATS_REPLICAS) -> str:
    """The client URL list of the NATS StatefulSet, fully qualified (for pods in other namespaces)."""
    return ",".join(f"nats://nats-{i}.nats.{namespace}.svc:4222" for i in range(replicas))


def _secret(name: str, namespace: str, data: dict[str, str], *, labels: dict[str, str] | None = None,
            annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {**LABELS, **(labels or {})}}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "stringData": data}


def service_tenants_file(tenants_text: str, *, api_keys: bool) -> str:
    """The tenants file as a service mounts it: without the tenants' NATS passwords and nkeys (no service logs
    in as a tenant), and without the API keys unless ``api_keys`` (the front door's). A pod that leaks its files
    then leaks no tenant's credentials it did not need."""
    data = yaml.safe_load(tenants_text) or {}
    if not isinstance(data, dict):
        raise ValueError("the tenants file is not a mapping")
    drop = _NATS_CREDENTIALS if api_keys else (*_NATS_CREDENTIALS, "api_keys")
    for spec in (data.get("tenants") or {}).values():
        if isinstance(spec, dict):
            for key in drop:
                spec.pop(key, None)
    what = "limits and API keys" if api_keys else "limits"
    text = (f"# The tenants file for splitserve's {'front doors' if api_keys else 'routers'}: {what} only (made by "
            "`splitserve k8s secrets`).\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
    TenantsConfig.model_validate(yaml.safe_load(text) or {})  # still a valid tenants file
    return text


def secret_manifests(tenants: TenantsConfig, auth: StackAuth, tenants_text: str, *,
                     namespace: str = "splitserve") -> list[dict[str, Any]]:
    """Every Secret deploy/k8s refers to, plus one per tenant (what a tenant's own workloads mount). Each
    workload mounts only its own: ``nats`` the auth block, each service its role's user (``admin``'s is for
    the operator, mounted by none), the routers the tenants' limits, the front doors limits and API keys."""
    out = [_secret(AUTH_SECRET, namespace, {AUTH_KEY: auth.config},
                   labels={"app.kubernetes.io/name": "nats"}),
           _secret(TENANTS_SECRET, namespace, {TENANTS_KEY: service_tenants_file(tenants_text, api_keys=False)},
                   labels={"splitserve.io/role": "router"}),
           _secret(FRONTEND_TENANTS_SECRET, namespace,
                   {TENANTS_KEY: service_tenants_file(tenants_text, api_keys=True)},
                   labels={"splitserve.io/role": "frontend"})]
    for role in natsauth.SERVICE_ROLES:
        user, password = auth.credentials(role)
        out.append(_secret(role_secret_name(role), namespace, {"user": user, "password": password},
                           labels={"splitserve.io/role": role.replace("_", "-")}))
    front_door = f"http://frontend.{namespace}.svc/v1"
    for name, spec in sorted(tenants.tenants.items()):
        data = {"SPLITSERVE_TENANT": name, "SPLITSERVE_NATS_URL": nats_urls(namespace)}
        notes = {TENANT_ANNOTATION: name}
        if spec.nkey:
            # The seed stays with the tenant: it mounts it and points SPLITSERVE_NATS_NKEY_SEED at the file.
            notes["splitserve.io/auth"] = f"nkey {spec.nkey}: set SPLITSERVE_NATS_NKEY_SEED to the seed file"
        else:
            tenant_pw = spec.password or auth.generated_tenants.get(name)
            if not tenant_pw:
                raise ValueError(f"tenant {name!r} has no password (and none was generated)")
            data[natsauth.ENV_USER] = name
            data[natsauth.ENV_PASSWORD] = tenant_pw
        if spec.api_keys:
            # What the OpenAI SDK reads: a tenant's pods reach the front door with envFrom and nothing else.
            data["OPENAI_API_KEY"] = spec.api_keys[0]
            data["OPENAI_BASE_URL"] = front_door
        labels = {"splitserve.io/tenant": name} if _LABEL_VALUE.match(name) else {}
        out.append(_secret(tenant_secret_name(name), namespace, data, labels=labels, annotations=notes))
    return out


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (config files inside Secrets) as literal blocks, readable in a diff."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def dump_yaml(docs: Sequence[dict[str, Any]], header: str = "") -> str:
    body = yaml.dump_all(list(docs), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
    return header + body


# ---------------------------------------------------------------------------------------------- autoscale


def queue_consumers(tenants: TenantsConfig, models: list[str] | None = None) -> list[tuple[str, int, str]]:
    """(tenant, class, durable consumer name) of every lane of the request queue (a lane per tenant, served
    model and class; ``models``: the routers' served model names, default the bundled model), in a stable
    order."""
    # The contract's naming, which the routers' work queue uses too.
    from splitserve.proto import Subjects, model_pools

    pools = model_pools(models) if models else [Subjects.SINGLE_POOL]
    return [(t, k, Subjects.queue_consumer(t, k, p)) for t in sorted(tenants.tenants) for p in pools
            for k in range(Subjects.QUEUE_CLASSES)]


def _dedup(metric: str, role: str, matcher: str) -> str:
    # Every front door replica exports the same per-worker series: one value per worker, and only live ones.
    sel = f'{{role="{role}"{", " + matcher if matcher else ""}}}'
    return f"max by (worker) ({metric}{sel})"


def _live(expr: str, role: str, matcher: str) -> str:
    return f"({expr}) and on (worker) ({_dedup('splitserve_worker_up', role, matcher)} == 1)"


def kv_occupancy_query(matcher: str = "") -> str:
    """Mean fraction of the live decoders' KV blocks in use (0..1)."""
    free = _dedup("splitserve_worker_free_kv_blocks", "decode", matcher)
    total = _dedup("splitserve_worker_total_kv_blocks", "decode", matcher)
    return f"avg({_live(f'1 - {free} / ({total} > 0)', 'decode', matcher)})"


def decode_concurrency_query(matcher: str = "") -> str:
    """Sequences running or queued on the live decoders, all tenants together."""
    active = _dedup("splitserve_worker_active_seqs", "decode", matcher)
    queued = _dedup("splitserve_worker_queued_requests", "decode", matcher)
    return f"sum({_live(f'{active} + {queued}', 'decode', matcher)})"


def prefill_backlog_query(matcher: str = "") -> str:
    """Prompt tokens waiting at the live prefillers."""
    return f"sum({_live(_dedup('splitserve_worker_queued_prefill_tokens', 'prefill', matcher), 'prefill', matcher)})"


@dataclass(frozen=True)
class AutoscalePolicy:
    """How the pools scale. Defaults fit the gpu-efa overlay (one TP=8 vLLM worker per node)."""

    namespace: str = "splitserve"
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    prometheus_matcher: str | None = None  # extra label matcher; None: namespace="<namespace>"
    nats_monitor: str | None = None  # host:port of NATS monitoring; None: the headless Service's
    prefill_min: int = 1
    prefill_max: int = 8
    decode_min: int = 2
    decode_max: int = 16
    inflight_per_decoder: int = 96  # requests (queued + running) one decoder should carry
    decoders_per_prefiller: float = 2.0  # the P:D ratio kept when the queue grows (1:2)
    kv_occupancy: float = 0.75  # target mean KV occupancy of the decoders
    prefill_backlog_tokens: int = 16384  # queued prompt tokens per prefiller
    polling_s: int = 15
    scale_down_window_s: int = 600

    def check(self) -> None:
        if not 0 <= self.prefill_min <= self.prefill_max or self.prefill_max < 1:
            raise ValueError("need 0 <= prefill min <= prefill max, and max >= 1")
        if not 1 <= self.decode_min <= self.decode_max:
            raise ValueError("need 1 <= decode min <= decode max (a cluster without decoders serves nothing)")
        if self.inflight_per_decoder < 1 or self.prefill_backlog_tokens < 1:
            raise ValueError("thresholds must be at least 1")
        if self.decoders_per_prefiller <= 0:
            raise ValueError("decoders per prefiller must be > 0")
        if not 0 < self.kv_occupancy <= 1:
            raise ValueError("KV occupancy target must be in (0, 1]")

    @property
    def monitor(self) -> str:
        return self.nats_monitor or f"nats.{self.namespace}.svc.cluster.local:8222"

    @property
    def matcher(self) -> str:
        return f'namespace="{self.namespace}"' if self.prometheus_matcher is None else self.prometheus_matcher


def _lane_triggers(tenants: TenantsConfig, policy: AutoscalePolicy, lag: int,
                   models: list[str] | None = None) -> list[dict[str, Any]]:
    return [{"type": "nats-jetstream", "name": f"queue-{consumer}",
             "metadata": {"natsServerMonitoringEndpoint": policy.monitor, "account": "$G",
                          "stream": Subjects.QUEUE_STREAM, "consumer": consumer, "lagThreshold": str(lag)}}
            for _, _, consumer in queue_consumers(tenants, models)]


def _prometheus(name: str, policy: AutoscalePolicy, query: str, threshold: str,
                metric_type: str | None = None) -> dict[str, Any]:
    trig: dict[str, Any] = {"type": "prometheus", "name": name}
    if metric_type:
        trig["metricType"] = metric_type
    trig["metadata"] = {"serverAddress": policy.prometheus_url, "query": query, "threshold": threshold}
    return trig


def _scaled_object(pool: str, lo: int, hi: int, policy: AutoscalePolicy,
                   triggers: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": KEDA_API, "kind": "ScaledObject",
        "metadata": {"name": pool, "namespace": policy.namespace,
                     "labels": {**LABELS, "app.kubernetes.io/name": pool}},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": pool},
            "pollingInterval": policy.polling_s,
            "minReplicaCount": lo,
            "maxReplicaCount": hi,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                # Up at once (a GPU node takes minutes to join anyway); down one worker per 5 minutes, after
                # 10 minutes of lower demand: a decoder taken away ends the streams it runs.
                "scaleUp": {"stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
                "scaleDown": {"stabilizationWindowSeconds": policy.scale_down_window_s,
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}]},
            }}},
            "triggers": triggers,
        },
    }


def scaled_objects(tenants: TenantsConfig, policy: AutoscalePolicy | None = None,
                   models: list[str] | None = None) -> list[dict[str, Any]]:
    """The ScaledObjects of the decode and prefill StatefulSets (KEDA takes the largest of the triggers);
    ``models``: the served model names whose lanes count (default: the bundled model)."""
    policy = policy or AutoscalePolicy()
    policy.check()
    m = policy.matcher
    decode = [
        *_lane_triggers(tenants, policy, policy.inflight_per_decoder, models),
        # The lanes are per tenant and the HPA takes the largest trigger, not the sum: this one adds up
        # every tenant's running and decoder-queued sequences.
        _prometheus("decode-concurrency", policy, decode_concurrency_query(m), str(policy.inflight_per_decoder)),
        # Long contexts fill a decoder's KV before its batch: the memory-bound signal.
        _prometheus("kv-occupancy", policy, kv_occupancy_query(m), f"{policy.kv_occupancy:g}", "Value"),
    ]
    prefill = [
        # Queue growth grows the prefill pool in the P:D ratio, ahead of its own backlog...
        *_lane_triggers(tenants, policy, max(1, round(policy.inflight_per_decoder * policy.decoders_per_prefiller)),
                        models),
        # ...and prompt-heavy traffic (long prompts, few cache hits) shows as tokens waiting at prefillers.
        _prometheus("prefill-backlog", policy, prefill_backlog_query(m), str(policy.prefill_backlog_tokens)),
    ]
    return [_scaled_object("decode", policy.decode_min, policy.decode_max, policy, decode),
            _scaled_object("prefill", policy.prefill_min, policy.prefill_max, policy, prefill)]


AUTOSCALE_HEADER = """\
# KEDA ScaledObjects of the prefill and decode pools, generated by `splitserve k8s autoscale` from
#   {tenants}
# (one JetStream trigger per tenant and priority class: the queue's consumers). Do not edit: regenerate
# after changing the tenants or the policy (`splitserve k8s autoscale --help`).
"""


# ------------------------------------------------------------------------------------------------- lanes


async def ensure_lanes(nats_url: str, tenants: TenantsConfig, *, ack_wait_s: float, wait_s: float = 120.0,
                       echo: Callable[[str], None] = print, models: list[str] | None = None) -> list[str]:
    """Create (or confirm) the request queue's streams and every tenant's consumers (per served model:
    ``models``, default the bundled model), with the routers' own code and settings; retries until ``wait_s``
    while NATS or its JetStream cluster is still coming up."""
    from splitserve.proto import model_pools
    from splitserve.runtime.bus import Bus, NotAuthorized
    from splitserve.runtime.workqueue import NUM_CLASSES, WorkQueue

    deadline = time.monotonic() + wait_s
    while True:
        try:
            user = os.environ.get(natsauth.ENV_USER) or None
            # With the router's credentials (its init container), replies come back on the router's inbox:
            # the only one that user may subscribe to.
            inbox = natsauth.service_inbox("router") if user == natsauth.service_user("router") else None
            bus = await Bus.connect(nats_url, "k8s-lanes", user=user,
                                    password=os.environ.get(natsauth.ENV_PASSWORD) or None,
                                    nkey_seed=os.environ.get(natsauth.ENV_NKEY_SEED) or None,
                                    inbox_prefix=inbox, connect_timeout=2.0)  # this loop is the retry
            try:
                wq = WorkQueue(bus, ack_wait_s=ack_wait_s)
                await wq.setup()
                for tenant in sorted(tenants.tenants):
                    for pool in model_pools(models) if models else [Subjects.SINGLE_POOL]:
                        for klass in range(NUM_CLASSES):
                            await wq.lane(tenant, klass, pool)
                names = [name for _, _, name in queue_consumers(tenants, models)]
                for name in names:  # what the autoscaler's triggers name must now exist on the server
                    await wq.js.consumer_info(Subjects.QUEUE_STREAM, name)
                return names
            finally:
                await bus.close()
        except NotAuthorized:
            raise  # refused credentials do not get better with time
        except Exception as exc:
            if time.monotonic() >= deadline:
                raise
            echo(f"lanes: not yet ({exc}); retrying")
            await asyncio.sleep(2.0)


# ----------------------------------------------------------------------------------------------- commands


def _tenants(path: Path) -> TenantsConfig:
    try:
        return load_tenants(path)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tenants") from None


@app.command("secrets")
def secrets_cmd(
    tenants: Path = typer.Option(..., "--tenants", exists=True, dir_okay=False, help="the tenants file"),
    state_dir: Path = typer.Option(..., "--state-dir", file_okay=False,
                                   help="keeps the generated passwords (auth/, mode 0600): a re-run prints the "
                                        "same ones; keep it as safe as the cluster's Secrets"),
    namespace: str = typer.Option("splitserve", "--namespace", "-n", help="namespace of the deployment"),
    output: Path | None = typer.Option(None, "--output", "-o", dir_okay=False,
                                       help="write here (mode 0600) instead of standard output"),
) -> None:
    """Print the Secrets of a deployment (pipe them to `kubectl apply -f -`): NATS auth, service users, the
    tenants file and one Secret per tenant."""
    cfg = _tenants(tenants)
    auth = natsauth.prepare_stack_auth(state_dir, cfg)
    header = f"# Generated by `splitserve k8s secrets` from {tenants}: passwords inside, keep out of git.\n"
    text = dump_yaml(secret_manifests(cfg, auth, tenants.read_text(), namespace=namespace), header=header)
    if output is None:
        sys.stdout.write(text)
    else:
        natsauth.write_private(output, text)
        typer.echo(f"wrote {output} ({len(cfg.tenants)} tenants)", err=True)


@app.command("autoscale")
def autoscale_cmd(
    tenants: Path = typer.Option(..., "--tenants", exists=True, dir_okay=False, help="the tenants file"),
    namespace: str = typer.Option("splitserve", "--namespace", "-n"),
    prometheus: str = typer.Option(AutoscalePolicy.prometheus_url, "--prometheus",
                                   help="Prometheus that scrapes the front door's /metrics"),
    prometheus_matcher: str | None = typer.Option(None, "--prometheus-matcher",
                                                  help="label matcher added to every query (default: "
                                                       "namespace=\"<namespace>\"; '' for none)"),
    nats_monitor: str | None = typer.Option(None, "--nats-monitor", help="NATS monitoring host:port "
                                            "(default: nats.<namespace>.svc.cluster.local:8222)"),
    prefill_min: int = typer.Option(AutoscalePolicy.prefill_min, "--prefill-min"),
    prefill_max: int = typer.Option(AutoscalePolicy.prefill_max, "--prefill-max"),
    decode_min: int = typer.Option(AutoscalePolicy.decode_min, "--decode-min"),
    decode_max: int = typer.Option(AutoscalePolicy.decode_max, "--decode-max"),
    inflight_per_decoder: int = typer.Option(AutoscalePolicy.inflight_per_decoder, "--inflight-per-decoder",
                                             help="queued + running requests one decoder should carry"),
    decoders_per_prefiller: float = typer.Option(AutoscalePolicy.decoders_per_prefiller,
                                                 "--decoders-per-prefiller", help="the D:P ratio kept as the "
                                                 "queue grows (2 = one prefiller per two decoders)"),
    kv_occupancy: float = typer.Option(AutoscalePolicy.kv_occupancy, "--kv-occupancy",
                                       help="target mean KV occupancy of the decoders (0-1)"),
    prefill_backlog_tokens: int = typer.Option(AutoscalePolicy.prefill_backlog_tokens, "--prefill-backlog-tokens",
                                               help="queued prompt tokens one prefiller should carry"),
    model_name: list[str] = typer.Option([], "--model-name", help="each served model's name, as the routers name "
                                         "it, when they serve several (repeatable; one model: not needed): their "
                                         "queue lanes count"),
) -> None:
    """Print KEDA ScaledObjects for the prefill and decode pools."""
    cfg = _tenants(tenants)
    policy = AutoscalePolicy(namespace=namespace, prometheus_url=prometheus, prometheus_matcher=prometheus_matcher,
                             nats_monitor=nats_monitor, prefill_min=prefill_min, prefill_max=prefill_max,
                             decode_min=decode_min, decode_max=decode_max,
                             inflight_per_decoder=inflight_per_decoder,
                             decoders_per_prefiller=decoders_per_prefiller, kv_occupancy=kv_occupancy,
                             prefill_backlog_tokens=prefill_backlog_tokens)
    try:
        docs = scaled_objects(cfg, policy, model_name or None)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    sys.stdout.write(dump_yaml(docs, header=AUTOSCALE_HEADER.format(tenants=tenants)))


@app.command("lanes")
def lanes_cmd(
    tenants: Path = typer.Option(..., "--tenants", exists=True, dir_okay=False, help="the tenants file"),
    nats_url: str = typer.Option("nats://127.0.0.1:4222", "--nats-url", envvar="SPLITSERVE_NATS_URL"),
    queue_ack_wait_s: float = typer.Option(30.0, "--queue-ack-wait-s", help="the routers' --queue-ack-wait-s"),
    wait_s: float = typer.Option(120.0, "--wait-s", help="keep retrying this long while NATS comes up"),
    model_name: list[str] = typer.Option([], "--model-name", help="each served model's name, as the routers name "
                                         "it, when they serve several (repeatable; one model: not needed)"),
) -> None:
    """Create the request queue's consumers of every tenant (run before the routers; idempotent). Credentials:
    $SPLITSERVE_NATS_USER / $SPLITSERVE_NATS_PASSWORD, as the services take them."""
    cfg = _tenants(tenants)
    try:
        names = asyncio.run(ensure_lanes(nats_url, cfg, ack_wait_s=queue_ack_wait_s, wait_s=wait_s,
                                         echo=lambda s: typer.echo(s, err=True), models=model_name or None))
    except Exception as exc:
        typer.echo(f"lanes: FAILED: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"lanes: {len(names)} consumers on {Subjects.QUEUE_STREAM}: {', '.join(names)}")
