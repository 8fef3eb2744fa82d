"""Secrets never reach a log: not through a traceback's frame locals, not inside an error's text, not as a field.

Real processes against a real nats-server that requires a password: a service given a password the server
refuses (its traceback held that password in a local), a process that logs failures whose frames, messages and
fields carry the password, and the HTTP front door, whose API key must stay out of its log whether a request
with the key fails or the process dies at startup holding the keys. Then the modes of what the stack code
writes (0700 directories, 0600 files, also when an older version left them open), and the redaction processor
itself: credential-named fields at any depth, token counts kept.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.natsserver import NatsServer, start_nats
from splitserve.obs import log as obslog
from splitserve.stack import log_pump
from splitserve.stackproc import spawn_service, start_stack
from splitserve.tenancy.natsauth import ENV_PASSWORD, ENV_USER

ROOT = Path(__file__).resolve().parents[2]
USER, GOOD_PW = "svc.test", "good-" + secrets.token_hex(12)


@pytest.fixture(scope="module")
def auth_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A nats-server that lets in only USER with GOOD_PW."""
    conf = f'authorization {{ users = [ {{ user: "{USER}", password: "{GOOD_PW}" }} ] }}'
    srv = start_nats(tmp_path_factory.mktemp("auth-nats"), port=None, extra_config=conf)
    yield srv
    srv.stop()


def _env(password: str | None) -> dict[str, str]:
    """This environment without any NATS credentials of the caller's; USER with ``password`` if given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_NATS_")}
    env["PYTHONUNBUFFERED"] = "1"
    if password is not None:
        env.update({ENV_USER: USER, ENV_PASSWORD: password})
    return env


def _events(text: str) -> list[dict[str, Any]]:
    """Every line of a service's output is one JSON object (a line that is not fails the test)."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------ real processes


