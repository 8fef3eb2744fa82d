"""The live runner of :mod:`bench.slo_goodput`: the same mixed-SLO workload replayed against a real stack.

Per setting a fresh ``splitserve up --engine mock`` (every service its own process, real NATS with one user per
tenant, the tenants' SLOs in its tenants file), routed by the setting's strategy, ``--slo-admission`` when the
setting has admission. The mock engine stands in for the model with a step that grows with the batch
(``SPLITSERVE_MOCK_STEP_MS`` + ``SPLITSERVE_MOCK_STEP_MS_PER_SEQ`` per sequence) and a prefill rate, so
where a request lands decides its latency as on real workers. The workload is scaled to what two CPU cores
replay (:func:`scaled`): prompt lengths divided by ``prompt_scale``, outputs capped at ``max_output``. Each
tenant's prompts start with one of a few shared prefixes (a system prompt), so the cache-aware cost has affinity
to trade against load.

Every request is sent at its arrival time as token ids (its exact length), streamed, and measured at the client:
TTFT (sent -> first delta) and ITL (mean gap between the following deltas); a ``slo_unattainable`` refusal is
counted as refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import tempfile
import time
from pathlib import Path

from bench.slo_goodput import Outcome, Runner, Setting, Workload
from splitserve import errors
from splitserve.client import Client
from splitserve.stackproc import start_stack

PREFIXES = 4  # shared prefixes per tenant
TOKEN_BASE = 1000  # prompt ids are drawn from [TOKEN_BASE, TOKEN_BASE + 20000): ordinary ids of the bundled model


def scaled(w: Workload, prompt_scale: float = 4.0, max_output: int = 48) -> Workload:
    """``w`` with prompts ``prompt_scale`` times shorter and outputs at most ``max_output`` tokens."""
    reqs = [dataclasses.replace(r, prompt_tokens=max(8, int(r.prompt_tokens / prompt_scale)),
                                output_tokens=max(2, min(max_output, r.output_tokens)), _hashes=None, _hash_bs=0)
            for r in w.requests]
    return Workload(reqs, w.tenants, w.duration_s)


def _prompt(tenant: str, i: int, n: int, rng: random.Random) -> list[int]:
    prefix_rng = random.Random(f"{tenant}-{i % PREFIXES}")  # the same system prompt for a tenant's group
    head = [TOKEN_BASE + prefix_rng.randrange(20000) for _ in range(n // 2)]
    return head + [TOKEN_BASE + rng.randrange(20000) for _ in range(n - len(head))]


def live_runner(prefill: int = 0, decode: int = 2, step_ms: float = 8.0, step_ms_per_seq: float = 1.5,
                prefill_tps: float = 20_000.0) -> Runner:
    def run(w: Workload, s: Setting) -> list[Outcome]:
        with tempfile.TemporaryDirectory(prefix="slo-live-") as tmp:
            pw = {t: f"{t}-password-1" for t in w.tenants}
            tenants = Path(tmp) / "tenants.yaml"
            tenants.write_text("tenants:\n" + "".join(
                f"  {t.name}:\n    password: {pw[t.name]}\n"
                f"    slo: {{ttft_p99_ms: {t.ttft_ms:g}, itl_p99_ms: {t.itl_ms:g}}}\n" for t in w.tenants.values()))
            env = dict(os.environ, SPLITSERVE_MOCK_STEP_MS=str(step_ms),
                       SPLITSERVE_MOCK_STEP_MS_PER_SEQ=str(step_ms_per_seq),
                       SPLITSERVE_MOCK_PREFILL_TPS=str(prefill_tps))
            sp = start_stack(Path(tmp) / "state", "--engine", "mock", "--prefill", str(prefill), "--decode",
                             str(decode), "--frontends", "1", "--tenants", str(tenants), "--strategy", s.strategy,
                             *(["--slo-admission"] if s.admission else []), env=env)
            try:
                return asyncio.run(_replay(sp.nats_url, w, pw))
            finally:
                sp.stop()
    return run


async def _replay(url: str, w: Workload, pw: dict[str, str]) -> list[Outcome]:
    rng = random.Random(7)
    clients = {t: Client(url, user=t, password=pw[t], idle_timeout=120) for t in w.tenants}
    for c in clients.values():
        await c.connect()
    try:
        # warm: every service has served each tenant once (connections, lanes, the routers' views)
        await asyncio.gather(*(c.complete([TOKEN_BASE + 1] * 16, max_tokens=4) for c in clients.values()))
        await asyncio.sleep(1.0)
        t0 = time.monotonic()

        async def one(i: int) -> Outcome:
            r = w.requests[i]
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.monotonic()))
            ids = _prompt(r.tenant, i, r.prompt_tokens, rng)
            sent = time.perf_counter()
            times: list[float] = []
            try:
                async for d in clients[r.tenant].generate(ids, max_tokens=r.output_tokens, temperature=0.0):
                    if d.token_ids:
                        times.append(time.perf_counter())
            except errors.SloUnattainable:
                return Outcome(r.request_id, r.tenant, True)
            except errors.SplitserveError:
                return Outcome(r.request_id, r.tenant, False)
            if not times:
                return Outcome(r.request_id, r.tenant, False)
            itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
            return Outcome(r.request_id, r.tenant, False, times[0] - sent, itl)

        return list(await asyncio.gather(*(one(i) for i in range(len(w.requests)))))
    finally:
        for c in clients.values():
            await c.close()
