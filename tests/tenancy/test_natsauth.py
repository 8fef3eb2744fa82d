"""Unit tests of the nats-server auth config generated from a tenants file (no server)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from splitserve.tenancy.config import TenantsConfig
from splitserve.tenancy.natsauth import (
    SERVICE_ROLES,
    nats_auth_config,
    prepare_stack_auth,
    read_admin_credentials,
    service_user,
    tenant_inbox,
    tenant_permissions,
)

NKEY = "U" + "A" * 55
SECRETS = {r: f"secret-{r}" for r in SERVICE_ROLES}


def _cfg(**tenants: dict[str, object]) -> TenantsConfig:
    return TenantsConfig.model_validate({"tenants": tenants})


def test_tenant_permissions_name_only_its_own_subjects() -> None:
    p = tenant_permissions("acme")
    assert set(p.publish) == {"ss.req.acme", "ss.cancel.acme", "$JS.API.DIRECT.GET.SS_RESULTS.ss.result.acme.>"}
    assert set(p.subscribe) == {"ss.stream.acme.>", "ss.result.acme.>", "ss.evt.finished.acme",
                                "ss.evt.finished.acme.>", "_INBOX.acme.>"}
    everything = " ".join(p.publish + p.subscribe)
    for forbidden in ("ss.q.", "ss.admin", "ss.decode", "ss.prefill", "ss.kv", "ss.hb", "$JS.API.STREAM"):
        assert forbidden not in everything
    assert tenant_inbox("acme") == "_INBOX.acme"


def test_config_has_every_service_and_tenant_user() -> None:
    text = nats_auth_config(_cfg(a={"password": "password-a"}, b={"nkey": NKEY}, c={}), SECRETS,
                            {"c": "generated-c"})
    assert text.startswith("authorization {")
    for role in SERVICE_ROLES:
        assert f'user: "{service_user(role)}", password: "secret-{role}"' in text
    assert 'user: "a", password: "password-a"' in text
    assert f'nkey: "{NKEY}"' in text
    assert 'user: "c", password: "generated-c"' in text
    line_a = next(line for line in text.splitlines() if 'user: "a"' in line)
    assert '"ss.req.a"' in line_a and '"ss.req.b"' not in line_a and '">"' not in line_a
    svc_line = next(line for line in text.splitlines() if service_user("router") in line)
    assert 'publish: { allow: [">"] }' in svc_line and 'subscribe: { allow: [">"] }' in svc_line


def test_service_users_cannot_collide_with_tenants() -> None:
    # A tenant name is a subject token (no dots); service users all contain one.
    assert all("." in service_user(r) for r in SERVICE_ROLES)
    with pytest.raises(ValueError):
        _cfg(**{"svc.router": {}})


def test_passwords_are_escaped_and_checked() -> None:
    text = nats_auth_config(_cfg(a={"password": 'quo"te\\back'}), SECRETS)
    assert r'password: "quo\"te\\back"' in text
    with pytest.raises(ValueError, match="bcrypt"):
        nats_auth_config(_cfg(a={"password": "$2a$11$abcdefgh"}), SECRETS)
    with pytest.raises(ValueError, match="control"):
        nats_auth_config(_cfg(a={"password": "line\nbreak!"}), SECRETS)


def test_missing_secrets_are_errors() -> None:
    with pytest.raises(ValueError, match="no password"):
        nats_auth_config(_cfg(a={}), SECRETS)
    with pytest.raises(ValueError, match="service role"):
        nats_auth_config(_cfg(a={"password": "password-a"}), {"router": "x"})
    with pytest.raises(ValueError, match="open mode"):
        nats_auth_config(TenantsConfig.open_mode(), SECRETS)


def test_prepare_stack_auth_generates_private_files_and_reuses_them(tmp_path: Path) -> None:
    cfg = _cfg(a={"password": "password-a"}, b={})
    first = prepare_stack_auth(tmp_path, cfg)
    auth = tmp_path / "auth"
    for name in ("services.json", "tenants.json"):
        assert stat.S_IMODE((auth / name).stat().st_mode) == 0o600
    assert stat.S_IMODE(auth.stat().st_mode) == 0o700
    assert set(first.service_secrets) == set(SERVICE_ROLES)
    assert set(first.generated_tenants) == {"b"}  # a has its own password
    assert json.loads((auth / "tenants.json").read_text()) == first.generated_tenants
    again = prepare_stack_auth(tmp_path, cfg)
    assert again.service_secrets == first.service_secrets
    assert again.generated_tenants == first.generated_tenants
    assert again.config == first.config
    assert read_admin_credentials(tmp_path) == ("svc.admin", first.service_secrets["admin"])
    assert read_admin_credentials(tmp_path / "nowhere") is None
