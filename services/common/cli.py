"""Typer options shared by the worker entry points, so ``up`` passes the same flags to every worker."""

from __future__ import annotations

import typer

NatsUrl = typer.Option("nats://127.0.0.1:4222", envvar="SPLITSERVE_NATS_URL")
Engine = typer.Option("hf", help="engine backend: hf | mock | vllm")
Model = typer.Option(None, help="model path (default: the bundled SmolLM2-135M-Instruct)")
Dtype = typer.Option("float32")
Threads = typer.Option(None, help="torch intra-op threads")
BlockSize = typer.Option(16, help="KV block size in tokens")
Transport = typer.Option("nixl", help="KV transport: nixl | tcp")
LogLevel = typer.Option("INFO")
Cpus = typer.Option(None, help="pin to these cores, e.g. '0' or '0-3,6' (torch threads follow)")

# vllm engine only (ignored by hf and mock)
KvConnector = typer.Option("nixl", help="vllm: KV connector between pools: nixl | lmcache | none")
KvBackend = typer.Option("UCX", help="vllm: NIXL transport backend: UCX | LIBFABRIC (AWS EFA)")
VllmMaxModelLen = typer.Option(4096, help="vllm: max model length (prompt + output)")
VllmBlockSize = typer.Option(None, help="vllm: KV block size (default 32 on CPU, 16 on GPU)")
VllmKvCacheGib = typer.Option(1, help="vllm on CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)")
VllmGpuMemory = typer.Option(0.85, help="vllm on GPU: fraction of GPU memory vLLM may use")
VllmTp = typer.Option(1, help="vllm: tensor parallel size")
VllmKvEvents = typer.Option(True, help="vllm: bridge vLLM's KV events into the cache index")
LmcacheConfig = typer.Option(None, help="vllm + lmcache: the LMCache PD config file of this worker")
