"""Pure pieces of the stack and runtime: core-set parsing, prefill/decode core pools, worker liveness."""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest

from splitserve.proto import Heartbeat
from splitserve.runtime.registry import WorkerRegistry
from splitserve.services.common.options import parse_cpus
from splitserve.stack import Stack, StackConfig


@pytest.mark.parametrize(
    ("spec", "want"),
    [(None, None), ("", None), ("0", (0,)), ("0,2", (0, 2)), ("0-3", (0, 1, 2, 3)), ("4,0-1,1", (0, 1, 4))],
)
def test_parse_cpus(spec: str | None, want: tuple[int, ...] | None) -> None:
    assert parse_cpus(spec) == want


def _pools(cores: list[int], **cfg: object) -> dict[str, list[int]]:
    return _stack(cores, **cfg).pools


def _stack(cores: list[int], **cfg: object) -> Stack:
    with mock.patch("os.sched_getaffinity", return_value=set(cores)):
        stack = Stack(StackConfig(state_dir=Path("/tmp/unused"), **cfg))  # type: ignore[arg-type]
    stack.nats_url = "nats://127.0.0.1:4222"
    return stack


def test_default_pools_are_disjoint_halves() -> None:
    assert _pools([0, 1]) == {"prefill": [0], "decode": [1]}
    p = _pools(list(range(8)), prefill=2, decode=2)
    assert p == {"prefill": [0, 1, 2, 3], "decode": [4, 5, 6, 7]}


def test_colocated_and_explicit_pools() -> None:
    assert _pools([0, 1], colocated=True) == {"decode": [0, 1]}
    assert _pools([0, 1, 2, 3], prefill_cpus="3", decode_cpus="0-2") == {"prefill": [3], "decode": [0, 1, 2]}
    assert _pools([0]) == {}  # one core: nothing to separate


def test_worker_children_get_their_pool_and_thread_count() -> None:
    stack = _stack([0, 1, 2, 3], prefill=1, decode=2)
    kids = {c.name: c.argv for c in stack._children()}
    pre, dec = kids["prefill-0"], kids["decode-1"]
    assert pre[pre.index("--cpus") + 1] == "0,1" and pre[pre.index("--threads") + 1] == "2"
    # replicas of a pool get a slice of its cores each: they never compete for one
    assert _arg(kids["decode-0"], "--cpus") == "2" and _arg(dec, "--cpus") == "3"
    assert _arg(dec, "--threads") == "1"


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_long_context_decoders_share_the_prefill_cores_by_default() -> None:
    stack = _stack([0, 1], prefill=2, decode=1, long_decode=1, long_prompt_tokens=1500)
    kids = {c.name: c.argv for c in stack._children()}
    # more workers than cores: they share the pool's core, one thread each
    assert [_arg(kids[n], "--cpus") for n in ("prefill-0", "prefill-1")] == ["0", "0"]
    assert _arg(kids["prefill-1"], "--threads") == "1"
    assert _arg(kids["decode-0"], "--cpus") == "1"
    long = kids["decode-long-0"]
    assert _arg(long, "--pool") == "long" and _arg(long, "--cpus") == "0"
    assert _arg(kids["router-0"], "--long-prompt-tokens") == "1500"
    assert "--pool" not in kids["decode-0"]
    stack = _stack([0, 1, 2, 3], prefill=1, decode=1, long_decode=1, long_decode_cpus="3", decode_cpus="1-2")
    kids = {c.name: c.argv for c in stack._children()}
    assert _arg(kids["decode-long-0"], "--cpus") == "3"
    with mock.patch("os.sched_getaffinity", return_value={0, 1, 2, 3}):
        assert stack.control_cpus() == [0, 3]  # the control plane gets every core but the decode pool's
    colocated = _stack([0, 1], colocated=True, decode=2)
    assert colocated.pools == {"decode": [0, 1]}
    with mock.patch("os.sched_getaffinity", return_value={0, 1}):
        assert colocated.control_cpus() is None  # decoders on every core: nothing to keep apart
    kids = {c.name: c.argv for c in colocated._children()}
    assert [_arg(kids[n], "--cpus") for n in ("decode-0", "decode-1")] == ["0", "1"]


def test_a_mock_stack_is_pinned_only_when_asked() -> None:
    # the mock engine sleeps instead of computing: pools would only squeeze its control plane onto half the cores
    mock_stack = _stack([0, 1], engine="mock", prefill=1, decode=2)
    assert mock_stack.pools == {}
    with mock.patch("os.sched_getaffinity", return_value={0, 1}):
        assert mock_stack.control_cpus() is None
    kids = {c.name: c.argv for c in mock_stack._children()}
    assert not any("--cpus" in argv for argv in kids.values())
    asked = _stack([0, 1], engine="mock", prefill=1, decode=2, decode_cpus="1")
    assert asked.pools == {"prefill": [0], "decode": [1]}
    assert _stack([0, 1], prefill=1, decode=2).pools == {"prefill": [0], "decode": [1]}  # hf: pinned by default


