"""What a prefill or decode worker needs to run the ``vllm`` engine: its options, the vLLM config built from
them (with this worker's own ports), and the heartbeat load taken from vLLM's scheduler stats."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitserve.cache.hashing import DEFAULT_BLOCK_SIZE
from splitserve.natsserver import free_port
from splitserve.proto import WorkerLoad
from splitserve.services.common.options import EngineOptions


@dataclass(frozen=True)
class VllmOptions:
    kv_connector: str = "nixl"  # nixl | lmcache | none
    kv_backend: str = "UCX"  # NIXL backend: UCX | LIBFABRIC
    kv_events: bool = True  # bridge vLLM's KV events onto ss.kv.{worker}
    max_model_len: int | None = 4096
    engine_block_size: int | None = None  # None: 32 on CPU, 16 on GPU
    kv_cache_gib: int = 1  # CPU: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    lmcache_config: str | None = None  # LMCache PD config file (deploy/ generates one per pool)
    route_block_size: int = DEFAULT_BLOCK_SIZE  # the router's hashing block size
    max_lora_rank: int | None = None  # vLLM's max_lora_rank (None: the --lora-modules adapters' largest rank)


def vllm_config(opts: EngineOptions, v: VllmOptions, *, role: str, max_num_seqs: int, worker_id: str = "") -> Any:
    """The VllmConfig of one worker. Ports (NIXL side channel, KV events) are free ports of this host."""
    from splitserve.engines.vllm_engine import VllmConfig

    connector = None if v.kv_connector in ("", "none") else v.kv_connector
    lmcache_file = v.lmcache_config or os.environ.get("LMCACHE_CONFIG_FILE")
    if connector == "lmcache" and not lmcache_file:
        from splitserve import discovery
        from splitserve.engines.lmcache_pd import worker_config

        lmcache_file = str(worker_config(role, worker_id or role, discovery.home() / "lmcache",
                                         backends=(v.kv_backend.upper(),)))
    events = replay = None
    if v.kv_events:
        events = f"tcp://127.0.0.1:{free_port()}"
        replay = f"tcp://127.0.0.1:{free_port()}"
    return VllmConfig(
        model=opts.model, dtype=opts.dtype, tensor_parallel_size=v.tensor_parallel_size,
        gpu_memory_utilization=v.gpu_memory_utilization, max_model_len=v.max_model_len,
        block_size=v.engine_block_size, max_num_seqs=max_num_seqs, kv_cache_gib=v.kv_cache_gib, cpus=opts.cpus,
        kv_connector=connector,
        kv_role="kv_both" if connector == "nixl" else ("kv_producer" if role == "prefill" else "kv_consumer"),
        kv_backends=(v.kv_backend.upper(),),
        nixl_side_channel_port=free_port() if connector == "nixl" else None,
        lmcache_config_file=lmcache_file,
        kv_events_endpoint=events, kv_events_replay_endpoint=replay,
        # vLLM's own LoRA: --max-loras N is its batch slots (it does the LRU of adapters itself); every
        # --lora-modules adapter is registered at start
        lora_modules=opts.lora_modules, max_loras=opts.max_loras, max_lora_rank=v.max_lora_rank,
    )


def check_lora(cfg: Any) -> None:
    """Refuse, at start, LoRA settings the vllm engine cannot serve (requests for them would fail later)."""
    if cfg.lora_enabled and cfg.kv_connector == "lmcache":
        raise ValueError("--lora-modules / --max-loras with --kv-connector lmcache: not checked yet (LMCache must "
                         "keep an adapter's KV apart from the base model's); use --kv-connector nixl")


async def run_on_loop(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """AdapterSlots' engine runner on the vllm engine: its adapter calls are coroutines of the event loop that owns
    vLLM's AsyncLLM (the hf engine's run on the engine thread instead)."""
    out = fn(*args, **kw)
    return await out if inspect.isawaitable(out) else out


def vllm_load(engine: Any, *, active: int, queued: int, route_block_size: int,
              cached_blocks: int) -> WorkerLoad:
    """Heartbeat load from vLLM's own numbers, in the router's block units."""
    el = engine.load()
    per = max(1, el.block_size // route_block_size) if el.block_size else 1
    total = el.num_blocks * per
    used = int(round(el.kv_usage * total))
    return WorkerLoad(active_seqs=max(active, el.running), queued_requests=max(queued, el.waiting),
                      free_blocks=max(0, total - used), total_blocks=total, used_blocks=used,
                      cached_blocks=cached_blocks * per)


METRICS_PORT_ENV = "SPLITSERVE_VLLM_METRICS_PORT"


def serve_vllm_metrics(log: Any) -> str | None:
    """vLLM's own Prometheus series (``vllm:*``: its scheduler, KV cache, prefix cache, spec decode...) live in
    this process's default registry (vLLM's stat loggers run in the AsyncLLM process, i.e. here). Serve them on
    ``$SPLITSERVE_VLLM_METRICS_PORT`` (0: a free port) when set; ``splitserve up --engine vllm`` sets one per
    worker and prints it. Returns the URL, or None when not asked for."""
    raw = os.environ.get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return None
    from prometheus_client import REGISTRY, start_http_server

    host = os.environ.get("SPLITSERVE_VLLM_METRICS_HOST", "127.0.0.1")
    try:
        port = int(raw)
    except ValueError:
        log.warning("vllm_metrics_port_invalid", value=raw, hint=f"{METRICS_PORT_ENV} must be a port number")
        port = 0
    try:
        server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    except OSError as e:
        if port == 0:
            log.warning("vllm_metrics_unavailable", error=str(e))
            return None
        # Metrics are not worth a worker: the port was picked before the model loaded, and something bound it
        # since. Serve on another port and say where.
        server, _ = start_http_server(0, addr=host, registry=REGISTRY)
        log.warning("vllm_metrics_port_taken", wanted=port, port=server.server_port, error=str(e))
    url = f"http://{host}:{server.server_port}/metrics"
    log.info("vllm_metrics_listening", url=url)
    return url