def test_refused_service_password_stays_out_of_its_log(auth_nats: NatsServer) -> None:
    """The cache index given a password the server refuses: it dies logging the uncaught NotAuthorized, whose
    traceback runs through Bus.connect(password=...) and Service.run; the password is nowhere in the output."""
    wrong = "wrong-" + secrets.token_hex(12)
    proc = subprocess.run([sys.executable, "-m", "splitserve.services.cache_index", "--nats-url", auth_nats.url,
                           "--worker-id", "cache-index-0"], cwd=ROOT, env=_env(wrong), capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert wrong not in out
    crash = [e for e in _events(out) if e.get("event") == "uncaught_exception"]
    assert crash, out
    assert crash[0]["exception"][0]["exc_type"] == "NotAuthorized"
    assert all("locals" not in f for exc in crash[0]["exception"] for f in exc["frames"])


PROBE = r"""
import logging, os
from splitserve.obs.log import configure_logging, get_logger

configure_logging("probe", "probe-0")
log = get_logger("probe")
pw = os.environ["SPLITSERVE_NATS_PASSWORD"]

def connect(password):
    url = f"nats://svc.test:{password}@127.0.0.1:4222"
    raise ConnectionError(f"refused: {url} (password {password})")

try:
    connect(pw)
except ConnectionError:
    log.exception("structlog_failure", url=f"nats://svc.test:{pw}@h:1", prompt_tokens=5, max_tokens=7,
                  config={"servers": [{"password": pw, "token_ids": [1, 2]}]})
    logging.getLogger("nats").error("stdlib_failure %s", pw, exc_info=True, extra={"auth_token": pw})
log.info("plain_event", note=f"connect --password={pw} done", headers={"Authorization": f"Bearer {pw}"})
connect(pw)
"""


def test_secret_in_locals_message_and_fields_is_masked(tmp_path: Path) -> None:
    """A process holding the NATS password (from its environment) logs failures every way it can: structlog
    with a traceback, the standard library with a traceback and an extra field, plain text, and an uncaught
    exception whose frame has the password in a local. Every event is there; the password is not."""
    pw = "pw-" + secrets.token_hex(16)
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=_env(pw), capture_output=True, text=True,
                          timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out  # the last connect() is uncaught
    events = {e["event"]: e for e in _events(out)}
    assert {"structlog_failure", "plain_event", "uncaught_exception"} <= set(events), out
    assert any(name.startswith("stdlib_failure") for name in events), out
    assert pw not in out
    first = events["structlog_failure"]
    assert first["prompt_tokens"] == 5 and first["max_tokens"] == 7  # counts are no secret
    assert first["config"]["servers"][0] == {"password": "[REDACTED]", "token_ids": [1, 2]}
    assert first["url"] == "nats://svc.test:[REDACTED]@h:1"
    assert first["exception"][0]["exc_type"] == "ConnectionError"
    stdlib = next(e for name, e in events.items() if name.startswith("stdlib_failure"))
    assert stdlib["auth_token"] == "[REDACTED]" and "exception" in stdlib
    assert events["plain_event"]["headers"]["Authorization"] == "[REDACTED]"
    for e in events.values():
        for exc in e.get("exception", []):
            assert all("locals" not in f for f in exc["frames"])


def _wait_for_event(path: Path, event: str, proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in _events(path.read_text(errors="replace")):
            if e.get("event") == event:
                return e
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no {event!r} in {path}:\n{path.read_text(errors='replace')}")


def _post(url: str, key: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_front_door_api_key_stays_out_of_its_log(auth_nats: NatsServer, tmp_path: Path) -> None:
    """The front door with an API key file: requests with the key that fail (no router, a key with a suffix, a
    bad body, a stream) log nothing of the key; a front door that dies at startup (NATS refuses it) while its
    keys are loaded logs the crash, not the keys."""
    key = "sk-tenant-" + secrets.token_hex(16)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({key: "acme"}))
    logf = tmp_path / "frontend.log"
    cmd = [sys.executable, "-m", "splitserve.services.frontend", "--nats-url", auth_nats.url, "--port", "0",
           "--api-keys", str(keys), "--log-level", "DEBUG"]
    with open(logf, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(GOOD_PW), stdout=out, stderr=subprocess.STDOUT)
    try:
        url = _wait_for_event(logf, "http_listening", proc, 120)["url"]
        completion = b'{"model": "m", "prompt": "hi", "max_tokens": 2}'
        assert _post(f"{url}/v1/completions", key, completion) == 503  # no router serves it
        assert _post(f"{url}/v1/completions", key, completion[:-1] + b', "stream": true}') == 503
        assert _post(f"{url}/v1/completions", key + "x", completion) == 401
        assert _post(f"{url}/v1/chat/completions", key, b'{"model": "m", "messages": "x"}') == 400
    finally:
        proc.terminate()
        proc.wait(30)
    healthy = logf.read_text(errors="replace")
    assert sum(e.get("event") == "http" for e in _events(healthy)) >= 4, healthy
    assert key not in healthy

    wrong = "wrong-" + secrets.token_hex(12)
    crashed = subprocess.run(cmd, cwd=ROOT, env=_env(wrong), capture_output=True, text=True, timeout=120)
    text = crashed.stdout + crashed.stderr
    assert crashed.returncode != 0, text
    assert any(e.get("event") == "uncaught_exception" for e in _events(text)), text
    assert key not in text and wrong not in text


# ------------------------------------------------------------------------------------------ file modes


def test_a_service_given_a_log_file_appends_to_it_owner_only(tmp_path: Path) -> None:
    """Under the supervisor a service appends its JSON lines to its log itself (SPLITSERVE_LOG_FILE): the same
    events, masked the same way, one whole line per write beside another writer's lines, the file created 0600;
    nothing of them on its stdout or stderr (which the supervisor's pipe keeps for a native library's output)."""
    pw = "pw-" + secrets.token_hex(16)
    path = tmp_path / "probe.log"
    path.write_text('{"event": "already here"}\n')
    os.chmod(path, 0o644)
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**_env(pw), "SPLITSERVE_LOG_FILE": str(path)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0  # the last connect() is uncaught
    assert proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr
    text = path.read_text()
    events = {e["event"]: e for e in _events(text)}  # every line one JSON object
    assert {"already here", "structlog_failure", "plain_event", "uncaught_exception"} <= set(events), text
    assert any(name.startswith("stdlib_failure") for name in events), text
    assert pw not in text
    assert events["plain_event"]["service"] == "probe"
    assert _mode(path) == 0o600


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_stack_logs_are_owner_only(tmp_path: Path, auth_nats: NatsServer) -> None:
    """What the stack code writes: the state dir and logs dir 0700, every log (a service's, nats.log, a
    service spawned by stackproc) 0600; and left open (0755 / 0644) by an older version, put back."""
    state = tmp_path / "state"
    logs = state / "logs"
    logs.mkdir(parents=True)
    os.chmod(state, 0o755)
    os.chmod(logs, 0o755)
    old = logs / "router-0.log"
    old.write_text("{}\n")
    os.chmod(old, 0o644)

    # `splitserve up` itself (a subprocess: the supervisor pins its process's threads): it fixes both
    # directories before anything else, then stops here (the external server refuses a supervisor without
    # credentials), which is all this needs of it.
    up = subprocess.run([str(Path(sys.executable).with_name("splitserve")), "up", "--nats-url", auth_nats.url,
                         "--state-dir", str(state), "--engine", "mock", "--prefill", "0", "--decode", "1"],
                        cwd=ROOT, env=_env(None), capture_output=True, text=True, timeout=120)
    assert "NotAuthorized" in up.stdout + up.stderr, up.stdout + up.stderr
    assert _mode(state) == 0o700 and _mode(logs) == 0o700

    # A child's output copied into its log (the supervisor's log_pump), into the old 0644 file and a new one.
    for path in (old, logs / "decode-0.log"):
        child = subprocess.Popen([sys.executable, "-c", "print('hello')"], stdout=subprocess.PIPE)
        assert child.stdout is not None
        log_pump(child.stdout, path, "svc")
        child.wait(10)
        assert _mode(path) == 0o600
    assert "hello" in old.read_text()

    # nats.log, pre-existing and open
    (logs / "nats.log").write_text("")
    os.chmod(logs / "nats.log", 0o644)
    srv = start_nats(state / "nats", port=None, log_file=logs / "nats.log")
    srv.stop()
    assert _mode(logs / "nats.log") == 0o600

    # A single service started by stackproc (tests, benchmarks) into a fresh log dir: `this` ignores the
    # service arguments and exits, which is all the file needs.
    elsewhere = tmp_path / "svc-logs"
    spawn_service("this", nats_url="nats://127.0.0.1:1", worker_id="w-0", log_dir=elsewhere).wait(30)
    assert _mode(elsewhere) == 0o700 and _mode(elsewhere / "w-0.log") == 0o600


@pytest.mark.slow
def test_closed_stack_logs_hold_no_secret_and_are_owner_only(tmp_path: Path) -> None:
    """`splitserve up --tenants` with the mock engine, a tenant's API key used over HTTP (and a wrong one):
    every log under the state dir is 0600 in a 0700 directory, every line JSON, and no service password, tenant
    password or API key (the services get theirs from the environment and register them) is in any of them."""
    tenant_pw, key = "tenant-pw-" + secrets.token_hex(8), "sk-acme-" + secrets.token_hex(16)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  acme:\n    password: {tenant_pw}\n    api_keys: [{key}]\n")
    state = tmp_path / "state"
    sp = start_stack(state, "--prefill", "0", "--decode", "1", "--engine", "mock", "--tenants", str(tenants),
                     env=_env(None))
    try:
        assert sp.http_url
        completion = b'{"prompt": "hi", "max_tokens": 2}'  # no model: the one the workers serve
        deadline = time.monotonic() + 60
        while (status := _post(f"{sp.http_url}/v1/completions", key, completion)) != 200:
            # (just after "up", the front door may not have heard of the decoder's model yet)
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        assert _post(f"{sp.http_url}/v1/completions", key[:-1], completion) == 401
    finally:
        sp.stop()
    service_pws = json.loads((state / "auth" / "services.json").read_text()).values()
    logs = sorted((state / "logs").glob("*.log"))
    assert {"nats.log", "frontend-0.log", "router-0.log"} <= {p.name for p in logs}
    assert _mode(state) == 0o700 and _mode(state / "logs") == 0o700
    for path in logs:
        assert _mode(path) == 0o600, path
        text = path.read_text(errors="replace")
        for secret in (tenant_pw, key, *service_pws):
            assert secret not in text, (path, secret)
        if path.name != "nats.log":  # the server's own text format
            _events(text)


def test_private_dir_leaves_shared_dirs_alone(tmp_path: Path) -> None:
    """--state-dir /tmp: a shared (sticky) directory keeps its mode, even for root; ours become 0700."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    obslog.private_dir(shared)
    assert _mode(shared) == 0o1777
    mine = obslog.private_dir(shared / "a" / "b")
    assert _mode(mine) == 0o700


# ------------------------------------------------------------------------------------------ the processor


SECRET_KEYS = ["password", "PASSWORD", "nats_password", "passwd", "secret", "client_secret", "api_key", "apiKey",
               "api-key", "authorization", "Authorization", "proxy_authorization", "nkey_seed", "seed", "token",
               "access_token", "refresh_token", "auth_token", "hf_token", "bearer", "bearer_token", "credentials",
               "cookie", "set_cookie", "admin_keys", "api_keys"]
COUNT_FIELDS: dict[str, Any] = {"prompt_tokens": 12, "max_tokens": 64, "token_ids": [1, 2, 3],
                                "tokens_per_minute": 900, "completion_tokens": 7, "cached_tokens": 3, "tokens": 5,
                                "token_id": 42, "seed": 7, "token": 13, "first_token_ms": 1.5, "eos_token": "</s>",
                                "password_set": True, "api_key": None}

json_leaf = st.one_of(st.integers(), st.booleans(), st.none(), st.text(max_size=8))
nested = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(key=st.sampled_from(SECRET_KEYS), wrapper=nested, depth=st.integers(0, 5))
def test_credential_keys_redacted_at_any_depth(key: str, wrapper: Any, depth: int) -> None:
    secret = "cred-" + secrets.token_hex(6)
    inner: Any = {**COUNT_FIELDS, key: secret}
    for i in range(depth):
        inner = [inner] if i % 2 else {"level": inner, "other": wrapper}
    event = obslog.redact_secrets(None, "info", {"event": "e", "payload": inner, "other": wrapper})
    assert secret not in json.dumps(event, default=repr)
    # walk back to the innermost dict: the credential is redacted, every count field survives untouched
    node: Any = event["payload"]
    for i in reversed(range(depth)):
        node = node[0] if i % 2 else node["level"]
    assert node[key] == "[REDACTED]"
    assert {k: node[k] for k in COUNT_FIELDS if k != key} == {k: v for k, v in COUNT_FIELDS.items() if k != key}


@pytest.mark.parametrize(("text", "hidden"), [
    ("nats://svc.router:hunter2@127.0.0.1:4222", "hunter2"),
    ("connect to nats://tok-abc123@host:4222 failed", "tok-abc123"),
    ("Authorization: Bearer sk-abcdef123", "sk-abcdef123"),
    ("[(b'authorization', b'Bearer sk-abcdef123')]", "sk-abcdef123"),
    ("{'Authorization': 'Basic dXNlcjpwYXNz'}", "dXNlcjpwYXNz"),
    ("send it with bearer sk-abcdef123 please", "sk-abcdef123"),
    ("TenantSpec(password='s3cret-search', api_keys=[])", "s3cret-search"),
    ('{"api_key": "sk-zz-998877"}', "sk-zz-998877"),
    ("seed SUACSSL3UAHUDXKFSNVUZRF5UHPMWZ6BFDTJ7M6USDXIEDNPPQYYYCU3VY here", "SUACSSL3UAHUDXKFSNVUZRF5UHPMW"),
])
def test_credentials_in_text_are_masked(text: str, hidden: str) -> None:
    out = obslog.mask_text(text)
    assert hidden not in out and "[REDACTED]" in out


@pytest.mark.parametrize("text", ["prompt_tokens=12 max_tokens=64", "the bearer of news", "5 tokens per minute",
                                  "missing authorization, retry", "password=None", "secrets under /x (mode 0600)",
                                  "http://127.0.0.1:8000/v1", "Authorization Violation"])
def test_ordinary_text_is_kept(text: str) -> None:
    assert obslog.mask_text(text) == text


def test_registered_secrets_and_environment(tmp_path: Path) -> None:
    """Registered values are masked inside any text (also URL-encoded), in keys' values of any name, in
    objects rendered by repr; the environment's password, admin keys and nkey seed file are registered."""
    seed = "SUAB" + "C" * 54
    seed_file = tmp_path / "user.nk"
    seed_file.write_text(seed + "\n")
    obslog.register_secrets_from_env({ENV_PASSWORD: "env-pw-77aa", "SPLITSERVE_CONSOLE_ADMIN_KEYS": "adm-1x,adm-2y",
                                      "SPLITSERVE_NATS_NKEY_SEED": str(seed_file)})
    obslog.register_secret("p@ss/word-91", None, "", "abc")  # empty and short ones are ignored
    event = obslog.redact_secrets(None, "info", {
        "event": "failed with env-pw-77aa", "detail": {"note": ["adm-2y was used", Path("/x/adm-1x")]},
        "url": "nats://u:p%40ss%2Fword-91@h", "raw": f"loaded {seed}", "word": "abcdef"})
    text = json.dumps(event, default=repr)
    for s in ("env-pw-77aa", "adm-1x", "adm-2y", "p%40ss%2Fword-91", seed):
        assert s not in text
    assert event["word"] == "abcdef"  # "abc" was too short to register
    assert str(seed_file) not in obslog._secrets  # the path is no secret