def test_up_stream_interval_reaches_every_decoder_and_no_prefiller() -> None:
    kids = {c.name: c.argv for c in _stack([0, 1], prefill=1, decode=2, long_decode=1,
                                           stream_interval=8)._children()}
    assert [_arg(kids[n], "--stream-interval") for n in ("decode-0", "decode-1", "decode-long-0")] == ["8"] * 3
    assert "--stream-interval" not in kids["prefill-0"]
    # the default (1) adds no flag: the decoders' own default is the same
    kids = {c.name: c.argv for c in _stack([0, 1], prefill=1, decode=1)._children()}
    assert not any("--stream-interval" in argv for argv in kids.values())


def _hb(seq: int, state: str = "ready", pid: int = 10) -> Heartbeat:
    return Heartbeat(worker_id="d0", role="decode", seq=seq, state=state, interval_ms=500, pid=pid)  # type: ignore[arg-type]


def test_registry_liveness_and_death_reported_once() -> None:
    r = WorkerRegistry()
    r.observe(_hb(1, "starting"), now=0.0)
    assert r.live("decode", 0.0) == [] and r.reap(100.0) == []  # a loading worker going silent is not a death
    r.observe(_hb(2), now=100.0)
    assert [h.worker_id for h in r.live("decode", 100.5)] == ["d0"]
    dead = r.reap(103.0)
    assert len(dead) == 1 and "stopped heartbeating" in dead[0][1]
    assert r.reap(104.0) == []  # reported once
    r.observe(_hb(1, pid=11), now=105.0)  # same id, new process: a fresh worker
    assert r.is_live("d0", 105.0)
    r.observe(_hb(2, "stopped", pid=11), now=105.1)
    assert not r.is_live("d0", 105.1)
    assert "stopped" in r.reap(105.2)[0][1]


def test_restart_before_timeout_still_reports_the_old_death() -> None:
    r = WorkerRegistry()
    r.observe(_hb(5, pid=10), now=0.0)
    r.observe(_hb(1, "starting", pid=11), now=0.5)  # restarted faster than the heartbeat timeout
    dead = r.reap(0.6)
    assert len(dead) == 1 and "pid 10" in dead[0][1] and "restarted" in dead[0][1]
    assert r.reap(0.7) == []


def test_a_lagging_observer_declares_nobody_dead() -> None:
    r = WorkerRegistry()
    me = Heartbeat(worker_id="router-0", role="router", seq=1, interval_ms=500, pid=1)
    r.observe(me, now=0.0)
    r.observe(_hb(1), now=0.0)
    # Both silent for 5 s: the router's own heartbeats are overdue too, so its loop lagged: no verdict.
    assert r.reap(5.0, observer="router-0") == []
    r.observe(me.model_copy(update={"seq": 2}), now=5.1)  # the router's loop caught up; d0 is still silent
    dead = r.reap(5.2, observer="router-0")
    assert [d[0] for d in dead] == ["d0"]


def test_an_observer_stall_shorter_than_the_timeout_is_forgiven_too() -> None:
    """The whole machine (or the router's loop) froze for 2.2 s. The router's own last heartbeat, in another phase,
    is 1.8 s old, still under the 2 s timeout; a worker's is 2.2 s old. The worker was no more silent than the
    router: no verdict. (CI saw exactly this: decode-0 and prefill-0 declared dead together, both 2.1-2.2 s.)"""
    r = WorkerRegistry()
    me = Heartbeat(worker_id="router-0", role="router", seq=1, interval_ms=500, pid=1)
    r.observe(_hb(1), now=0.0)
    r.observe(me, now=0.4)
    assert r.reap(2.2, observer="router-0") == []
    r.observe(_hb(2), now=2.25)  # the queued heartbeats are read
    r.observe(me.model_copy(update={"seq": 2}), now=2.25)
    assert r.reap(2.5, observer="router-0") == []
    # With the router current, a worker silent past the timeout is dead as before.
    r.observe(me.model_copy(update={"seq": 3}), now=4.4)
    dead = r.reap(4.5, observer="router-0")
    assert [d[0] for d in dead] == ["d0"] and "2.2s" in dead[0][1]


