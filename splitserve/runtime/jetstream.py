"""How many copies every JetStream stream, KV bucket and object store keeps, and creating them that way.

One rule for the whole system: R3 on a cluster of at least 3 nodes (one node may die with nothing lost and
every stream still writable: a 3-replica group keeps its quorum of 2), R1 on a single server (there is no
other copy to keep). The replica count comes from ``$SPLITSERVE_STREAM_REPLICAS`` when set (``splitserve up
--nats-cluster N`` sets it for every service), else from the cluster the connection sees: the server's INFO
lists the client URLs of every node it knows (``connect_urls``).

A stream that already exists is updated in place: a stream created R1 (before the cluster grew, or by an
older version) is scaled up to the wanted count, and its durable consumers follow; a stream is never scaled
down here (a service that came up while a node was away must not shrink what the others made R3).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import structlog
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StreamConfig
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

ENV_REPLICAS = "SPLITSERVE_STREAM_REPLICAS"
CLUSTER_REPLICAS = 3  # the replica count on a cluster of >= 3 nodes (quorum 2: survives one node)

log = structlog.get_logger("splitserve.jetstream")


def cluster_size(nc: Any) -> int:
    """Nodes of the cluster this connection is on, as its server announces them (1 for a lone server)."""
    info = getattr(nc, "_server_info", None) or {}
    urls = {str(u) for u in info.get("connect_urls") or ()}
    return max(1, len(urls))


def replicas_for(nc: Any) -> int:
    """The replica count for every stream, KV bucket and object store (see the module docstring)."""
    env = os.environ.get(ENV_REPLICAS)
    if env:
        try:
            return max(1, min(5, int(env)))
        except ValueError:
            raise ValueError(f"${ENV_REPLICAS} must be a number of replicas (1-5), not {env!r}") from None
    return CLUSTER_REPLICAS if cluster_size(nc) >= CLUSTER_REPLICAS else 1


# What "the stream already matches" compares (besides the replica count): updating a stream that already
# matches is not free: the server counts its max_bytes reservation a second time, so near its JetStream storage
# limit that fails with "insufficient storage resources"; several routers starting together, or a restarted
# one, must not do it needlessly.
_COMPARED = ("subjects", "retention", "storage", "max_bytes", "max_age", "duplicate_window", "discard",
             "allow_direct")


def _matches(want: StreamConfig, have: StreamConfig) -> bool:
    for f in _COMPARED:
        w = getattr(want, f)
        # unset (None, or 0 for the dedupe window: nats-py's default) means "the server's default"
        if w is None or (f == "duplicate_window" and not w):
            continue
        if w != getattr(have, f):
            return False
    return True


async def ensure_stream(js: JetStreamContext, cfg: StreamConfig, replicas: int) -> None:
    """Create the stream with ``replicas`` copies, or bring the existing one to ``cfg`` (scaling it up to
    ``replicas``, never down); leave it alone when it already matches. A JetStream API call that times out
    (a cluster electing a leader, a loaded machine) is tried again."""
    for attempt in range(4):
        last = attempt == 3
        try:
            try:
                existing = await js.stream_info(cfg.name or "")
            except NotFoundError:
                cfg.num_replicas = replicas
                try:
                    await js.add_stream(cfg)
                    return
                except NatsTimeout:
                    raise
                except Exception as exc:
                    if last:
                        raise RuntimeError(f"cannot create JetStream stream {cfg.name}: {exc!r} (JetStream "
                                           "storage limits of the nats-server?)") from exc
                    await asyncio.sleep(0.2 * (attempt + 1))  # created by another service meanwhile? look again
                    continue
            have = existing.config
            have_r = int(have.num_replicas or 1)
            cfg.num_replicas = max(replicas, have_r)
            if cfg.num_replicas == have_r and _matches(cfg, have):
                return
            if cfg.num_replicas != have_r:
                log.info("stream_scaled", stream=cfg.name, replicas_from=have_r, replicas_to=cfg.num_replicas)
            try:  # it exists with another config (an older version, or fewer copies): update it in place
                await js.update_stream(cfg)
                return
            except NatsTimeout:
                raise
            except Exception as exc:
                raise RuntimeError(f"cannot update JetStream stream {cfg.name}: {exc!r} (JetStream storage "
                                   "limits of the nats-server?)") from exc
        except NatsTimeout:
            if last:
                raise
            log.warning("jetstream_api_timeout", stream=cfg.name, attempt=attempt + 1)
            await asyncio.sleep(0.5 * (attempt + 1))


async def ensure_bucket(js: JetStreamContext, cfg: KeyValueConfig, replicas: int) -> KeyValue:
    """Open the KV bucket, or create it with ``replicas`` copies; an existing one is scaled up to ``replicas``.
    (Opened first: re-creating an existing bucket makes the server count its storage reservation twice.)"""
    for attempt in range(3):
        try:
            kv = await js.key_value(cfg.bucket)
            await ensure_replicas(js, f"KV_{cfg.bucket}", replicas)
            return kv
        except BucketNotFoundError:
            pass
        except NatsTimeout:  # a cluster electing a leader, a loaded machine: ask again
            if attempt == 2:
                raise
            log.warning("jetstream_api_timeout", bucket=cfg.bucket, attempt=attempt + 1)
            await asyncio.sleep(0.5 * (attempt + 1))
            continue
        cfg.replicas = replicas
        try:
            return await js.create_key_value(cfg)
        except Exception as exc:  # created by another service meanwhile? open it
            if attempt == 2:
                raise RuntimeError(f"cannot create JetStream KV bucket {cfg.bucket}: {exc!r}") from exc
            await asyncio.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


async def ensure_replicas(js: JetStreamContext, stream: str, replicas: int) -> None:
    """Scale an existing stream (the one behind a KV bucket ``KV_x`` or object store ``OBJ_x``) up to
    ``replicas``, keeping the rest of its config."""
    info = await js.stream_info(stream)
    have = int(info.config.num_replicas or 1)
    if have >= replicas:
        return
    cfg = info.config
    cfg.num_replicas = replicas
    log.info("stream_scaled", stream=stream, replicas_from=have, replicas_to=replicas)
    await js.update_stream(cfg)
