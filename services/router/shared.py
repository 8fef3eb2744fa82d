"""State the router replicas share, kept in JetStream KV buckets: JetStream mechanics only.

* ``RequestRegistry`` (bucket ``SS_REQUESTS``): one ``proto.RequestRecord`` per request, keyed ``tenant.request``
  (ids are the clients' own, unique per tenant). Intake creates it create-only, so a request is accepted once
  across every router (a re-send to any replica finds it and
  reattaches); every later move (queued -> dispatched -> ended, or queued -> ended for a request cancelled or
  expired in the queue, or a change of owner when a router adopts a dead router's request) is a
  compare-and-set on the key's revision, so exactly one router wins it. Entries live ``ttl_s`` (the bucket's
  max age; default 15 min): longer than any request should wait or run.
* ``SharedQuota`` (bucket ``SS_QUOTA``): one ``proto.TenantUsage`` per tenant that has usage limits. The pure
  ``splitserve.tenancy.quota.QuotaBook`` decides on the latest snapshot; the new snapshot is written back with
  compare-and-set, and a conflicting write by another router makes this one reload and decide again, so
  max_inflight and tokens_per_minute are exact cluster-wide. Concurrent operations on one tenant are batched
  into one compare-and-set per round trip. Admission and finish are idempotent per request id.

What a router does with these (when to claim, settle, reconcile) is ``splitserve.services.router.service``'s business.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from splitserve import proto
from splitserve.proto import RequestRecord, Subjects, TenantUsage
from splitserve.runtime.jetstream import ensure_bucket
from splitserve.tenancy.config import TenantsConfig
from splitserve.tenancy.quota import QuotaBook, Refusal

log = structlog.get_logger("splitserve.router.shared")

CAS_ATTEMPTS = 64  # a tenant's usage under heavy contention from many routers: reload and decide again


class CorruptRecord(Exception):
    """The registry holds a value under a request's key that is not that request's record."""

    def __init__(self, request_id: str, revision: int, why: str) -> None:
        super().__init__(f"request {request_id}'s registry record is corrupt ({why[:200]})")
        self.request_id = request_id
        self.revision = revision


class RequestRegistry:
    def __init__(self, js: JetStreamContext, *, ttl_s: float = 900.0, replicas: int = 1) -> None:
        self.js = js
        self.replicas = replicas
        self.ttl_s = ttl_s
        self.kv: KeyValue | None = None

    async def setup(self) -> None:
        self.kv = await ensure_bucket(self.js, KeyValueConfig(
            bucket=Subjects.REQUESTS_BUCKET, history=1, ttl=self.ttl_s, storage=StorageType.FILE,
            max_bytes=256 << 20, description="splitserve: request id -> state (one per request, all routers)"),
            self.replicas)

    def _kv(self) -> KeyValue:
        assert self.kv is not None, "setup() first"
        return self.kv

    async def create(self, rec: RequestRecord) -> int | None:
        """Store a new request's record; its revision, or None if the id is already known."""
        try:
            return await self._kv().create(rec.key, proto.encode(rec))
        except KeyWrongLastSequenceError:
            return None

    async def get(self, tenant: str, request_id: str) -> tuple[RequestRecord, int] | None:
        """The record of ``tenant``'s request and its revision; None when there is none; CorruptRecord when the
        stored value is not a record of this request (no router writes such a value: an insider's, or a damaged
        store's)."""
        key = proto.request_key(tenant, request_id)
        try:
            e = await self._kv().get(key)
        except KeyNotFoundError:
            return None
        revision = int(e.revision or 0)
        try:
            rec = proto.decode(e.value or b"", RequestRecord)
        except proto.ProtocolError as exc:
            raise CorruptRecord(request_id, revision, exc.message) from None
        if rec.key != key:
            raise CorruptRecord(request_id, revision, f"it is request {rec.key[:130]!r}'s record")
        return rec, revision

    async def cas(self, rec: RequestRecord, revision: int) -> int | None:
        """Replace the record if it is still at ``revision``; the new revision, or None if it moved."""
        rec.updated_ms = proto.now_ms()
        try:
            return await self._kv().update(rec.key, proto.encode(rec), last=revision)
        except KeyWrongLastSequenceError:
            return None

    async def delete(self, rec: RequestRecord, revision: int) -> None:
        """Forget a record this router just created (the request was not accepted after all)."""
        request_id = rec.request_id
        try:
            await self._kv().delete(rec.key, last=revision)
        except Exception as exc:  # moved meanwhile (a re-send reattached): leave it, it expires
            log.warning("request_record_delete_failed", request_id=request_id, error=str(exc))


