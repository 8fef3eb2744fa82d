"""``--served-model-name``: a worker announces the name it serves its model under in its heartbeats (what routers
match a request's model against), its engine keeping its own name. Real nats-server, mock-engine workers."""

from __future__ import annotations

from pathlib import Path

from splitserve.natsserver import NatsServer
from tests.procs import spawn_service, stop, wait_ready

NAME = "org/small-20l"


async def test_workers_announce_their_served_model_name(nats_server: NatsServer, tmp_path: Path) -> None:
    url, logs = nats_server.url, tmp_path / "logs"
    procs = [spawn_service("splitserve.services.decode", "--engine", "mock", "--transport", "tcp",
                           "--served-model-name", NAME, nats_url=url, worker_id="decode-named", log_dir=logs),
             spawn_service("splitserve.services.prefill", "--engine", "mock", "--transport", "tcp",
                           "--served-model-name", NAME, nats_url=url, worker_id="prefill-named", log_dir=logs)]
    try:
        hbs = await wait_ready(url, ["decode-named", "prefill-named"], timeout=120)
        for worker, role in (("decode-named", "decode"), ("prefill-named", "prefill")):
            hb = hbs[worker]
            assert (hb.role, hb.model, hb.engine) == (role, NAME, "mock"), hb
    finally:
        stop(*procs)
        for name in ("decode-named", "prefill-named"):
            log = logs / f"{name}.log"
            print(f"--- {name}\n{log.read_text(errors='replace')[-3000:] if log.exists() else ''}")
