"""splitserve beside the Rust routers, one run, one machine: vllm-router and sglang-router against the same
zero-cost workers, and splitserve's whole path (HTTP front door, router, durable queue, decoders) on its
zero-cost ``mock`` engine.

Targets (``--targets``, all by default):

* ``direct``: the load generator straight to one zero-cost HTTP worker per request, round robin (the floor);
* ``vllm-rr`` / ``vllm-ca``: vllm-router with ``round_robin`` / ``cache_aware`` over those workers;
* ``sglang-ca``: sglang-router with ``cache_aware`` over those workers;
* ``splitserve``: ``splitserve up --engine mock`` (step and prefill times zero), its front door's
  ``/v1/completions``, with the durable queue on; its own nats-server's monitoring counts the NATS messages
  each service sends and receives per request (JetStream API calls and acks included);
* ``splitserve-bare``: the same stack with three of its per-request features off: the durable queue
  (``SPLITSERVE_ROUTER_QUEUE=false``: dispatched at once, not stored), tracing (``SPLITSERVE_TRACING=off``) and
  the per-request log lines (``--log-level WARNING``). Not a way to run it: what those features cost, and what
  the rest of the path costs without them, in the same table.

The peers are not project dependencies: they live in their own venv (``--peers-venv``, default
``/tmp/splitserve-peers``), created with pinned versions on first use (``make bench-peers``). A target whose
program is missing is reported as skipped. The zero-cost workers (``python -m bench.peers worker``) speak
enough of the OpenAI API for the routers (``/health``, ``/v1/models``, streaming ``/v1/completions``) and
answer at once: what is measured is the router's own cost.

Each target gets the same workload: prompts of ``--prompt-chars`` characters (a shared prefix from one of eight
groups, so cache-aware policies have something to find, then a unique part), ``--max-tokens`` tokens streamed
back. TTFT at concurrency 1 is request sent -> first token text; throughput is a closed loop of
``--requests`` requests at each ``--concurrency``. Every figure is printed beside ``direct``'s from the same
run (the ratio column): the machine is shared, so only same-run comparisons mean anything.

``--stream-interval 1,8`` runs splitserve once per value (its decoders' tokens per stream delta, as vLLM's
option): the same stack sending each token at once and 8 at a time, in the same run.

    python -m bench.peers [--targets direct,vllm-rr,vllm-ca,sglang-ca,splitserve] [--requests 2000]
        [--concurrency 32,128] [--ttft-requests 200] [--workers 2] [--stream-interval 1] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.stats import cpu_seconds, summary

PEERS_VENV = Path(os.environ.get("SPLITSERVE_PEERS_VENV", "/tmp/splitserve-peers"))
PEER_PINS = ("vllm-router==0.1.17", "sglang-router==0.3.2")
MODEL = "mock-peer"
TARGETS = ("direct", "vllm-rr", "vllm-ca", "sglang-ca", "floor-1hop", "floor-2hop", "splitserve", "splitserve-bare")
# splitserve-bare: what the stack is told to leave out (see the module docstring)
BARE_ENV = {"SPLITSERVE_ROUTER_QUEUE": "false", "SPLITSERVE_TRACING": "off"}
BARE_ARGS = ("--log-level", "WARNING")


# ------------------------------------------------------------------------------------- zero-cost worker

def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def lifespan(receive: Receive, send: Send, on_startup: Callable[[], Awaitable[None]] | None = None) -> None:
    """Answer an ASGI lifespan scope (``on_startup`` run before startup completes) until shutdown."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            if on_startup is not None:
                await on_startup()
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def read_body(receive: Receive) -> bytes:
    """An ASGI HTTP request's whole body."""
    body = b""
    more = True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    return body


