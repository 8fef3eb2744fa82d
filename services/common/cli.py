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
