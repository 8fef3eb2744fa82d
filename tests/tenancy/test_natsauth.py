"""Unit tests of the nats-server auth config generated from a tenants file (no server)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from splitserve.tenancy.config import TenantsConfig
from splitserve.tenancy.natsauth import (
    INDEX_STORE,
    KV_EVENTS_STREAM,
    SERVICE_INBOX_ROOT,
    SERVICE_ROLES,
    TRACES_STREAM,
    nats_auth_config,
    prepare_stack_auth,
    read_admin_credentials,
    service_inbox,
    service_permissions,
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
    # Only the operator may do everything; every other service user gets its role's allow-lists.
    admin_line = next(line for line in text.splitlines() if service_user("admin") in line)
    assert 'publish: { allow: [">"] }' in admin_line and 'subscribe: { allow: [">"] }' in admin_line
    for role in SERVICE_ROLES:
        if role == "admin":
            continue
        line = next(line for line in text.splitlines() if service_user(role) in line)
        assert '">"' not in line, role
        assert f'"ss.hb.{role}.>"' in line and f'"{service_inbox(role)}.>"' in line, role
        assert ("allow_responses: true" in line) == service_permissions(role).allow_responses, role


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


def test_service_roles_have_least_privilege() -> None:
    """What each role may never do (the server-side proof is tests/security/test_role_rights.py)."""
    perms = {r: service_permissions(r) for r in SERVICE_ROLES}
    assert perms["admin"].publish == (">",) and perms["admin"].subscribe == (">",)
    for role, p in perms.items():
        if role == "admin":
            continue
        pub, sub = " ".join(p.publish), " ".join(p.subscribe)
        assert ">" not in p.publish and ">" not in p.subscribe and "_INBOX.>" not in p.subscribe, role
        assert "STREAM.DELETE" not in pub and "$JS.API.>" not in pub, role  # no role deletes a stream
        # Heartbeats and spans only as itself; replies only on its own inbox.
        assert [s for s in p.publish if s.startswith("ss.hb.")] == [f"ss.hb.{role}.>"], role
        assert [s for s in p.publish if s.startswith("ss.trace.")] == [f"ss.trace.spans.{role}"], role
        assert [s for s in p.subscribe if s.startswith("_INBOX")] == [f"{service_inbox(role)}.>"], role
        if role != "frontend":
            assert "ss.req.*" not in pub, role  # only the front door sends requests for tenants
        if role != "router":
            for owned in ("$KV.", "ss.q.", "ss.prefill.*.job", "ss.decode.*.job", "STREAM.CREATE.SS_RESULTS",
                          "STREAM.CREATE.SS_QUEUE", "STREAM.UPDATE.SS_TRACES", "$JS.ACK"):
                assert owned not in pub, (role, owned)
            assert "ss.req.*" not in sub, role  # only routers take requests
    assert not perms["frontend"].allow_responses  # it answers no NATS request
    assert all(perms[r].allow_responses for r in ("router", "decode", "prefill", "cache_index"))


def test_service_inboxes_cannot_be_a_tenants() -> None:
    assert SERVICE_INBOX_ROOT.startswith("_INBOX.")  # services answer only inboxes (bus.reply_allowed)
    for role in SERVICE_ROLES:
        inbox = service_inbox(role)
        tenant_token = inbox.split(".")[1]
        with pytest.raises(ValueError):  # no tenant can be named like it, so _INBOX.T.> never covers it
            _cfg(**{tenant_token: {}})
    with pytest.raises(ValueError):
        service_inbox("nobody")


def test_stream_names_match_the_services() -> None:
    from splitserve.obs.tracing import TRACE_STREAM
    from splitserve.services.cache_index.service import BUCKET, STREAM

    assert (KV_EVENTS_STREAM, INDEX_STORE, TRACES_STREAM) == (STREAM, BUCKET, TRACE_STREAM)
