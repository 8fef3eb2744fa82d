"""The web console, served by the front door at ``/console``: pages (static files shipped in the package,
plain JS and SVG, nothing fetched from the network) and the JSON API under ``/console/api`` they draw from.

Who sees what (:class:`ConsoleAuth`):

* no keys configured at all (an open front door): everyone is an operator;
* otherwise every API call needs ``Authorization: Bearer KEY``: an **admin key** (``--admin-keys FILE``,
  ``SPLITSERVE_CONSOLE_ADMIN_KEYS``, or the key ``splitserve up --tenants`` generates into
  ``<state-dir>/auth/console-admin.key``) sees everything; a **tenant's API key** (``--api-keys``, the tenants
  file's ``api_keys``) sees only its own tenant: its queue row, usage and requests. The cluster page and the
  routing explorer (which shows every worker's cache residency) are for admins only.

The what-if panel (``/console/api/whatif``, admin only) runs ``splitserve sim what-if`` on the front door's own
tenants file and a trace from an allow-list, in a child process (:mod:`splitserve.services.frontend.whatif`).

The figures come from :mod:`splitserve.services.frontend.console_data`, which reuses the operator commands' sources.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException

from splitserve import errors
from splitserve.proto.admin import MAX_EXPLAIN_STRATEGIES, LoraAdminRequest
from splitserve.proto.subjects import check_token
from splitserve.services.frontend.app import AuthThrottle, bearer_key
from splitserve.services.frontend.console_data import ConsoleData
from splitserve.services.frontend.whatif import MAX_POOL, WhatIfRefused, WhatIfRunner
from splitserve.tenancy.consolekey import ADMIN_KEYS_ENV

STATIC = Path(__file__).parent / "static" / "console"
WINDOWS = {"15m": 900.0, "1h": 3600.0, "24h": 86400.0, "7d": 7 * 86400.0, "all": None}


# ---------------------------------------------------------------------------------------------- auth


@dataclass(frozen=True)
class Principal:
    admin: bool
    tenant: str | None = None  # the one tenant a tenant key may see (None for an admin)

    @property
    def scope(self) -> str | None:
        """The tenant filter to apply: None (everything) for an admin."""
        return None if self.admin else self.tenant


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_admin_keys(path: Path) -> list[str]:
    """Admin keys from a file: a JSON/YAML list, or one key per line (``#`` comments allowed)."""
    text = path.read_text()
    keys: Any
    try:
        import yaml

        keys = yaml.safe_load(text)
    except Exception:
        keys = None
    if not isinstance(keys, list):
        keys = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not keys or not all(isinstance(k, str) and len(k) >= 16 for k in keys):
        raise ValueError(f"{path}: expected admin keys (a list, or one per line), each at least 16 characters")
    return list(keys)


def admin_keys_from_env() -> list[str]:
    return [k.strip() for k in os.environ.get(ADMIN_KEYS_ENV, "").split(",") if k.strip()]


class ConsoleAuth:
    """Keys held only as SHA-256 digests (as the front door's own API-key check does)."""

    def __init__(self, tenant_keys: dict[str, str] | None, admin_keys: Iterable[str] = ()) -> None:
        self._tenants = {_digest(k): t for k, t in (tenant_keys or {}).items()}
        self._admins = [_digest(k) for k in admin_keys]
        overlap = set(self._tenants) & set(self._admins)
        if overlap:
            raise ValueError("an admin console key is also a tenant's API key")
        self.open = not self._tenants and not self._admins

    def principal(self, authorization: str | list[str] | None) -> Principal:
        if self.open:
            return Principal(admin=True)
        # Read strictly and compared exactly, as the API's own keys are (a trailing newline is another key).
        key = bearer_key([authorization] if isinstance(authorization, str) else list(authorization or []))
        if key is not None:
            d = _digest(key)
            # Every key compared, no early exit: the timing says neither how close a guess was nor its kind.
            admin = False
            for a in self._admins:
                admin |= hmac.compare_digest(d, a)
            tenant = None
            for known, name in self._tenants.items():
                if hmac.compare_digest(d, known):
                    tenant = name
            if admin:
                return Principal(admin=True)
            if tenant is not None:
                return Principal(admin=False, tenant=tenant)
        raise HTTPException(401, "the console needs a key: an admin key, or a tenant's API key for that tenant's "
                                 "own view ('Authorization: Bearer <key>')")


# ---------------------------------------------------------------------------------------------- api


class ExplainBody(BaseModel):
    """The explorer's form. Bounded as the router's RouteExplainRequest is: a body that passed here but failed
    there was a 500 (found by the OpenAPI fuzz: too many strategies, an unpaired surrogate in a string)."""

    prompt: str = Field(min_length=1, max_length=2_000_000)
    chat: bool = False
    session_id: str | None = Field(default=None, max_length=256)
    tenant: str = "default"
    strategies: list[str] | None = Field(default=None, max_length=MAX_EXPLAIN_STRATEGIES)
    model: str | None = Field(default=None, max_length=256)  # a served model or adapter (None: the default)

    @model_validator(mode="after")
    def _utf8(self) -> ExplainBody:
        # JSON's \ud800 escapes decode to strings no UTF-8 encoder (msgpack, the tokenizer) accepts later
        for s in (self.prompt, self.session_id, self.tenant, *(self.strategies or ())):
            try:
                (s or "").encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string of the body has an unpaired UTF-16 surrogate") from None
        return self


def _not_found(message: str) -> JSONResponse:
    # Not an HTTPException: the front door rewrites 404 messages into "unknown URL".
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": "not_found"}}, status_code=404)


class LoraBody(BaseModel):
    """vLLM's runtime LoRA request body (``lora_path`` for a load only), and the base model whose workers act
    (None: every worker)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str | None = Field(default=None, max_length=4096)
    model: str | None = Field(default=None, max_length=256)


class WhatIfBody(BaseModel):
    """The what-if panel's form: the change file's text, a trace by its listed name (never a path), and the
    current pools the trace is replayed on (the CLI's --prefill/--decode; absent: its defaults). No other key:
    an unknown one (a ``tenants`` path, say) is refused, not ignored."""

    model_config = ConfigDict(extra="forbid")

    change: str  # its size is checked by the runner: over the limit is a 413, not a validation error
    trace: str = Field(min_length=1, max_length=256)
    prefill: int | None = Field(default=None, ge=0, le=MAX_POOL, strict=True)
    decode: int | None = Field(default=None, ge=1, le=MAX_POOL, strict=True)

    @model_validator(mode="after")
    def _utf8(self) -> WhatIfBody:
        for s in (self.change, self.trace):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string of the body has an unpaired UTF-16 surrogate") from None
        return self


def console_router(data: ConsoleData, auth: ConsoleAuth,
                   whatif: WhatIfRunner | None = None) -> tuple[APIRouter, APIRouter]:
    """The console's API, and the runtime LoRA endpoints at vLLM's paths (admin key; installed beside it).
    ``whatif`` None: the what-if endpoints answer 409 (no tenants file)."""
    runner = whatif if whatif is not None else WhatIfRunner(tenants=None)
    api = APIRouter(prefix="/console/api")
    lora_api = APIRouter()

    def principal(request: Request) -> Principal:
        # Failed keys count against the front door's per-address budget (when it has one): the console is
        # another door to the same keys.
        throttle: AuthThrottle | None = getattr(request.app.state, "auth_throttle", None)
        address = request.client.host if request.client else ""
        if throttle is not None and not auth.open:
            throttle.check(address)
        try:
            p = auth.principal(request.headers.getlist("authorization"))
        except HTTPException:
            if throttle is not None:
                throttle.failed(address)
            raise
        data.viewed()
        return p

    def admin(p: Principal = Depends(principal)) -> Principal:
        if not p.admin:
            raise HTTPException(403, "this view is for operators: it needs an admin key")
        return p

    async def nats_call(coro: Any) -> Any:
        try:
            return await coro
        except errors.SplitserveError as exc:
            status = 400 if exc.code.value == "bad_request" else 503
            raise HTTPException(status, exc.message) from None
        except (NoRespondersError, TimeoutError):  # nats' TimeoutError is the builtin's subclass
            raise HTTPException(503, "no router answered (is one running?)") from None
        except ConnectionError as exc:
            raise HTTPException(503, str(exc)) from None
        except NatsError as exc:  # e.g. SS_USAGE not created yet: no router has started
            raise HTTPException(503, f"NATS answered: {exc}") from None

    @api.get("/whoami")
    async def whoami(p: Principal = Depends(principal)) -> dict[str, Any]:
        return {"admin": p.admin, "tenant": p.tenant, "auth": not auth.open}

    @api.get("/cluster")
    async def cluster(_: Principal = Depends(admin)) -> dict[str, Any]:
        return data.cluster()

    @api.get("/tenants")
    async def tenants(p: Principal = Depends(principal)) -> dict[str, Any]:
        return await data.tenant_view(p.scope)

    @api.get("/usage")
    async def usage(since: str = Query("24h"), p: Principal = Depends(principal)) -> dict[str, Any]:
        if since not in WINDOWS:
            raise HTTPException(400, f"since must be one of {', '.join(WINDOWS)}")
        out: dict[str, Any] = await nats_call(data.usage(WINDOWS[since], p.scope))
        return {**out, "since": since}

    @api.get("/requests")
    async def requests(n: int = Query(20, ge=1, le=500), p: Principal = Depends(principal)) -> dict[str, Any]:
        out: dict[str, Any] = await nats_call(data.requests(p.scope, n))
        return out

    @api.get("/trace/{ref}", response_model=None)
    async def trace(ref: str, p: Principal = Depends(principal)) -> dict[str, Any] | JSONResponse:
        try:
            check_token(ref, "request id")
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        found = await nats_call(data.trace(ref, p.scope))
        if found is None:
            # The same answer whether the trace does not exist or belongs to another tenant.
            return _not_found(f"no trace for {ref} (tracing off, not sampled, expired from SS_TRACES, or not "
                              "yours)")
        out: dict[str, Any] = found
        return out

    @api.post("/explain")
    async def explain(body: ExplainBody, _: Principal = Depends(admin)) -> dict[str, Any]:
        try:
            tenant = check_token(body.tenant, "tenant")
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        out: dict[str, Any] = await nats_call(data.explain(prompt=body.prompt, chat=body.chat,
                                                           session_id=body.session_id or None, tenant=tenant,
                                                           strategies=body.strategies or None,
                                                           model=body.model or None))
        return out

    async def lora_change(body: LoraBody, action: str) -> JSONResponse:
        try:
            req = LoraAdminRequest(action=action, lora_name=body.lora_name,  # type: ignore[arg-type]
                                   lora_path=body.lora_path if action == "load" else None, model=body.model or None)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        replies = await nats_call(data.lora_admin(req))
        workers = [{"worker": r.worker_id, "ok": r.ok, "message": r.message, "adapters": r.adapters}
                   for r in replies]
        if not replies:
            if body.model:  # no live worker serves that model
                raise HTTPException(404, f"no live worker serves model {body.model!r}")
            raise HTTPException(503, "no worker answered")
        failed = [w for w in workers if not w["ok"]]
        # vLLM answers 200 on success and 400 when the adapter cannot be loaded/unloaded: the same here, with
        # each worker's own answer (a partial success names the workers that refused)
        return JSONResponse({"lora_name": body.lora_name, "action": action, "ok": not failed, "workers": workers},
                            status_code=400 if failed else 200)

    # vLLM's runtime LoRA endpoints (its --enable-lora + VLLM_ALLOW_RUNTIME_LORA_UPDATING), for operators only
    @api.post("/lora/load", include_in_schema=False)
    @lora_api.post("/v1/load_lora_adapter")
    async def load_lora(body: LoraBody, _: Principal = Depends(admin)) -> JSONResponse:
        return await lora_change(body, "load")

    @api.post("/lora/unload", include_in_schema=False)
    @lora_api.post("/v1/unload_lora_adapter")
    async def unload_lora(body: LoraBody, _: Principal = Depends(admin)) -> JSONResponse:
        return await lora_change(body, "unload")

    @api.get("/whatif/traces")
    async def whatif_traces(_: Principal = Depends(admin)) -> dict[str, Any]:
        # a folder listing and a few small files: off the loop all the same (a slow network mount)
        return await asyncio.to_thread(runner.describe)

    @api.post("/whatif", response_model=None)
    async def whatif_run(body: WhatIfBody, _: Principal = Depends(admin)) -> dict[str, Any] | JSONResponse:
        try:
            return await runner.run(body.change, body.trace, prefill=body.prefill, decode=body.decode)
        except WhatIfRefused as exc:
            if exc.status == 404:
                return _not_found(exc.message)
            raise HTTPException(exc.status, exc.message, headers=exc.headers) from None

    return api, lora_api


def install(app: FastAPI, data: ConsoleData, auth: ConsoleAuth, whatif: WhatIfRunner | None = None) -> None:
    """Serve the console on ``app``: the pages at /console, their assets, and the API (``whatif``: the what-if
    panel's runner; None: no tenants file, the panel says so)."""
    api, lora_api = console_router(data, auth, whatif)
    app.include_router(api)
    app.include_router(lora_api)
    app.mount("/console/static", StaticFiles(directory=STATIC), name="console-static")

    @app.get("/console", include_in_schema=False)
    async def console_root() -> Response:
        return RedirectResponse("/console/")

    @app.get("/console/", include_in_schema=False)
    async def console_index() -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})
