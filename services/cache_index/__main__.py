"""``python -m splitserve.services.cache_index``: run the cache-index service."""

from __future__ import annotations

import typer

from splitserve.runtime.service import run_service
from splitserve.services.common import cli

app = typer.Typer(add_completion=False)


@app.command()
def main(
    nats_url: str = cli.NatsUrl,
    worker_id: str = typer.Option("cache-index-0"),
    snapshot_interval_s: float = typer.Option(5.0, help="seconds between index snapshots"),
    log_level: str = cli.LogLevel,
    drain_timeout_s: float = cli.DrainTimeout,
) -> None:
    from splitserve.services.cache_index.service import CacheIndexService

    run_service(CacheIndexService(worker_id, nats_url, snapshot_interval_s=snapshot_interval_s, log_level=log_level,
                                  drain_timeout_s=drain_timeout_s))


if __name__ == "__main__":
    app()
