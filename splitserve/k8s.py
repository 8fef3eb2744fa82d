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
- ``pools``: several served models (an ``up`` config's ``models:`` list): an overlay with a prefill and a
  decode StatefulSet per model, made from the base's pools (``prefill-<slug>``, ``decode-<slug>``: see
  :func:`model_slug`), the routers serving every model, and KEDA ScaledObjects per model pool on that model's
  own lanes and workers only.

The builders (:func:`secret_manifests`, :func:`scaled_objects`, :func:`pools_files`) are pure and return plain
manifests; the commands print (or write) YAML. Queue names come from the router's own work-queue module, so
they cannot drift.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import typer
import yaml

from splitserve.proto.subjects import Subjects
from splitserve.tenancy import natsauth
from splitserve.tenancy.config import TenantsConfig, load_tenants
from splitserve.tenancy.natsauth import StackAuth

app = typer.Typer(no_args_is_help=True,
                  help="Kubernetes: Secrets, KEDA autoscaling, queue setup and per-model pools for deploy/k8s")

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


def queue_consumers(tenants: TenantsConfig, models: list[str] | None = None, *,
                    model: str | None = None) -> list[tuple[str, int, str]]:
    """(tenant, class, durable consumer name) of every lane of the request queue (a lane per tenant, served
    model and class; ``models``: the routers' served model names, default the bundled model), in a stable
    order; ``model`` (one of ``models``): only that model's lanes."""
    # The contract's naming, which the routers' work queue uses too.
    from splitserve.proto import Subjects, model_pools

    pools = model_pools(models) if models else [Subjects.SINGLE_POOL]
    if model is not None:
        if not models or model not in models:
            raise ValueError(f"model {model!r} is not one of the served models {models!r}")
        pools = [pools[models.index(model)]]  # a pool token, not the name: one model's lanes are `default`
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
                   models: list[str] | None = None, model: str | None = None) -> list[dict[str, Any]]:
    return [{"type": "nats-jetstream", "name": f"queue-{consumer}",
             "metadata": {"natsServerMonitoringEndpoint": policy.monitor, "account": "$G",
                          "stream": Subjects.QUEUE_STREAM, "consumer": consumer, "lagThreshold": str(lag)}}
            for _, _, consumer in queue_consumers(tenants, models, model=model)]


def _prometheus(name: str, policy: AutoscalePolicy, query: str, threshold: str,
                metric_type: str | None = None) -> dict[str, Any]:
    trig: dict[str, Any] = {"type": "prometheus", "name": name}
    if metric_type:
        trig["metricType"] = metric_type
    trig["metadata"] = {"serverAddress": policy.prometheus_url, "query": query, "threshold": threshold}
    return trig


