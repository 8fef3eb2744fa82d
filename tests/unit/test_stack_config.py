"""Pure pieces of the stack and runtime: core-set parsing, prefill/decode core pools, worker liveness."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest

from proto import Heartbeat
from services.common.options import parse_cpus
from splitserve.runtime.registry import WorkerRegistry
from splitserve.stack import Stack, StackConfig


@pytest.mark.parametrize(
    ("spec", "want"),
    [(None, None), ("", None), ("0", (0,)), ("0,2", (0, 2)), ("0-3", (0, 1, 2, 3)), ("4,0-1,1", (0, 1, 4))],
)
def test_parse_cpus(spec: str | None, want: tuple[int, ...] | None) -> None:
    assert parse_cpus(spec) == want


def _pools(cores: list[int], **cfg: object) -> dict[str, list[int]]:
    stack = Stack(StackConfig(state_dir=Path("/tmp/unused"), **cfg))  # type: ignore[arg-type]
    with mock.patch("os.sched_getaffinity", return_value=set(cores)):
        return stack._cpu_pools()


def test_default_pools_are_disjoint_halves() -> None:
    assert _pools([0, 1]) == {"prefill": [0], "decode": [1]}
    p = _pools(list(range(8)), prefill=2, decode=2)
    assert p == {"prefill": [0, 1, 2, 3], "decode": [4, 5, 6, 7]}


def test_colocated_and_explicit_pools() -> None:
    assert _pools([0, 1], colocated=True) == {"decode": [0, 1]}
    assert _pools([0, 1, 2, 3], prefill_cpus="3", decode_cpus="0-2") == {"prefill": [3], "decode": [0, 1, 2]}
    assert _pools([0]) == {}  # one core: nothing to separate


def test_worker_children_get_their_pool_and_thread_count() -> None:
    stack = Stack(StackConfig(state_dir=Path("/tmp/unused"), prefill=1, decode=2))
    stack.nats_url = "nats://127.0.0.1:4222"
    with mock.patch("os.sched_getaffinity", return_value={0, 1, 2, 3}):
        kids = {c.name: c.argv for c in stack._children()}
    pre, dec = kids["prefill-0"], kids["decode-1"]
    assert pre[pre.index("--cpus") + 1] == "0,1" and pre[pre.index("--threads") + 1] == "2"
    assert dec[dec.index("--cpus") + 1] == "2,3" and dec[dec.index("--threads") + 1] == "1"


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
