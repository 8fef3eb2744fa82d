"""End to end: ``splitserve up --tenants FILE`` (real nats-server with the generated users, every service
authenticating as its own user, the real model) serves a tenant with its password and refuses it without."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve import discovery, errors
from splitserve.client import Client
from splitserve.stackproc import StackProc, start_stack

pytestmark = pytest.mark.slow

SPLITSERVE = str(Path(sys.executable).parent / "splitserve")
PW_A = "tenant-a-password"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProc]:
    tmp = tmp_path_factory.mktemp("tenant-stack")
    tenants = tmp / "tenants.yaml"
    tenants.write_text(f"tenants:\n  A:\n    password: {PW_A}\n    api_keys: [sk-a-1]\n  B: {{}}\n")
    sp = start_stack(tmp / "state", "--prefill", "0", "--tenants", str(tenants))
    try:
        yield sp
    finally:
        rc = sp.stop()
        assert rc == 0, sp.output


async def test_tenant_with_password_is_served_and_without_is_refused(stack: StackProc) -> None:
    async with Client(stack.nats_url, user="A", password=PW_A) as c:
        res = await c.complete("Once upon a time", max_tokens=4)
    assert res.text and res.usage.completion_tokens > 0
    with pytest.raises(errors.NotAuthorized, match="requires credentials"):
        async with Client(stack.nats_url, tenant="A"):
            pass


def test_secrets_stay_private(stack: StackProc) -> None:
    auth = stack.state_dir / "auth"
    generated = json.loads((auth / "tenants.json").read_text())
    assert set(generated) == {"B"}  # A has its own password
    for name in ("services.json", "tenants.json", "nats-auth.conf"):
        assert stat.S_IMODE((auth / name).stat().st_mode) == 0o600
    assert stat.S_IMODE((stack.state_dir / "nats" / "nats.conf").stat().st_mode) == 0o600
    assert any(str(auth / "tenants.json") in line for line in stack.output)  # told where B's password is
    state = discovery.stack_file().read_text()
    assert PW_A not in state and generated["B"] not in state
    assert all(pw not in state for pw in json.loads((auth / "services.json").read_text()).values())


def test_cli_takes_tenant_credentials_and_operator_commands_find_admin(stack: StackProc) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_NATS_")}
    cp = subprocess.run([SPLITSERVE, "generate", "--nats-url", stack.nats_url, "--json", "--max-tokens", "2",
                         "Hello"], capture_output=True, text=True, timeout=120,
                        env=dict(env, SPLITSERVE_NATS_USER="A", SPLITSERVE_NATS_PASSWORD=PW_A))
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout.splitlines()[-1])["type"] == "final"
    cp = subprocess.run([SPLITSERVE, "generate", "--nats-url", stack.nats_url, "--max-tokens", "2", "Hello"],
                        capture_output=True, text=True, timeout=120, env=env)
    assert cp.returncode == 1 and "requires credentials" in cp.stderr  # a runtime failure (2: usage errors)
    # top reaches the local stack with the admin credentials kept in its state dir.
    cp = subprocess.run([SPLITSERVE, "top", "--once", "--json", "--interval", "1.5"], capture_output=True,
                        text=True, timeout=120, env=env)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout)["workers"]