def _scaled_object(pool: str, lo: int, hi: int, policy: AutoscalePolicy,
                   triggers: list[dict[str, Any]], model: str | None = None) -> dict[str, Any]:
    role = pool
    meta: dict[str, Any] = {"name": pool, "namespace": policy.namespace,
                            "labels": {**LABELS, "app.kubernetes.io/name": role}}
    if model is not None:  # one model's pool: named and labelled as its StatefulSet (pool_manifests)
        pool = pool_name(role, model)
        meta = {"name": pool, "namespace": policy.namespace,
                "labels": {**LABELS, "app.kubernetes.io/name": role, MODEL_LABEL: model_slug(model)},
                "annotations": {MODEL_NAME_ANNOTATION: model}}
    return {
        "apiVersion": KEDA_API, "kind": "ScaledObject",
        "metadata": meta,
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
                   models: list[str] | None = None, *, model: str | None = None,
                   prefill: bool = True) -> list[dict[str, Any]]:
    """The ScaledObjects of the decode and prefill StatefulSets (KEDA takes the largest of the triggers);
    ``models``: the served model names whose lanes count (default: the bundled model).

    ``model`` (one of ``models``): the ScaledObjects of that model's own pools instead (``decode-<slug>``,
    ``prefill-<slug>``, as :func:`pool_manifests` names them): only its lanes, and Prometheus series of only
    its workers (their worker ids are their pod names, ``<pool>-<ordinal>``). ``prefill=False``: no prefill
    ScaledObject (a model without prefillers)."""
    policy = policy or AutoscalePolicy()
    policy.check()

    def matcher(role: str) -> str:
        if model is None:
            return policy.matcher
        # The worker gauges have no model label; a pool's worker ids are its pod names. PromQL anchors the
        # regex, and a slug is [a-z0-9-]: "decode-a-[0-9]+" never matches pool "a-1"'s "decode-a-1-0".
        return ", ".join(filter(None, (policy.matcher, f'worker=~"{pool_name(role, model)}-[0-9]+"')))

    dm, pm = matcher("decode"), matcher("prefill")
    decode = [
        *_lane_triggers(tenants, policy, policy.inflight_per_decoder, models, model),
        # The lanes are per tenant and the HPA takes the largest trigger, not the sum: this one adds up
        # every tenant's running and decoder-queued sequences.
        _prometheus("decode-concurrency", policy, decode_concurrency_query(dm), str(policy.inflight_per_decoder)),
        # Long contexts fill a decoder's KV before its batch: the memory-bound signal.
        _prometheus("kv-occupancy", policy, kv_occupancy_query(dm), f"{policy.kv_occupancy:g}", "Value"),
    ]
    prefill_triggers = [
        # Queue growth grows the prefill pool in the P:D ratio, ahead of its own backlog...
        *_lane_triggers(tenants, policy, max(1, round(policy.inflight_per_decoder * policy.decoders_per_prefiller)),
                        models, model),
        # ...and prompt-heavy traffic (long prompts, few cache hits) shows as tokens waiting at prefillers.
        _prometheus("prefill-backlog", policy, prefill_backlog_query(pm), str(policy.prefill_backlog_tokens)),
    ]
    out = [_scaled_object("decode", policy.decode_min, policy.decode_max, policy, decode, model)]
    if prefill:
        out.append(_scaled_object("prefill", policy.prefill_min, policy.prefill_max, policy, prefill_triggers, model))
    return out


AUTOSCALE_HEADER = """\
# KEDA ScaledObjects of the prefill and decode pools, generated by `splitserve k8s autoscale` from
#   {tenants}
# (one JetStream trigger per tenant and priority class: the queue's consumers). Do not edit: regenerate
# after changing the tenants or the policy (`splitserve k8s autoscale --help`).
"""


# ------------------------------------------------------------------------------------------------- pools

# A served model's pools: its name (any string of up to 256 characters, e.g. `meta-llama/Llama-3.1-8B`) made
# into object names. A StatefulSet's pods carry controller-revision-hash=<its name>-<10 characters>, a label
# value (at most 63): "prefill-" + slug must stay within 52, so a slug has at most 44 characters.
MODEL_LABEL = "splitserve.io/model"  # the slug (label values cannot hold '/'); the splitserve.io/ prefix as tenants'
MODEL_NAME_ANNOTATION = "splitserve.io/model-name"  # the served name itself
POOL_ROLES = ("prefill", "decode")
SLUG_MAX = 44
_SLUG_HASH = 8
POOL_FILES = ("kustomization.yaml", "pools.yaml", "router-models.yaml", "drop-single-pool.yaml", "pool-patches.yaml",
              "autoscale.yaml")
DEFAULT_MODELS_MOUNT = "/models"
DEFAULT_MODELS_CLAIM = "splitserve-models"  # overlays/gpu-efa/models-pvc.yaml


