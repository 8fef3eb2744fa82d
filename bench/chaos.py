"""Chaos harness: steady load while services are SIGKILLed and restarted at random (seeded).

    python -m bench.chaos --duration 60 --seed 1 [--engine mock] [--kill-every 4] [--json]
    python -m bench.chaos --duration 3600 --auth --nats-nodes 3 --routers 3   # closed, clustered

Starts its own nats-server and services (2 routers, 2 prefillers, 3 decoders, the cache index), computes a
reference output for every prompt with nothing failing, then runs streaming and async requests from several
tenants while it kills (SIGKILL) and restarts one component at a time, chosen at random with the seed:
routers, prefillers, decoders, the cache index and nats-server. ``--auth``: a closed stack as ``splitserve up
--tenants`` runs it (each service as its role's NATS user, each client as its tenant with its own password, the
routers given the tenants file); ``--nats-nodes 3``: a 3-node JetStream cluster (every stream R3), any node of
which may be killed; ``--routers N``: that many routers. At the end it counts what the wire showed (a
tap on ``ss.stream.>`` and ``ss.result.>``) and what the clients got: accepted, completed, failed with a
terminal error (by code), lost (accepted, no terminal message), duplicated (two terminal messages, or one
seq number seen twice), and completed greedy outputs that differ from the reference. The baseline is the same
load with no kills, measured first in the same run (``--baseline-s``; 0 skips it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats

from splitserve import errors, proto
from splitserve.client import Client
from splitserve.natsserver import NatsCluster, NatsServer, free_port, start_nats, start_nats_cluster
from splitserve.proto import StreamDelta, StreamError, StreamFinal
from splitserve.runtime.jetstream import CLUSTER_REPLICAS, ENV_REPLICAS
from splitserve.stackproc import spawn_service, wait_ready
from splitserve.tenancy import natsauth
from splitserve.tenancy.config import load_tenants

TENANTS = ("acme", "globex", "initech")
REF_TENANT = "ref"
PROMPTS = [f"chaos prompt {i}: " + " ".join(["word"] * (4 + 7 * i)) for i in range(8)]
MAX_TOKENS = 24


@dataclass
class Outcome:
    mode: str  # "stream" | "async"
    prompt: int
    accepted: bool = False
    completed: bool = False
    error: str | None = None  # terminal error code
    tokens: list[int] | None = None


@dataclass
class Tap:
    """What the wire showed, per request id. A terminal message is sent live on the stream subject and stored as
    a copy on the result subject, and a publish JetStream did not confirm is retried: all under one
    ``Nats-Msg-Id``, so distinct ids are distinct terminal messages."""

    seqs: dict[str, Counter[int]] = field(default_factory=dict)
    terminal_ids: dict[str, set[str]] = field(default_factory=dict)
    finals: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def terminals(self) -> Counter[str]:
        return Counter({rid: len(ids) for rid, ids in self.terminal_ids.items()})

    def on(self, data: bytes, msg_id: str | None = None) -> None:
        try:
            msg = proto.decode_stream(data)
        except proto.ProtocolError:
            return
        rid = msg.request_id or ""
        if isinstance(msg, StreamDelta):
            self.seqs.setdefault(rid, Counter())[msg.seq] += 1
            return
        if isinstance(msg, StreamFinal):
            self.finals[rid] = list(msg.token_ids)
        elif isinstance(msg, StreamError):
            self.errors[rid] = str(msg.code)
        else:
            return
        self.terminal_ids.setdefault(rid, set()).add(msg_id or uuid.uuid4().hex)


class Cluster:
    """The processes under test, each restartable under its own id."""

    def __init__(self, root: Path, engine: str, step_ms: int, *, monitor: bool = False, auth: bool = False,
                 nats_nodes: int = 1, routers: int = 2) -> None:
        self.root, self.engine = root, engine
        self.logs = root / "logs"
        self.env = dict(os.environ, SPLITSERVE_MOCK_STEP_MS=str(step_ms), SPLITSERVE_MOCK_PREFILL_TPS="4000")
        self.auth: natsauth.StackAuth | None = None
        self.tenants_file: Path | None = None
        # tenant -> password: each client connects as its tenant (None: an open stack, no credentials)
        self.passwords: dict[str, str] | None = None
        auth_conf = ""
        if auth:
            self.passwords = {t: f"chaos-password-of-{t}" for t in (*TENANTS, REF_TENANT)}
            self.tenants_file = root / "tenants.yaml"
            root.mkdir(parents=True, exist_ok=True)
            self.tenants_file.write_text("tenants:\n" + "".join(
                f"  {t}:\n    password: {pw}\n" for t, pw in self.passwords.items()))
            self.auth = natsauth.prepare_stack_auth(root, load_tenants(self.tenants_file))
            auth_conf = self.auth.config
        self.admin = self.auth.credentials(natsauth.ADMIN_ROLE) if self.auth else (None, None)
        self.cluster: NatsCluster | None = None
        mport = free_port() if monitor else None  # nats-server's HTTP monitoring (/subsz, /connz), for bench.soak
        if nats_nodes > 1:
            self.cluster = start_nats_cluster(root / "nats-cluster", nats_nodes, extra_config=auth_conf,
                                              log_dir=self.logs, user=self.admin[0], password=self.admin[1])
            self.nats: NatsServer = self.cluster.nodes[0]
            self.url = self.cluster.url
            self.env[ENV_REPLICAS] = str(CLUSTER_REPLICAS if nats_nodes >= CLUSTER_REPLICAS else 1)
        else:
            self.nats = start_nats(root / "nats", port=None, extra_config=auth_conf +
                                   (f'\nhttp: "127.0.0.1:{mport}"\n' if mport else ""))
            self.nats.monitor_port = mport
            self.url = self.nats.url
        self.names = [*(f"router-{i + 1}" for i in range(routers)), "prefill-1", "prefill-2", "decode-1",
                      "decode-2", "decode-3", "cache-index-1"]
        self.nats_names = ([f"nats-{i}" for i in range(nats_nodes)] if self.cluster is not None else ["nats"])
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str) -> None:
        role = name.rsplit("-", 1)[0]
        if role == "router":
            args = ["splitserve.services.router", "--disagg-threshold", "32", "--max-stall-ms", "0",
                    "--queue-ack-wait-s", "4",
                    "--no-worker-wait-s", "8", "--max-migrations", "4"]
            if self.tenants_file is not None:
                args += ["--tenants", str(self.tenants_file)]
        elif role in ("decode", "prefill"):
            args = [f"splitserve.services.{role}", "--engine", self.engine, "--transport", "tcp"]
        else:
            args = ["splitserve.services.cache_index"]
        env = dict(self.env)
        if self.auth is not None:
            # as splitserve up runs it: each service as its role's NATS user, the password in the environment
            env[natsauth.ENV_USER], env[natsauth.ENV_PASSWORD] = self.auth.credentials(role.replace("-", "_"))
        self.procs[name] = spawn_service(args[0], *args[1:], nats_url=self.url, worker_id=name, log_dir=self.logs,
                                         env=env)

    async def connect_admin(self) -> Any:
        """A NATS connection with the operator's rights (the tap, the soak's samples)."""
        return await nats.connect(self.url.split(","), user=self.admin[0], password=self.admin[1],
                                  max_reconnect_attempts=-1, reconnect_time_wait=0.2)

    async def wait_ready(self, names: list[str], timeout: float) -> None:
        await wait_ready(self.url, names, timeout=timeout, user=self.admin[0], password=self.admin[1])

    def kill(self, name: str) -> None:
        if name == "nats":
            self.nats.proc.kill()
            self.nats.proc.wait()
            return
        if name.startswith("nats-"):
            assert self.cluster is not None
            self.cluster.kill(int(name.rsplit("-", 1)[1]))
            return
        p = self.procs[name]
        if p.poll() is None:
            p.kill()
            p.wait()

    def restart(self, name: str) -> None:
        if name == "nats":
            self.nats.restart()
        elif name.startswith("nats-"):
            assert self.cluster is not None
            self.cluster.restart(int(name.rsplit("-", 1)[1]))
        else:
            self.spawn(name)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.cluster is not None:
            self.cluster.stop()
        else:
            self.nats.stop()


async def _one(c: Client, rng: random.Random, out: dict[str, Outcome], tenant: str) -> None:
    i = rng.randrange(len(PROMPTS))
    if rng.random() < 0.7:
        gen = c.generate(PROMPTS[i], max_tokens=MAX_TOKENS, tenant=tenant)
        o = out[gen.request_id] = Outcome("stream", i)
        try:
            done = await gen.collect()
            o.completed, o.tokens = True, done.token_ids
        except errors.SplitserveError as exc:
            # only a terminal message from the server counts as a failure; a client-side timeout or gap is
            # judged from the wire tap at the end (completed there, or lost)
            o.error = str(exc.code) if gen._server_ended else None
        except Exception:
            pass
        o.accepted = gen.accepted is not None
        return
    try:
        rid = await c.submit(PROMPTS[i], max_tokens=MAX_TOKENS, tenant=tenant)
    except Exception:
        return  # not accepted: refused, or no router reachable
    o = out[rid] = Outcome("async", i, accepted=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            res = await c.result(rid, tenant=tenant, wait=5)
        except errors.SplitserveError as exc:
            if exc.code in (proto.ErrorCode.INTERNAL, proto.ErrorCode.TIMEOUT) and "result" not in str(exc):
                await asyncio.sleep(0.5)  # the server itself may be down: ask again
                continue
            o.error = str(exc.code)
            return
        except Exception:
            await asyncio.sleep(0.5)
            continue
        if res is not None:
            o.completed, o.tokens = True, res.token_ids
            return


def _client(url: str, tenant: str, passwords: dict[str, str] | None, **kw: Any) -> Client:
    if passwords is None:
        return Client(url, **kw)
    return Client(url, user=tenant, password=passwords[tenant], **kw)


async def _load(url: str, seconds: float, seed: int, out: dict[str, Outcome], clients: int,
                passwords: dict[str, str] | None = None) -> None:
    """``clients`` SDK clients, client k as tenant ``TENANTS[k % 3]`` (with that tenant's credentials on a
    closed stack), each sending one request after another until ``seconds`` have passed."""
    stop_at = time.monotonic() + seconds

    async def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        tenant = TENANTS[k % len(TENANTS)]
        async with _client(url, tenant, passwords, idle_timeout=30, accept_timeout=10) as c:
            while time.monotonic() < stop_at:
                await _one(c, rng, out, tenant)

    await asyncio.gather(*(worker(k) for k in range(clients)))


async def _reference(url: str, passwords: dict[str, str] | None = None) -> list[list[int]]:
    async with _client(url, REF_TENANT, passwords, idle_timeout=60) as c:
        return [(await c.generate(p, max_tokens=MAX_TOKENS, tenant=REF_TENANT).collect()).token_ids
                for p in PROMPTS]


def _summarise(out: dict[str, Outcome], tap: Tap, reference: list[list[int]]) -> dict[str, Any]:
    accepted = [rid for rid, o in out.items() if o.accepted]
    for rid in accepted:  # what the wire showed completes what the client saw
        o = out[rid]
        if not o.completed and rid in tap.finals:
            o.completed, o.tokens = True, tap.finals[rid]
        if not o.completed and o.error is None and rid in tap.errors:
            o.error = tap.errors[rid]
    failed = Counter(o.error for rid, o in out.items() if o.accepted and not o.completed and o.error)
    lost = [rid for rid in accepted if not out[rid].completed and not out[rid].error]
    terminals = tap.terminals  # (built once: a property over every request)
    dup = [rid for rid in accepted if terminals[rid] > 1 or any(n > 1 for n in tap.seqs.get(rid, {}).values())]
    mismatch = [rid for rid in accepted if out[rid].completed and out[rid].tokens != reference[out[rid].prompt]]
    return {"accepted": len(accepted), "completed": sum(out[r].completed for r in accepted),
            "failed_by_code": dict(failed), "lost": len(lost), "duplicated": len(dup), "mismatched": len(mismatch),
            "not_accepted": len(out) - len(accepted), "lost_ids": lost[:5], "duplicated_ids": dup[:5],
            "mismatched_ids": mismatch[:5]}


async def run(duration: float, seed: int, kill_every: float, restart_after: float, clients: int, engine: str,
              step_ms: int, baseline_s: float, root: Path, *, auth: bool = False, nats_nodes: int = 1,
              routers: int = 2) -> dict[str, Any]:
    # (off the event loop: a cluster's start waits for its JetStream meta leader with a loop of its own)
    cluster = await asyncio.to_thread(lambda: Cluster(root, engine, step_ms, auth=auth, nats_nodes=nats_nodes,
                                                      routers=routers))
    for n in cluster.names:
        cluster.spawn(n)
    tap = Tap()
    pw = cluster.passwords
    try:
        await cluster.wait_ready(cluster.names, timeout=300)
        reference = await _reference(cluster.url, pw)
        tap_nc = await cluster.connect_admin()

        async def on_tap(m: Any) -> None:
            tap.on(m.data, (m.headers or {}).get("Nats-Msg-Id"))

        for subj in ("ss.stream.>", "ss.result.>"):
            await tap_nc.subscribe(subj, cb=on_tap)
        report: dict[str, Any] = {"seed": seed, "duration_s": duration, "clients": clients, "engine": engine,
                                  "auth": auth, "nats_nodes": nats_nodes, "routers": routers}
        if baseline_s > 0:
            base: dict[str, Outcome] = {}
            await _load(cluster.url, baseline_s, seed + 1, base, clients, pw)
            report["baseline"] = _summarise(base, tap, reference)
        out: dict[str, Outcome] = {}
        kills: Counter[str] = Counter()
        rng = random.Random(seed)
        targets = [*cluster.names, *cluster.nats_names]
        t0 = time.monotonic()
        load = asyncio.ensure_future(_load(cluster.url, duration, seed, out, clients, pw))
        t_end = t0 + duration
        while time.monotonic() < t_end - restart_after:
            await asyncio.sleep(rng.uniform(0.5, 1.5) * kill_every)
            victim = rng.choice(targets)
            kills[victim.rsplit("-", 1)[0]] += 1
            print(f"  t={time.monotonic() - t0:6.1f}s SIGKILL {victim}  (requests so far {len(out)})", flush=True)
            cluster.kill(victim)
            await asyncio.sleep(restart_after)
            cluster.restart(victim)
            if not victim.startswith("nats"):
                await cluster.wait_ready([victim], timeout=120)
        await asyncio.wait_for(load, duration + 180)
        await asyncio.sleep(2)  # the tap's last messages
        report["kills"] = dict(kills)
        report["chaos"] = _summarise(out, tap, reference)
        await tap_nc.close()
        return report
    finally:
        cluster.stop()


def _print(report: dict[str, Any]) -> None:
    rows = [("kills", json.dumps(report.get("kills", {})))]
    for name in ("baseline", "chaos"):
        r = report.get(name)
        if r is None:
            continue
        rows += [(f"{name}: accepted", r["accepted"]), (f"{name}: completed", r["completed"]),
                 (f"{name}: failed (by code)", json.dumps(r["failed_by_code"])), (f"{name}: lost", r["lost"]),
                 (f"{name}: duplicated", r["duplicated"]), (f"{name}: output mismatches", r["mismatched"]),
                 (f"{name}: not accepted", r["not_accepted"])]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load under chaos")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kill-every", type=float, default=5.0, help="mean seconds between kills")
    ap.add_argument("--restart-after", type=float, default=1.0, help="seconds a killed component stays down")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--engine", default="mock", help="mock | hf")
    ap.add_argument("--step-ms", type=int, default=10, help="mock engine decode step")
    ap.add_argument("--baseline-s", type=float, default=10.0, help="seconds of the same load with no kills first")
    ap.add_argument("--auth", action="store_true", help="a closed stack: services and tenants authenticate")
    ap.add_argument("--nats-nodes", type=int, default=1, help="nats-servers (3: a JetStream cluster, streams R3)")
    ap.add_argument("--routers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--state-dir", default=None)
    a = ap.parse_args(argv)
    root = Path(a.state_dir or tempfile.mkdtemp(prefix="ss-chaos-"))
    report = asyncio.run(run(a.duration, a.seed, a.kill_every, a.restart_after, a.clients, a.engine, a.step_ms,
                             a.baseline_s, root, auth=a.auth, nats_nodes=a.nats_nodes, routers=a.routers))
    if a.json:
        print(json.dumps(report))
    else:
        _print(report)
    chaos = report["chaos"]
    return 0 if chaos["lost"] == 0 and chaos["duplicated"] == 0 and chaos["mismatched"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
