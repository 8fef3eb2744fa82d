"""A NATS restart: the router and a connected client reconnect by themselves and serve again, with
precise answers throughout (no hang, no crash)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from splitserve import errors
from splitserve.client import Client
from splitserve.natsserver import start_nats
from tests.procs import spawn_service, stop, wait_ready

pytestmark = pytest.mark.slow  # the router loads the tokenizer


def test_router_and_client_survive_a_nats_restart(tmp_path: Path) -> None:
    srv = start_nats(tmp_path / "nats", port=None)
    router = spawn_service("splitserve.services.router", "--no-worker-wait-s", "0.5", nats_url=srv.url,
                           worker_id="router-r",
                           log_dir=tmp_path)
    try:
        asyncio.run(wait_ready(srv.url, ["router-r"], timeout=120))

        async def scenario() -> None:
            async with Client(srv.url, tenant="acme", accept_timeout=10) as c:
                with pytest.raises(errors.NoWorkers):  # the router answers before the restart
                    await c.complete("hello", max_tokens=2)
                srv.proc.terminate()
                srv.proc.wait(10)
                # While NATS is down a request fails precisely instead of hanging.
                t0 = time.monotonic()
                with pytest.raises(errors.SplitserveError):
                    await c.complete("hello", max_tokens=2)
                assert time.monotonic() - t0 < 20
                # Same config, same port, same store: NATS is back.
                await asyncio.to_thread(srv.restart)
                deadline = time.monotonic() + 30
                while True:  # both the client and the router reconnect on their own
                    try:
                        await c.complete("hello", max_tokens=2)
                    except errors.NoWorkers:
                        break  # the router is serving again: the precise no-workers answer is back
                    except errors.SplitserveError:
                        assert time.monotonic() < deadline, "no recovery within 30 s of NATS coming back"
                        await asyncio.sleep(0.5)
        asyncio.run(scenario())
        assert router.poll() is None, "the router must stay up across a NATS restart"
    finally:
        stop(router)
        srv.stop()