def model_slug(name: str) -> str:
    """A served model's name as a DNS-1123 label part: lowered, runs of other characters as '-'. A name that is
    not already such a slug (``smollm2/26l``, ``Llama``, or longer than 44) gets 8 hex digits of its SHA-256
    appended (``smollm2-26l-1a2b3c4d``), so two names never share a slug however they fold; deterministic."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if slug == name and len(slug) <= SLUG_MAX:
        return slug
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:_SLUG_HASH]
    head = slug[:SLUG_MAX - _SLUG_HASH - 1].strip("-")
    return f"{head}-{digest}" if head else f"m-{digest}"


def pool_name(role: str, model: str) -> str:
    """The StatefulSet, headless Service, PDB and ScaledObject of a model's prefill or decode pool; its pods
    (and so its worker ids) are ``<pool_name>-<ordinal>``."""
    if role not in POOL_ROLES:
        raise ValueError(f"role must be one of {POOL_ROLES}, not {role!r}")
    return f"{role}-{model_slug(model)}"


@dataclass(frozen=True)
class ModelsFile:
    """What ``splitserve k8s pools`` takes from an ``up`` config: its ``models:`` list, parsed and checked by the
    code ``up --config`` uses, and the workers' ``max_loras`` / ``colocated``; up's other keys (engine, dtype...)
    are the overlay's ConfigMap's business and are ignored."""

    pools: tuple[Any, ...]  # splitserve.stack.ModelPool (imported lazily: that module starts processes)
    max_loras: int = 0
    colocated: bool = False

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.pools]


def load_models_file(path: Path) -> ModelsFile:
    """Read an ``up`` config's ``models:`` list; ValueError naming what is wrong."""
    # The parser `up --config` uses (splitserve.cli imports this module: import it only when called).
    from splitserve.stack import parse_model_pools

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or "models" not in data:
        raise ValueError(f"{path}: expected a mapping with a `models:` list (as `splitserve up --config` reads)")
    settings = {str(k).replace("-", "_"): v for k, v in data.items()}
    pools = tuple(parse_model_pools(settings["models"]))
    max_loras = settings.get("max_loras", 0) or 0
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 0:
        raise ValueError(f"{path}: max_loras must be a whole number >= 0, not {max_loras!r}")
    colocated = settings.get("colocated", False)
    if not isinstance(colocated, bool):
        raise ValueError(f"{path}: colocated must be true or false, not {colocated!r}")
    slugs: dict[str, str] = {}
    for p in pools:  # only a model literally named like another's hashed slug could collide: refuse it
        slug = model_slug(p.name)
        if slug in slugs:
            raise ValueError(f"models {slugs[slug]!r} and {p.name!r} would share the Kubernetes name {slug!r}")
        slugs[slug] = p.name
    return ModelsFile(pools, max_loras, colocated)


def _load_template(path: Path) -> list[dict[str, Any]]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read the template {path}: {exc}") from None


def _container(pod: dict[str, Any], name: str, *, init: bool = False) -> dict[str, Any]:
    for c in pod.get("initContainers" if init else "containers", []):
        if c.get("name") == name:
            return c
    raise ValueError(f"the template has no {'init container' if init else 'container'} {name!r}")


def _with_model(args: list[str], values: list[str]) -> list[str]:
    """``args`` with its ``--model VALUE`` pair replaced by ``values`` (where it stood; appended if absent)."""
    if "--model" not in args:
        return [*args, *values]
    i = args.index("--model")
    return [*args[:i], *values, *args[i + 2:]]


def _uses_mount(path: str | None, mount: str | None) -> bool:
    return bool(mount and path and (path == mount or path.startswith(mount.rstrip("/") + "/")))