async def worker_app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """A raw ASGI OpenAI-ish server that answers at once (no framework: its own cost stays out of the way)."""
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    path, method = scope["path"], scope["method"]
    body = await read_body(receive)
    if method == "GET":
        if path in ("/v1/models", "/models"):
            out: Any = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
        elif path in ("/get_model_info", "/model_info"):
            out = {"model_path": MODEL, "tokenizer_path": None, "is_generation": True}
        elif path in ("/get_server_info", "/server_info"):
            out = {"model_path": MODEL}
        else:  # /health, /health_generate, /healthz, /ping
            out = {}
        data = json.dumps(out).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})
        return
    req = json.loads(body or b"{}")
    n = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
    chat = path.endswith("chat/completions")
    rid = f"cmpl-{id(req):x}"
    if not req.get("stream"):
        text = "x " * n
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                   "finish_reason": "length"} if chat else
                                  {"index": 0, "text": text, "finish_reason": "length"})
        data = json.dumps({"id": rid, "object": "chat.completion" if chat else "text_completion",
                           "model": MODEL, "choices": [choice],
                           "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
    kind = "chat.completion.chunk" if chat else "text_completion"
    chunks = []
    for i in range(n):
        delta: dict[str, Any] = ({"index": 0, "delta": {"content": "x "}, "finish_reason": None} if chat
                                 else {"index": 0, "text": "x ", "finish_reason": None})
        if i == n - 1:
            delta["finish_reason"] = "length"
        chunks.append(_sse({"id": rid, "object": kind, "model": MODEL, "choices": [delta]}))
    chunks.append(b"data: [DONE]\n\n")
    await send({"type": "http.response.body", "body": b"".join(chunks)})


def serve_worker(port: int) -> None:
    import uvicorn

    uvicorn.run(worker_app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                loop="uvloop", http="httptools", lifespan="on")


# -------------------------------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-3000:]
        return ""


def spawn(name: str, cmd: list[str], logs: Path, env: dict[str, str] | None = None) -> Proc:
    log = logs / f"{name}.log"
    fh = log.open("wb")
    p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                         start_new_session=True)
    return Proc(name, p, log)


def wait_http(url: str, proc: Proc, timeout: float = 120.0, path: str = "/v1/models") -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited (rc {proc.popen.returncode}):\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} did not answer {url}{path} within {timeout:.0f}s:\n{proc.tail()}")


def ensure_peers(venv: Path = PEERS_VENV) -> Path:
    """The peers' own venv, created (pinned versions installed) if missing; returns its bin folder."""
    bin_dir = venv / "bin"
    if not (bin_dir / "vllm-router").exists() or not (bin_dir / "sglang-router").exists():
        base = Path(getattr(sys, "_base_executable", sys.executable))
        subprocess.run([str(base), "-m", "venv", str(venv)], check=True)
        subprocess.run([str(bin_dir / "pip"), "install", "-q", *PEER_PINS], check=True)
    return bin_dir


# ------------------------------------------------------------------------------------------------ load

