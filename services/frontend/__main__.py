"""``python -m splitserve.services.frontend``: run one OpenAI-compatible HTTP front door against a NATS deployment."""

from __future__ import annotations

from pathlib import Path

import typer

from splitserve.runtime.service import run_service
from splitserve.services.common.cli import DrainTimeout, LogLevel, NatsUrl
from splitserve.services.frontend.app import MIN_API_KEY_CHARS, PER_KEY_CONCURRENCY
from splitserve.services.frontend.guard import HEADER_TIMEOUT_S
from splitserve.services.frontend.service import LIMIT_CONCURRENCY, METRICS_PORT
from splitserve.services.frontend.whatif import WHATIF_TIMEOUT_S

app = typer.Typer(add_completion=False)


@app.command()
def main(
    nats_url: str = NatsUrl,
    worker_id: str = typer.Option("frontend-0"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on (beyond loopback without API keys: a loud "
                                               "warning)"),
    port: int = typer.Option(8000, help="HTTP port (0 = a free one)"),
    listen_fd: int | None = typer.Option(None, help="accept on this inherited listening socket instead of binding "
                                                    "--host/--port (which then only name it): `splitserve up` holds "
                                                    "one for all its front doors, so that a restart refuses nothing"),
    metrics_host: str = typer.Option("127.0.0.1", help="interface of the /metrics port (its series name every "
                                                       "tenant: keep it off the network tenants reach)"),
    metrics_port: int = typer.Option(METRICS_PORT, help="port serving GET /metrics (and nothing else): not on "
                                                        "the API port; taken = a free one, logged; 0 = a free one"),
    docs: bool = typer.Option(False, "--docs/--no-docs", help="serve /docs, /redoc and /openapi.json (off: they "
                                                             "map the whole API for anyone who asks)"),
    limit_concurrency: int = typer.Option(LIMIT_CONCURRENCY, help="connections served at once; beyond: 503"),
    per_key_concurrency: int = typer.Option(PER_KEY_CONCURRENCY, help="generation requests one API key may "
                                                                      "have in flight; beyond: 429 (0 = no limit)"),
    header_timeout_s: float = typer.Option(HEADER_TIMEOUT_S, help="a request's headers must arrive within this "
                                                                  "(slow senders are cut off with 408)"),
    model_name: str | None = typer.Option(None, help="served model name (default: the one the workers announce)"),
    api_keys: Path | None = typer.Option(None, exists=True, dir_okay=False,
                                         help="JSON or YAML mapping API key -> tenant; without it there is no "
                                              "auth and every request is tenant 'default'"),
    tenants: Path | None = typer.Option(None, exists=True, dir_okay=False,
                                        help="tenants file: its tenants' api_keys are accepted too (a tenants "
                                             "file with keys turns key auth on)"),
    admin_keys: Path | None = typer.Option(None, exists=True, dir_okay=False,
                                           help="web console admin keys (a list, or one per line); also "
                                                "SPLITSERVE_CONSOLE_ADMIN_KEYS (comma-separated)"),
    whatif_traces: Path | None = typer.Option(None, exists=True, file_okay=False,
                                              help="folder of the traces the console's what-if panel offers (its "
                                                   ".jsonl/.csv files, by name; default: the simulator's shared "
                                                   "data traces/ folder)"),
    whatif_timeout_s: float = typer.Option(WHATIF_TIMEOUT_S, min=1.0,
                                           help="wall-clock bound on one console what-if run (a simulation in a "
                                                "child process; past it: killed, HTTP 504)"),
    log_level: str = LogLevel,
    drain_timeout_s: float = DrainTimeout,
) -> None:
    from splitserve.obs.log import register_secret
    from splitserve.services.frontend.app import load_api_keys
    from splitserve.services.frontend.console import admin_keys_from_env, load_admin_keys
    from splitserve.services.frontend.service import FrontendService
    from splitserve.tenancy.config import load_tenants

    keys: dict[str, str] | None = None
    admins = admin_keys_from_env()
    if admin_keys is not None:
        try:
            admins += load_admin_keys(admin_keys)
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--admin-keys") from None
    cfg = None
    if api_keys is not None:
        try:
            keys = load_api_keys(api_keys)
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--api-keys") from None
    if tenants is not None:
        try:
            cfg = load_tenants(tenants)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--tenants") from None
        from_file = {k: name for name, spec in cfg.tenants.items() for k in spec.api_keys}
        if any(keys and k in keys and keys[k] != t for k, t in from_file.items()):
            raise typer.BadParameter("an API key maps to different tenants in --api-keys and --tenants",
                                     param_hint="--tenants")
        if from_file:
            keys = {**(keys or {}), **from_file}
        for name in sorted({t for k, t in from_file.items() if len(k) < MIN_API_KEY_CHARS}):
            # A warning, not a refusal: the tenants file is the whole stack's (its own checks are its own).
            typer.echo(f"WARNING: tenant {name!r} in --tenants has an API key shorter than {MIN_API_KEY_CHARS} "
                       "characters: easy to guess", err=True)
    if keys and set(keys) & set(admins):
        raise typer.BadParameter("a console admin key is also a tenant's API key", param_hint="--admin-keys")
    register_secret(*(keys or {}), *admins)  # never in a log line, even inside an error's text
    run_service(FrontendService(worker_id, nats_url, host=host, port=port, listen_fd=listen_fd,
                                model_name=model_name, api_keys=keys,
                                admin_keys=admins, tenants=cfg, log_level=log_level,
                                drain_timeout_s=drain_timeout_s, docs=docs, metrics_host=metrics_host,
                                metrics_port=metrics_port, limit_concurrency=limit_concurrency,
                                per_key_concurrency=per_key_concurrency, header_timeout_s=header_timeout_s,
                                whatif_traces=whatif_traces, whatif_timeout_s=whatif_timeout_s))


if __name__ == "__main__":
    app()