def _mount_models(pod: dict[str, Any], container: dict[str, Any], mount: str, claim: str) -> None:
    container.setdefault("volumeMounts", []).append({"name": "models", "mountPath": mount, "readOnly": True})
    pod.setdefault("volumes", []).append({"name": "models",
                                          "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})


def pool_manifests(role: str, pool: Any, template: list[dict[str, Any]], *, max_loras: int = 0,
                   replicas: int | None = None, models_mount: str | None = DEFAULT_MODELS_MOUNT,
                   models_claim: str = DEFAULT_MODELS_CLAIM) -> list[dict[str, Any]]:
    """One model's prefill or decode pool from the base's pool (``template``: deploy/k8s/base/<role>.yaml, its
    headless Service, StatefulSet and PDB): renamed ``<role>-<slug>``, every selector narrowed to the model's
    label, and the worker started with the model's ``--model``, ``--served-model-name``, ``--lora-modules``
    (and ``--max-loras``), as ``up`` starts a model pool's workers. ``replicas`` None: left to the autoscaler
    (an apply must not reset what KEDA set). The models volume is mounted when a path lies under it."""
    from splitserve.stack import BUNDLED_MODEL

    name, slug = pool_name(role, pool.name), model_slug(pool.name)
    paths = [pool.model, *(p for _, p in pool.lora_modules)]
    worker_model = [
        "--model", pool.model or BUNDLED_MODEL,
        "--served-model-name", pool.name,
        *(a for n, p in pool.lora_modules for a in ("--lora-modules", f"{n}={p}")),
        *(["--max-loras", str(max_loras)] if max_loras and pool.lora_modules else []),
    ]
    out = []
    for doc in copy.deepcopy(template):
        meta = doc.get("metadata", {})
        if meta.get("name") != role:
            raise ValueError(f"the {role} template holds {doc.get('kind')}/{meta.get('name')}: expected only "
                             f"the base's {role} Service, StatefulSet and PodDisruptionBudget")
        meta["name"] = name
        meta["labels"] = {**meta.get("labels", {}), MODEL_LABEL: slug}
        meta["annotations"] = {**meta.get("annotations", {}), MODEL_NAME_ANNOTATION: pool.name}
        kind, spec = doc["kind"], doc["spec"]
        if kind == "Service":
            spec["selector"][MODEL_LABEL] = slug
        elif kind == "PodDisruptionBudget":  # one model's pool loses at most one worker at a time
            spec["selector"]["matchLabels"][MODEL_LABEL] = slug
        elif kind == "StatefulSet":
            spec["serviceName"] = name
            if replicas is None:
                spec.pop("replicas", None)
            else:
                spec["replicas"] = replicas
            spec["selector"]["matchLabels"][MODEL_LABEL] = slug
            tmeta = spec["template"]["metadata"]
            tmeta["labels"][MODEL_LABEL] = slug
            tmeta["annotations"] = {**tmeta.get("annotations", {}), MODEL_NAME_ANNOTATION: pool.name}
            pod = spec["template"]["spec"]
            # Spread each pool over the nodes on its own; the anti-affinity between the roles (prefill and
            # decode apart) stays across every model, as in the base.
            for tsc in pod.get("topologySpreadConstraints", []):
                sel = tsc.get("labelSelector", {}).get("matchLabels", {})
                if sel.get("app.kubernetes.io/name") == role:
                    sel[MODEL_LABEL] = slug
            c = _container(pod, role)
            c["args"] = _with_model(list(c.get("args", [])), worker_model)
            if any(_uses_mount(p, models_mount) for p in paths):
                assert models_mount is not None
                _mount_models(pod, c, models_mount, models_claim)
        else:
            raise ValueError(f"the {role} template holds a {kind}: expected Service, StatefulSet, "
                             "PodDisruptionBudget")
        out.append(doc)
    return out


def router_patch(models: ModelsFile, template: list[dict[str, Any]], *,
                 models_mount: str | None = DEFAULT_MODELS_MOUNT,
                 models_claim: str = DEFAULT_MODELS_CLAIM) -> dict[str, Any]:
    """A strategic-merge patch of the base's router Deployment (``template``: deploy/k8s/base/router.yaml):
    one ``--model NAME=PATH`` per model, in the config's order (the first is the default), and the models' own
    ``--model-strategy`` / ``--model-disagg-threshold``, as ``up`` gives its routers; its init container
    creates every model's lanes (``--model-name``), which the ScaledObjects name. Containers' args are lists
    without a merge key: the patch carries them whole."""
    from splitserve.stack import StackConfig

    router = next((d for d in template if d.get("kind") == "Deployment"
                   and d.get("metadata", {}).get("name") == "router"), None)
    if router is None:
        raise ValueError("the router template has no Deployment router")
    pod = router["spec"]["template"]["spec"]
    # As `up` gives them: NAME=PATH (PATH `bundled` if none), then each model's own strategy and threshold.
    stack = StackConfig(models=list(models.pools), colocated=models.colocated)
    main_args = _with_model(list(_container(pod, "router").get("args", [])),
                            [*(a for m in stack.router_models() for a in ("--model", m)),
                             *stack.router_model_policies()])
    lanes_args = [*_container(pod, "queue-lanes", init=True).get("args", []),
                  *(a for n in models.names for a in ("--model-name", n))]
    main: dict[str, Any] = {"name": "router", "args": main_args}
    patch_pod: dict[str, Any] = {"initContainers": [{"name": "queue-lanes", "args": lanes_args}],
                                 "containers": [main]}
    # The routers tokenize with each model's tokenizer: they need its files too.
    if any(_uses_mount(p.model, models_mount) for p in models.pools):
        assert models_mount is not None
        _mount_models(patch_pod, main, models_mount, models_claim)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "router"},
            "spec": {"template": {"spec": patch_pod}}}


