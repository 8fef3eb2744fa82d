"""Typer options shared by the worker entry points, so ``up`` passes the same flags to every worker."""

from __future__ import annotations

import typer

NatsUrl = typer.Option("nats://127.0.0.1:4222", envvar="SPLITSERVE_NATS_URL",
                       help="NATS server, or every server of a cluster comma-separated (fail over between them)")
Engine = typer.Option("hf", help="engine backend: hf | mock | vllm")
Model = typer.Option(None, help="model path (default: the bundled SmolLM2-135M-Instruct)")
Dtype = typer.Option("float32")
ServedModelName = typer.Option(None, help="the name this worker serves its model under (its heartbeats' model, "
                               "which routers match requests' model against; default: the engine's model name)")
LoraModules = typer.Option([], "--lora-modules", help="a LoRA adapter to load at start, NAME=PATH (a PEFT "
                           "folder; repeatable): requests whose model is NAME run with it (hf and vllm engines)")
MaxLoras = typer.Option(0, "--max-loras", min=0, help="LoRA adapters loaded at once: each on first use, the least "
                        "recently used unloaded to make room (0: every --lora-modules adapter, at start); vllm: "
                        "adapters in one batch (vLLM's --max-loras; every --lora-modules adapter stays registered)")
Threads = typer.Option(None, help="torch intra-op threads")
BlockSize = typer.Option(16, help="KV block size in tokens")
Transport = typer.Option("nixl", help="KV transport: nixl | tcp")
LogLevel = typer.Option("INFO")
DrainTimeout = typer.Option(10.0, envvar="SPLITSERVE_DRAIN_TIMEOUT_S",
                            help="on SIGTERM: at most this long to finish what the service holds before handing "
                                 "it over (routers move a decoder's streams elsewhere) and exiting")
Cpus = typer.Option(None, help="pin to these cores, e.g. '0' or '0-3,6' (torch threads follow)")

# vllm engine only (ignored by hf and mock); `splitserve up` passes the environment on, so the
# SPLITSERVE_VLLM_* variables configure every vLLM worker of a stack
KvConnector = typer.Option("nixl", envvar="SPLITSERVE_KV_CONNECTOR",
                           help="vllm: KV connector between pools: nixl | lmcache | none")
KvBackend = typer.Option("UCX", envvar="SPLITSERVE_KV_BACKEND",
                         help="vllm: NIXL transport backend: UCX | LIBFABRIC (AWS EFA)")
VllmMaxModelLen = typer.Option(4096, envvar="SPLITSERVE_VLLM_MAX_MODEL_LEN",
                               help="vllm: max model length (prompt + output)")
VllmBlockSize = typer.Option(None, envvar="SPLITSERVE_VLLM_BLOCK_SIZE",
                             help="vllm: KV block size (default 32 on CPU, 16 on GPU)")
VllmKvCacheGib = typer.Option(1, envvar="SPLITSERVE_VLLM_KV_CACHE_GIB",
                              help="vllm on CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)")
VllmGpuMemory = typer.Option(0.85, envvar="SPLITSERVE_VLLM_GPU_MEMORY",
                             help="vllm on GPU: fraction of GPU memory vLLM may use")
VllmTp = typer.Option(1, envvar="SPLITSERVE_VLLM_TP", help="vllm: tensor parallel size")
VllmKvEvents = typer.Option(True, envvar="SPLITSERVE_VLLM_KV_EVENTS",
                            help="vllm: bridge vLLM's KV events into the cache index")
VllmMaxLoraRank = typer.Option(None, envvar="SPLITSERVE_VLLM_MAX_LORA_RANK",
                               help="vllm: the largest LoRA rank it serves (1, 8, 16, 32, 64, 128, 256, 320, 512; "
                                    "default: the --lora-modules adapters' largest, 16 with none)")
LmcacheConfig = typer.Option(None, envvar="LMCACHE_CONFIG_FILE",
                             help="vllm + lmcache: the LMCache PD config file of this worker")
