"""``python -m splitserve.services.decode``: run one decode worker process."""

from __future__ import annotations

import typer

from splitserve.runtime.service import run_service
from splitserve.services.common import cli
from splitserve.services.common.options import EngineOptions, parse_cpus, parse_lora_modules

app = typer.Typer(add_completion=False)


def _loras(values: list[str]) -> tuple[tuple[str, str], ...]:
    try:
        return parse_lora_modules(values)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--lora-modules") from None


@app.command()
def main(
    nats_url: str = cli.NatsUrl,
    worker_id: str = typer.Option("decode-0"),
    engine: str = cli.Engine,
    model: str | None = cli.Model,
    served_model_name: str | None = cli.ServedModelName,
    lora_modules: list[str] = cli.LoraModules,
    max_loras: int = cli.MaxLoras,
    dtype: str = cli.Dtype,
    threads: int | None = cli.Threads,
    block_size: int = cli.BlockSize,
    transport: str = cli.Transport,
    cpus: str | None = cli.Cpus,
    landing_tokens: int = typer.Option(16384, help="KV landing buffer size in tokens"),
    max_batch: int = typer.Option(16, help="most sequences decoded together"),
    stream_interval: int = typer.Option(1, min=1, help="tokens per stream delta, as vLLM's --stream-interval: "
                                        "1 sends each token at once; N sends the first at once, then N at a time "
                                        "(fewer messages per token at high concurrency, burstier streams)"),
    cache_tokens: int = typer.Option(8192, help="prefix-cache capacity in tokens (0 = off)"),
    l1_tokens: int = typer.Option(0, help="CPU L1 prefix-cache tier capacity in tokens (0 = off)"),
    prefill_chunk: int = typer.Option(256, help="local prefill chunk (tokens) while other streams are active"),
    max_retire_copy_tokens: int = typer.Option(1024, help="a finished sequence longer than this is not copied "
                                               "into the prefix cache while other streams are active (the copy "
                                               "would stall them; its prefiller keeps the prompt's prefix)"),
    pool: str = typer.Option("general", help="context pool: 'long' decoders take the prompts of at least the "
                             "router's --long-prompt-tokens, so they never slow the general pool's streams"),
    handoff_grace_s: float = typer.Option(20.0, min=1.0, help="a KV reservation whose KV landed this long ago "
                                          "without its prefiller's hand-off is dropped (the routers move the "
                                          "request) instead of held for its 300 s lease"),
    log_level: str = cli.LogLevel,
    drain_timeout_s: float = cli.DrainTimeout,
    kv_connector: str = cli.KvConnector,
    kv_backend: str = cli.KvBackend,
    vllm_max_model_len: int = cli.VllmMaxModelLen,
    vllm_block_size: int | None = cli.VllmBlockSize,
    vllm_kv_cache_gib: int = cli.VllmKvCacheGib,
    vllm_gpu_memory: float = cli.VllmGpuMemory,
    vllm_tp: int = cli.VllmTp,
    vllm_kv_events: bool = cli.VllmKvEvents,
    vllm_max_lora_rank: int | None = cli.VllmMaxLoraRank,
    lmcache_config: str | None = cli.LmcacheConfig,
) -> None:
    from splitserve.routing.context import POOLS
    from splitserve.services.decode.service import DecodeService

    if pool not in POOLS:
        raise typer.BadParameter(f"must be one of {', '.join(POOLS)}", param_hint="--pool")

    opts = EngineOptions(engine=engine, model=model, dtype=dtype, threads=threads, block_size=block_size,
                         transport=transport, cpus=parse_cpus(cpus), served_model_name=served_model_name,
                         lora_modules=_loras(lora_modules), max_loras=max_loras)
    if engine == "vllm":
        from splitserve.services.common.vllm_worker import VllmOptions
        from splitserve.services.decode.vllm_service import VllmDecodeService

        vopts = VllmOptions(kv_connector=kv_connector, kv_backend=kv_backend, kv_events=vllm_kv_events,
                            max_model_len=vllm_max_model_len, engine_block_size=vllm_block_size,
                            kv_cache_gib=vllm_kv_cache_gib, gpu_memory_utilization=vllm_gpu_memory,
                            tensor_parallel_size=vllm_tp, lmcache_config=lmcache_config,
                            max_lora_rank=vllm_max_lora_rank)
        run_service(VllmDecodeService(worker_id, nats_url, opts=opts, vllm=vopts, max_batch=max_batch,
                                      pool=pool, log_level=log_level, stream_interval=stream_interval))
        return
    run_service(DecodeService(worker_id, nats_url, opts=opts, landing_tokens=landing_tokens,
                              max_batch=max_batch, cache_tokens=cache_tokens, l1_tokens=l1_tokens,
                              prefill_chunk=prefill_chunk, max_retire_copy_tokens=max_retire_copy_tokens,
                              pool=pool, log_level=log_level, drain_timeout_s=drain_timeout_s,
                              handoff_grace_s=handoff_grace_s, stream_interval=stream_interval))


if __name__ == "__main__":
    app()