def _base_scaled_objects(base_dir: Path) -> list[tuple[str, str | None]]:
    """(name, namespace) of the ScaledObjects named like the base's pools in a base's own resources
    (overlays/gpu-efa's autoscale.yaml): they target the StatefulSets the overlay removes, so the overlay
    removes them too."""
    try:
        kust = yaml.safe_load((base_dir / "kustomization.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []
    found: list[tuple[str, str | None]] = []
    for res in kust.get("resources") or []:
        f = base_dir / str(res)
        if not f.is_file():
            continue
        try:
            docs = list(yaml.safe_load_all(f.read_text()))
        except yaml.YAMLError:
            continue
        found += [(d["metadata"]["name"], d["metadata"].get("namespace")) for d in docs
                  if isinstance(d, dict) and d.get("kind") == "ScaledObject"
                  and d.get("metadata", {}).get("name") in POOL_ROLES]
    return sorted(set(found))


def _base_pool_patches(base_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """(role, patch) of the base's own strategic-merge patches of its pools (overlays/gpu-efa's gpu-pools.yaml:
    GPUs, EFA, tolerations, node affinity; cpu-dev's small-pools.yaml): the overlay applies a copy of each to
    every model's pool of that role, so the pools are sized and placed as the base's would be."""
    try:
        kust = yaml.safe_load((base_dir / "kustomization.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []
    found: list[tuple[str, dict[str, Any]]] = []
    for res in kust.get("patchesStrategicMerge") or []:
        f = base_dir / str(res)
        try:
            docs = list(yaml.safe_load_all(f.read_text()))
        except (OSError, yaml.YAMLError):
            continue
        for d in docs:
            name = d.get("metadata", {}).get("name") if isinstance(d, dict) else None
            if name in POOL_ROLES and d.get("kind") in ("StatefulSet", "Service", "PodDisruptionBudget") \
                    and d.get("$patch") != "delete":
                found.append((name, d))
    return found


def _delete(api: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
    # A patch finds its object by the namespace the object was written with (gpu-efa's ScaledObjects name
    # theirs; the base's pools name none).
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": api, "kind": kind, "metadata": meta, "$patch": "delete"}


@dataclass(frozen=True)
class PoolsOptions:
    """Where ``splitserve k8s pools`` takes its templates from and how the overlay is put together."""

    base: str = "../../base"  # the kustomization the overlay builds on, relative to the overlay
    templates: Path = Path("deploy/k8s/base")  # prefill.yaml, decode.yaml, router.yaml
    namespace: str = "splitserve"
    models_mount: str | None = DEFAULT_MODELS_MOUNT
    models_claim: str = DEFAULT_MODELS_CLAIM
    command: str = ""  # the command line that made it, for the files' headers


POOLS_HEADER = """\
# Generated by `splitserve k8s pools` from {config}. Do not edit: regenerate with
#   {command}
# {what}
"""


def pools_files(models: ModelsFile, opts: PoolsOptions, *, tenants: TenantsConfig | None = None,
                policy: AutoscalePolicy | None = None, base_dir: Path | None = None,
                config_name: str = "models.yaml") -> dict[str, str]:
    """The files of an overlay with one prefill and one decode pool per model (file name -> text): the pools
    (pools.yaml), the routers serving every model (router-models.yaml), the base's one-model pools removed
    (drop-single-pool.yaml), the base's own patches of its pools copied to every model's (pool-patches.yaml)
    and, with ``tenants``, a decode and a prefill ScaledObject per model, each on its own model's lanes and
    workers (autoscale.yaml). ``base_dir``: the base on disk, to find its pool patches and ScaledObjects."""
    templates = {role: _load_template(opts.templates / f"{role}.yaml") for role in (*POOL_ROLES, "router")}
    autoscale = tenants is not None
    pools_docs: list[dict[str, Any]] = []
    for pool in models.pools:
        for role in POOL_ROLES:
            count = 0 if role == "prefill" and models.colocated else (pool.prefill if role == "prefill"
                                                                      else pool.decode)
            if count == 0:  # no prefillers: its decoders prefill every prompt (up's prefill: 0)
                continue
            pools_docs += pool_manifests(role, pool, templates[role], max_loras=models.max_loras,
                                         replicas=None if autoscale else count, models_mount=opts.models_mount,
                                         models_claim=opts.models_claim)
    head = {"config": config_name, "command": opts.command or "splitserve k8s pools --config ..."}
    files = {
        "pools.yaml": dump_yaml(pools_docs, POOLS_HEADER.format(
            what="A prefill and a decode pool per model: the base's pools, renamed and narrowed to the model.",
            **head)),
        "router-models.yaml": dump_yaml([router_patch(models, templates["router"], models_mount=opts.models_mount,
                                                      models_claim=opts.models_claim)], POOLS_HEADER.format(
            what="The routers serve every model (--model NAME=PATH) and create every model's lanes.", **head)),
    }
    drops = [_delete(api, kind, role) for role in POOL_ROLES
             for api, kind in (("v1", "Service"), ("apps/v1", "StatefulSet"), ("policy/v1", "PodDisruptionBudget"))]
    drops += [_delete(KEDA_API, "ScaledObject", name, ns) for name, ns in _base_scaled_objects(base_dir)
              ] if base_dir else []
    files["drop-single-pool.yaml"] = dump_yaml(drops, POOLS_HEADER.format(
        what="The base's one-model pools removed (each model has its own).", **head))
    inherited = []
    for pool in models.pools:
        for role, patch in _base_pool_patches(base_dir) if base_dir else []:
            if any(d["kind"] == patch["kind"] and d["metadata"]["name"] == pool_name(role, pool.name)
                   for d in pools_docs):
                own_patch = copy.deepcopy(patch)
                own_patch["metadata"]["name"] = pool_name(role, pool.name)
                # The count is the config's (fixed pools) or the autoscaler's, never the base's one pool's.
                if patch["kind"] == "StatefulSet":
                    own_patch.get("spec", {}).pop("replicas", None)
                inherited.append(own_patch)
    if inherited:
        files["pool-patches.yaml"] = dump_yaml(inherited, POOLS_HEADER.format(
            what=f"The base's ({opts.base}) patches of its pools, applied to every model's pool of that role.",
            **head))
    if tenants is not None:
        policy = policy or AutoscalePolicy(namespace=opts.namespace)
        so: list[dict[str, Any]] = []
        for pool in models.pools:
            prefill = pool.prefill > 0 and not models.colocated
            # The config's counts are each pool's floor; the policy's maxima its ceiling (at least the floor).
            own = replace(policy, decode_min=pool.decode, decode_max=max(policy.decode_max, pool.decode),
                          prefill_min=pool.prefill if prefill else policy.prefill_min,
                          prefill_max=max(policy.prefill_max, pool.prefill))
            so += scaled_objects(tenants, own, models.names, model=pool.name, prefill=prefill)
        files["autoscale.yaml"] = dump_yaml(so, POOLS_HEADER.format(
            what="KEDA ScaledObjects per model pool: its own lanes (one per tenant and priority class) and its own "
                 "workers' series.", **head))
    resources = ["pools.yaml", *(["autoscale.yaml"] if autoscale else [])]
    kust = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "namespace": opts.namespace, "bases": [opts.base], "resources": resources,
            "patchesStrategicMerge": ["drop-single-pool.yaml", "router-models.yaml",
                                      *(["pool-patches.yaml"] if inherited else [])]}
    names = ", ".join(f"{p.name} ({model_slug(p.name)})" for p in models.pools)
    files["kustomization.yaml"] = POOLS_HEADER.format(
        what=f"One prefill and one decode pool per model: {names}.", **head) + (
        "# Plain `bases` and `patchesStrategicMerge`, as the other overlays use (tested with kubectl's kustomize v5).\n"
        + yaml.safe_dump(kust, sort_keys=False, default_flow_style=False))
    return files


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


@app.command("pools")
def pools_cmd(
    config: Path = typer.Option(..., "--config", exists=True, dir_okay=False,
                                help="an `up` config with a `models:` list (name, model, prefill, decode, "
                                     "lora_modules; top-level max_loras, colocated)"),
    out: Path = typer.Option(..., "--out", file_okay=False, help="the overlay folder to write (e.g. "
                             "deploy/k8s/overlays/two-models); generated files there are replaced"),
    base: str = typer.Option(PoolsOptions.base, "--base", help="the kustomization the overlay builds on, "
                             "relative to --out (e.g. ../cpu-dev or ../gpu-efa); its own patches of its "
                             "prefill and decode pools are applied to every model's pools"),
    templates: Path = typer.Option(PoolsOptions.templates, "--templates", exists=True, file_okay=False,
                                   help="folder with the prefill.yaml, decode.yaml and router.yaml every pool "
                                        "and the router patch are made from"),
    tenants: Path | None = typer.Option(None, "--tenants", exists=True, dir_okay=False,
                                        help="the tenants file: KEDA ScaledObjects per model pool (autoscale.yaml; "
                                             "without it, fixed pool sizes: the config's counts)"),
    namespace: str = typer.Option(PoolsOptions.namespace, "--namespace", "-n"),
    models_mount: str = typer.Option(DEFAULT_MODELS_MOUNT, "--models-mount", help="where the models volume is "
                                     "mounted: pods whose model or adapter paths lie under it mount it ('' never)"),
    models_claim: str = typer.Option(DEFAULT_MODELS_CLAIM, "--models-claim",
                                     help="the PersistentVolumeClaim holding the models (ReadOnlyMany or "
                                          "ReadWriteMany)"),
    prometheus: str = typer.Option(AutoscalePolicy.prometheus_url, "--prometheus",
                                   help="Prometheus that scrapes the front door's /metrics"),
    prefill_max: int = typer.Option(AutoscalePolicy.prefill_max, "--prefill-max", help="each model's most prefillers"),
    decode_max: int = typer.Option(AutoscalePolicy.decode_max, "--decode-max", help="each model's most decoders"),
    inflight_per_decoder: int = typer.Option(AutoscalePolicy.inflight_per_decoder, "--inflight-per-decoder",
                                             help="queued + running requests one decoder should carry"),
) -> None:
    """Write a kustomize overlay with one prefill and one decode pool per model of an `up` config (StatefulSets
    prefill-<model>, decode-<model>), the routers serving every model, and (with --tenants) KEDA ScaledObjects
    per model pool on that model's own lanes and workers."""
    try:
        models = load_models_file(config)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from None
    cfg = _tenants(tenants) if tenants is not None else None
    words = ["splitserve k8s pools", "--config", str(config), "--out", str(out)]
    for flag, value, default in (("--base", base, PoolsOptions.base),
                                 ("--templates", str(templates), str(PoolsOptions.templates)),
                                 ("--tenants", str(tenants) if tenants else None, None),
                                 ("-n", namespace, PoolsOptions.namespace),
                                 ("--models-mount", models_mount, DEFAULT_MODELS_MOUNT),
                                 ("--models-claim", models_claim, DEFAULT_MODELS_CLAIM),
                                 ("--prometheus", prometheus, AutoscalePolicy.prometheus_url),
                                 ("--prefill-max", str(prefill_max), str(AutoscalePolicy.prefill_max)),
                                 ("--decode-max", str(decode_max), str(AutoscalePolicy.decode_max)),
                                 ("--inflight-per-decoder", str(inflight_per_decoder),
                                  str(AutoscalePolicy.inflight_per_decoder))):
        if value is not None and value != default:
            words += [flag, value]
    opts = PoolsOptions(base=base, templates=templates, namespace=namespace, models_mount=models_mount or None,
                        models_claim=models_claim, command=" ".join(words))
    policy = AutoscalePolicy(namespace=namespace, prometheus_url=prometheus, prefill_max=prefill_max,
                             decode_max=decode_max, inflight_per_decoder=inflight_per_decoder)
    try:
        files = pools_files(models, opts, tenants=cfg, policy=policy, base_dir=Path(os.path.normpath(out / base)),
                           config_name=str(config))  # normpath: --out may not exist yet
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    out.mkdir(parents=True, exist_ok=True)
    for name in POOL_FILES:  # a stale generated file (autoscale.yaml of an earlier run with --tenants) goes
        if name not in files and (out / name).is_file() and (out / name).read_text().startswith(
                "# Generated by `splitserve k8s pools`"):
            (out / name).unlink()
    for name, text in files.items():
        (out / name).write_text(text)
    pools = ", ".join(f"{pool_name('decode', n)}" for n in models.names)
    typer.echo(f"wrote {out}: {len(models.pools)} models ({pools}); build it with `kubectl kustomize {out}`",
               err=True)