def prompts(n: int, chars: int, tag: str) -> list[str]:
    """``n`` prompts of ``chars`` characters: one of eight shared prefixes (half), then a unique part."""
    groups = [f"Group {g} system prompt: answer as an assistant for team {g}. " for g in range(8)]
    out = []
    for i in range(n):
        head = (groups[i % 8] * 20)[: chars // 2]
        tail = f" {tag} request {i}: " + "tell me about the sea and the tides " * 20
        out.append((head + tail)[:chars])
    return out


@dataclass
class Result:
    target: str
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    rps: dict[int, float] = field(default_factory=dict)
    errors: int = 0
    skipped: str | None = None
    nats_msgs_per_request: dict[str, float] = field(default_factory=dict)  # splitserve: by service, in + out
    cpu_us_per_request: dict[str, float] = field(default_factory=dict)  # splitserve: CPU by service kind


async def _one(session: Any, url: str, prompt: str, max_tokens: int, model: str) -> float:
    """One streaming completion; returns the TTFT in ms (raises on an error)."""
    t0 = time.perf_counter()
    first: float | None = None
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if first is None:
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"])[:300])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = time.perf_counter()
    return ((first or time.perf_counter()) - t0) * 1000


async def measure(target: str, urls: list[str], model: str, args: argparse.Namespace) -> Result:
    import aiohttp

    res = Result(target)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        rr = 0

        def next_url() -> str:
            nonlocal rr
            rr += 1
            return urls[rr % len(urls)]

        warm = prompts(20, args.prompt_chars, f"warm-{target}")
        for p in warm:
            await _one(session, next_url(), p, args.max_tokens, model)
        ttfts = []
        for p in prompts(args.ttft_requests, args.prompt_chars, f"c1-{target}"):
            try:
                ttfts.append(await _one(session, next_url(), p, args.max_tokens, model))
            except Exception:
                res.errors += 1
        res.ttft_ms = summary(ttfts) if ttfts else {}
        for c in args.concurrency:
            todo = prompts(args.requests, args.prompt_chars, f"c{c}-{target}")
            async def loop(it: Iterator[str]) -> None:
                for p in it:
                    try:
                        await _one(session, next_url(), p, args.max_tokens, model)
                    except Exception:
                        res.errors += 1

            t0 = time.perf_counter()
            shared = iter(todo)  # every connection takes the next prompt: a closed loop of c outstanding
            await asyncio.gather(*(loop(shared) for _ in range(c)))
            res.rps[c] = len(todo) / (time.perf_counter() - t0)
    return res


# ------------------------------------------------------------------------------------------------ runs

def run_target(target: str, args: argparse.Namespace, logs: Path, workers: list[str], peers: Path | None,
               interval: int = 1) -> Result:
    procs: list[Proc] = []
    try:
        if target == "direct":
            return asyncio.run(measure(target, workers, MODEL, args))
        if target in ("vllm-rr", "vllm-ca", "sglang-ca"):
            exe = None if peers is None else peers / ("sglang-router" if target == "sglang-ca" else "vllm-router")
            if exe is None or not exe.exists():
                return Result(target, skipped=f"{exe or 'the peers venv'} is missing (make bench-peers installs it)")
            port = free_port()
            policy = "round_robin" if target == "vllm-rr" else "cache_aware"
            cmd = [str(exe), *(["launch"] if target == "sglang-ca" else []), "--host", "127.0.0.1", "--port",
                   str(port), "--worker-urls", *workers, "--policy", policy, "--log-level",
                   "warn" if target == "sglang-ca" else "warning"]
            procs.append(spawn(target, cmd, logs))
            url = f"http://127.0.0.1:{port}"
            wait_http(url, procs[-1], path="/health")
            time.sleep(1.0)  # the router's first health checks of the workers
            return asyncio.run(measure(target, [url], MODEL, args))
        if target in ("floor-1hop", "floor-2hop"):
            return run_floor(target, args, logs)
        if target in ("splitserve", "splitserve-bare"):
            from splitserve.natsserver import start_nats
            from splitserve.stackproc import start_stack

            bare = target == "splitserve-bare"
            # zero-cost engine: no step time, no prefill time (what the peers' workers cost)
            env = {**os.environ, "SPLITSERVE_MOCK_STEP_MS": "0", "SPLITSERVE_MOCK_PREFILL_TPS": "1e12",
                   **(BARE_ENV if bare else {})}
            # its own nats-server with monitoring: the messages each service sends and receives per request
            nats = start_nats(logs / f"nats-{target}-{interval}", monitor=True)
            sp = start_stack(logs / f"{target}-{interval}", "--engine", "mock", "--prefill", "1", "--decode",
                             str(args.workers), "--nats-url", nats.url, "--stream-interval", str(interval),
                             *(BARE_ARGS if bare else ()), env=env)
            try:
                import urllib.request

                assert sp.http_url is not None, "splitserve up printed no front door URL"
                with urllib.request.urlopen(sp.http_url + "/v1/models", timeout=10) as r:
                    model = json.loads(r.read())["data"][0]["id"]
                before = _msgs_by_service(nats.connections())
                pids = _stack_processes(sp.proc.pid, nats.proc.pid)
                cpu0 = cpu_seconds(pids)
                res = asyncio.run(measure(target, [sp.http_url], model, args))
                cpu1 = cpu_seconds(pids)
                after = _msgs_by_service(nats.connections())
                n = 20 + args.ttft_requests + args.requests * len(args.concurrency)
                res.nats_msgs_per_request = {k: round((after.get(k, 0) - before.get(k, 0)) / n, 2)
                                             for k in sorted(after)}
                res.cpu_us_per_request = {k: round((cpu1.get(k, 0.0) - cpu0.get(k, 0.0)) / n * 1e6)
                                          for k in sorted(cpu1)}
                return res
            finally:
                sp.stop()
                nats.stop()
        raise ValueError(f"unknown target {target!r}")
    finally:
        for p in procs:
            p.stop()


def wait_line(proc: Proc, line: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited (rc {proc.popen.returncode}):\n{proc.tail()}")
        if line in proc.tail():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} did not print {line!r} within {timeout:.0f}s:\n{proc.tail()}")


def run_floor(target: str, args: argparse.Namespace, logs: Path) -> Result:
    """The design's floor (bench/floor.py): its processes on their own nats-server; CPU per request of each."""
    from splitserve.natsserver import start_nats

    hops = 1 if target == "floor-1hop" else 2
    nats = start_nats(logs / f"nats-{target}")
    procs: list[Proc] = []
    try:
        base = [sys.executable, "-m", "bench.floor"]
        for i in range(args.workers):
            procs.append(spawn(f"{target}-worker-{i}", [*base, "worker", "--nats-url", nats.url, "--index", str(i),
                                                         "--hops", str(hops)], logs))
        if hops == 2:
            procs.append(spawn(f"{target}-router", [*base, "router", "--nats-url", nats.url, "--workers",
                                                     str(args.workers)], logs))
        for p in procs:
            wait_line(p, "ready")
        port = free_port()
        procs.append(spawn(f"{target}-front", [*base, "front", "--nats-url", nats.url, "--port", str(port),
                                                "--hops", str(hops)], logs))
        url = f"http://127.0.0.1:{port}"
        wait_http(url, procs[-1])
        groups: dict[str, list[int]] = {}
        for p in procs:  # by kind: front, router, worker
            groups.setdefault(p.name.removeprefix(f"{target}-").split("-")[0], []).append(p.popen.pid)
        groups["nats"] = [nats.proc.pid]
        cpu0 = cpu_seconds(groups)
        res = asyncio.run(measure(target, [url], "floor", args))
        cpu1 = cpu_seconds(groups)
        n = 20 + args.ttft_requests + args.requests * len(args.concurrency)
        res.cpu_us_per_request = {k: round((cpu1[k] - cpu0[k]) / n * 1e6) for k in sorted(cpu1)}
        return res
    finally:
        for p in procs:
            p.stop()
        nats.stop()


def _stack_processes(up_pid: int, nats_pid: int) -> dict[str, list[int]]:
    """Pids of a running stack by service kind: ``up`` (the supervisor), its services by their module
    (``splitserve.services.<kind>``) and the nats-server."""
    import psutil

    out: dict[str, list[int]] = {"supervisor": [up_pid], "nats": [nats_pid]}
    for child in psutil.Process(up_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            kind = next((part.split(".")[2] for part in child.cmdline() if part.startswith("splitserve.services.")),
                        "other")
            out.setdefault(kind, []).append(child.pid)
    return out


def _msgs_by_service(conns: list[dict[str, Any]]) -> dict[str, int]:
    """NATS messages in + out per service kind (a connection's name is ``role:worker-id``)."""
    out: dict[str, int] = {}
    for c in conns:
        role = str(c.get("name") or "other").split(":")[0]
        out[role] = out.get(role, 0) + int(c.get("in_msgs") or 0) + int(c.get("out_msgs") or 0)
    return out


def report(results: list[Result], args: argparse.Namespace) -> None:
    base = next((r for r in results if r.target == "direct" and not r.skipped), None)
    cs = args.concurrency
    head = f"{'target':<16} {'TTFT p50 / p99 at c=1 (ms)':>28} " + " ".join(f"{'req/s c=' + str(c):>16}" for c in cs)
    print(head)
    print("-" * len(head))
    for r in results:
        if r.skipped:
            print(f"{r.target:<16} skipped: {r.skipped}")
            continue
        t = r.ttft_ms
        ttft = f"{t.get('p50') or float('nan'):.2f} / {t.get('p99') or float('nan'):.2f}"
        cells = []
        for c in cs:
            v = r.rps.get(c, float("nan"))
            ratio = f" ({v / base.rps[c]:.2f}x)" if base is not None and base.rps.get(c) else ""
            cells.append(f"{v:>8.0f}{ratio:>8}")
        print(f"{r.target:<16} {ttft:>28} " + " ".join(f"{c:>16}" for c in cells)
              + (f"  errors {r.errors}" if r.errors else ""))
    if base is not None:
        print(f"(ratios: req/s over direct's in the same run; {args.requests} requests per point, "
              f"{args.prompt_chars}-character prompts, {args.max_tokens} tokens)")
    for r in results:
        if r.nats_msgs_per_request:
            total = sum(r.nats_msgs_per_request.values())
            parts = ", ".join(f"{k} {v:g}" for k, v in r.nats_msgs_per_request.items())
            print(f"{r.target}: NATS messages per request (in + out, by service): {parts}; total {total:.1f}")
        if r.cpu_us_per_request:
            total = sum(r.cpu_us_per_request.values())
            parts = ", ".join(f"{k} {v:,.0f}" for k, v in r.cpu_us_per_request.items())
            print(f"{r.target}: CPU per request (us, user + system, all points, by service kind): {parts}; "
                  f"total {total:,.0f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker", help="run one zero-cost OpenAI-ish worker")
    w.add_argument("--port", type=int, required=True)
    sub.add_parser("install", help="create the peers' venv (pinned vllm-router, sglang-router)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", default="32,128")
    ap.add_argument("--ttft-requests", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2, help="zero-cost workers (splitserve: decoders)")
    ap.add_argument("--prompt-chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stream-interval", default="1",
                    help="splitserve's decoders' tokens per stream delta (vLLM's --stream-interval); several, "
                         "comma-separated (e.g. 1,8), run splitserve once each, in the same run")
    ap.add_argument("--peers-venv", type=Path, default=PEERS_VENV)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "worker":
        serve_worker(args.port)
        return
    if args.cmd == "install":
        print(ensure_peers(args.peers_venv))
        return
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    targets = [t for t in args.targets.split(",") if t]
    peers = args.peers_venv / "bin" if (args.peers_venv / "bin").exists() else None
    logs = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    workers: list[Proc] = []
    try:
        urls = []
        for i in range(args.workers):
            port = free_port()
            workers.append(spawn(f"worker-{i}", [sys.executable, "-m", "bench.peers", "worker", "--port",
                                                 str(port)], logs))
            urls.append(f"http://127.0.0.1:{port}")
        for url, p in zip(urls, workers, strict=True):
            wait_http(url, p)
        results = []
        intervals = [int(i) for i in str(args.stream_interval).split(",") if i]
        for t in targets:
            per_interval = t == "splitserve"
            for interval in (intervals if per_interval else [1]):
                print(f"... {t}" + (f" (stream interval {interval})" if per_interval else ""), file=sys.stderr,
                      flush=True)
                res = run_target(t, args, logs, urls, peers, interval)
                if per_interval and intervals != [1]:
                    res.target = f"splitserve si={interval}"
                results.append(res)
    finally:
        for p in workers:
            p.stop()
    if args.json:
        print(json.dumps([r.__dict__ for r in results], default=str, indent=2))
    else:
        report(results, args)


if __name__ == "__main__":
    main()