@dataclass
class _Op:
    request_id: str
    admit: bool  # False: finish
    prompt_tokens: int = 0
    max_tokens: int = 0
    queued: int = 0
    used_tokens: int | None = None
    fut: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class SharedQuota:
    """Global per-tenant quota usage. ``mirror`` is updated with every snapshot this router reads or writes
    (for reports and the reconciliation sweep); it is never the basis of a decision."""

    def __init__(self, js: JetStreamContext, config: TenantsConfig, mirror: QuotaBook, *, replicas: int = 1) -> None:
        self.replicas = replicas
        self.js = js
        self.config = config
        self.mirror = mirror
        self.kv: KeyValue | None = None
        self._ops: dict[str, list[_Op]] = {}
        self._flushing: set[str] = set()
        self._latest: dict[str, tuple[dict[str, Any] | None, int]] = {}  # tenant -> (snapshot, revision)
        self.conflicts = 0  # compare-and-set retries (contention between routers), for the logs

    async def setup(self) -> None:
        self.kv = await ensure_bucket(self.js, KeyValueConfig(
            bucket=Subjects.QUOTA_BUCKET, history=1, storage=StorageType.FILE, max_bytes=16 << 20,
            description="splitserve: tenant -> quota usage (all routers)"), self.replicas)

    def tenants(self) -> list[str]:
        return list(self._latest)

    async def admit(self, tenant: str, request_id: str, prompt_tokens: int, max_tokens: int,
                    queued: int) -> tuple[Refusal | None, bool]:
        """Check and reserve. Returns (refusal or None, whether the request was newly reserved: False for a
        request id already in flight, a re-send)."""
        op = _Op(request_id, True, prompt_tokens, max_tokens, queued)
        res: tuple[Refusal | None, bool] = await self._submit(tenant, op)
        return res

    async def finish(self, tenant: str, request_id: str, used_tokens: int | None) -> None:
        """The request ended (``used_tokens``: prompt + completion; None: it never ran). Idempotent."""
        await self._submit(tenant, _Op(request_id, False, used_tokens=used_tokens))

    async def _submit(self, tenant: str, op: _Op) -> Any:
        self._ops.setdefault(tenant, []).append(op)
        if tenant not in self._flushing:
            self._flushing.add(tenant)
            asyncio.get_running_loop().create_task(self._flush(tenant))
        return await op.fut

    async def _read(self, tenant: str) -> tuple[dict[str, Any] | None, int]:
        assert self.kv is not None
        try:
            e = await self.kv.get(tenant)
        except KeyNotFoundError:
            return None, 0
        try:
            u = proto.decode(e.value or b"", TenantUsage)
        except proto.ProtocolError as exc:
            # Not a record any router wrote (a corrupt value): refusing every request of the tenant until someone
            # repairs it would wedge it, so it counts as no usage and the next write replaces it.
            log.error("quota_record_corrupt", tenant=tenant, revision=e.revision, error=exc.message[:200])
            return None, int(e.revision or 0)
        return u.model_dump(include={"inflight", "settled", "finishes"}), int(e.revision or 0)

    async def _flush(self, tenant: str) -> None:
        try:
            while ops := self._ops.pop(tenant, []):
                try:
                    await self._apply(tenant, ops)
                except Exception as exc:
                    for op in ops:
                        if not op.fut.done():
                            op.fut.set_exception(exc)
        finally:
            self._flushing.discard(tenant)
            if self._ops.get(tenant):  # arrived while the last round was finishing
                self._flushing.add(tenant)
                asyncio.get_running_loop().create_task(self._flush(tenant))

    async def _apply(self, tenant: str, ops: list[_Op]) -> None:
        assert self.kv is not None
        for _ in range(CAS_ATTEMPTS):
            cached = self._latest.get(tenant)
            snap, rev = cached or await self._read(tenant)
            now = time.time()
            book = QuotaBook(self.config)
            book.load(tenant, snap, now)
            results: list[Any] = []
            changed = False
            for op in ops:
                if op.admit:
                    fresh = not book.is_inflight(tenant, op.request_id)
                    refusal = book.check(tenant, op.prompt_tokens, op.max_tokens, op.queued, now,
                                         request_id=op.request_id)
                    if refusal is None and fresh:
                        book.admit(tenant, op.request_id, op.prompt_tokens, op.max_tokens, now)
                        changed = True
                    results.append((refusal, fresh and refusal is None))
                else:
                    changed = book.finish(tenant, op.request_id, op.used_tokens, now) or changed
                    results.append(None)
            new = book.export(tenant, now)
            if not changed and cached is not None:
                # Nothing to write, so nothing would catch a stale snapshot: decide again on a fresh read
                # (a refusal must rest on the tenant's current usage, not on what this router last wrote).
                self._latest.pop(tenant, None)
                continue
            if changed:
                data = proto.encode(TenantUsage(**new))
                try:
                    rev = (await self.kv.update(tenant, data, last=rev) if rev
                           else await self.kv.create(tenant, data))
                except KeyWrongLastSequenceError:
                    self.conflicts += 1
                    self._latest.pop(tenant, None)  # another router wrote: reload and decide again
                    continue
            self._latest[tenant] = (new, rev)
            self.mirror.load(tenant, new, now)
            for op, r in zip(ops, results, strict=True):
                if not op.fut.done():
                    op.fut.set_result(r)
            return
        raise RuntimeError(f"quota usage of tenant {tenant!r}: {CAS_ATTEMPTS} conflicting writes in a row")