def test_up_routers_starts_that_many_replicas() -> None:
    kids = {c.name: c for c in _stack([0, 1], routers=3)._children()}
    routers = sorted(n for n, c in kids.items() if c.role == "router")
    assert routers == ["router-0", "router-1", "router-2"]
    for n in routers:  # each its own process, log and id (the supervisor restarts each on its own)
        assert _arg(kids[n].argv, "--worker-id") == n and kids[n].log.name == f"{n}.log"
    assert [c.name for c in _stack([0, 1])._children() if c.role == "router"] == ["router-0"]


def test_up_frontends_accept_from_one_socket_the_supervisor_holds() -> None:
    stack = _stack([0, 1], frontends=3, http_port=0)
    try:
        kids = {c.name: c for c in stack._children() if c.role == "frontend"}
        assert sorted(kids) == ["frontend-0", "frontend-1", "frontend-2"]
        assert stack.http_sock is not None
        fd, port = stack.http_sock.fileno(), stack.http_sock.getsockname()[1]
        assert stack.http_url == f"http://127.0.0.1:{port}"
        for n, c in kids.items():  # one listening socket, inherited; each its own id, log and metrics port
            assert _arg(c.argv, "--listen-fd") == str(fd) and c.pass_fds == (fd,)
            assert _arg(c.argv, "--port") == str(port) and _arg(c.argv, "--worker-id") == n
            assert c.log.name == f"{n}.log"
        metrics = [_arg(kids[f"frontend-{i}"].argv, "--metrics-port") for i in range(3)]
        assert len(set(metrics)) == 3
        assert stack.metrics_urls == [f"http://127.0.0.1:{m}/metrics" for m in metrics]
        assert stack.metrics_url == stack.metrics_urls[0]
        # the other services inherit nothing
        assert all(not c.pass_fds for c in stack._children() if c.role != "frontend")
    finally:
        if stack.http_sock is not None:
            stack.http_sock.close()


async def test_a_clean_exit_is_restarted_at_once_and_only_crashes_back_off() -> None:
    """A child that exits 0 (it drained after SIGTERM: a rolling restart) comes back after 0.5 s every time; a
    child that crashes again and again waits 0.5, 1, 2 s... (it used to count clean exits as crashes, so three
    rolling restarts within a minute kept a front door down for seconds)."""
    import asyncio
    import subprocess
    import sys
    import time

    from splitserve.stack import Child

    stack = _stack([0, 1])
    # The back-off the supervisor chose for each restart, as it says it (its own clock): the gap between a test's
    # observations shrank under load by however long the other child's start took (one CI run: 1.89 for 2.0).
    waits: dict[str, list[float]] = {"clean": [], "crash": []}

    def echo(line: str) -> None:
        if (m := re.search(r"^\s*(\w+)\s+exited with code \d+; restarting in ([\d.]+)s", line)) is not None:
            waits[m.group(1)].append(float(m.group(2)))

    stack.echo = echo
    children = [Child("clean", "frontend", [sys.executable, "-c", "pass"], Path("/tmp/unused")),
                Child("crash", "frontend", [sys.executable, "-c", "raise SystemExit(3)"], Path("/tmp/unused"))]
    starts: dict[str, list[float]] = {"clean": [], "crash": []}

    def spawn(ch: Child) -> None:
        starts[ch.name].append(time.monotonic())
        ch.proc = subprocess.Popen(ch.argv)
        ch.proc.wait()
        ch.started_at = time.monotonic()

    stack.children = children
    with mock.patch.object(stack, "_spawn", spawn):
        for ch in children:
            spawn(ch)
        task = asyncio.ensure_future(stack._supervise())
        try:
            await asyncio.sleep(4.5)
        finally:
            stack.stopping.set()
            await task
    assert len(waits["clean"]) >= 4 and set(waits["clean"]) == {0.5}, waits
    # and it waited at least that long before each restart
    gaps = [b - a for a, b in zip(starts["crash"], starts["crash"][1:], strict=False)]
    assert len(gaps) >= 2 and gaps[0] >= 0.5 and gaps[1] >= 1.0, gaps
    assert waits["crash"][:3] == [0.5, 1.0, 2.0], waits


def test_the_front_doors_get_the_what_if_traces_folder(tmp_path: Path) -> None:
    kids = {c.name: c.argv for c in _stack([0, 1], whatif_traces=tmp_path, frontends=2)._children()}
    assert [_arg(kids[f"frontend-{i}"], "--whatif-traces") for i in (0, 1)] == [str(tmp_path)] * 2
    kids = {c.name: c.argv for c in _stack([0, 1])._children()}
    assert "--whatif-traces" not in kids["frontend-0"]  # the front door's default: the bundled traces

