"""``python -m splitserve.services.router``: run one router process."""

from __future__ import annotations

import typer

from splitserve.runtime.service import run_service
from splitserve.services.common import cli

app = typer.Typer(add_completion=False)


@app.command()
def main(
    nats_url: str = typer.Option("nats://127.0.0.1:4222", envvar="SPLITSERVE_NATS_URL"),
    worker_id: str = typer.Option("router-0"),
    model: list[str] = typer.Option([], "--model", help="a served model: NAME=PATH, or PATH (named by its files); "
                                    "repeatable: the router then serves several, routing each request to its model's "
                                    "workers (the first is the default); PATH 'bundled' or none: the bundled SmolLM2"),
    strategy: str = typer.Option("roundrobin"),
    disagg_threshold: int = typer.Option(512, help="uncached prompt tokens at or above which to use a prefiller"),
    no_worker_wait_s: float = typer.Option(5.0),
    max_stall_ms: float = typer.Option(100.0, help="most a direct prefill may pause a decoder's active streams "
                                       "(<= 0: no limit)"),
    # 400: what one fp32 core does with the bundled model on short prompts (measured 18-token prefills paused
    # streams ~130 ms; with 800 the rule estimated ~95 ms and let them stall a decoder's streams)
    decoder_prefill_tps: float = typer.Option(400.0, help="assumed decoder prefill speed until it reports one"),
    tenants: str | None = typer.Option(None, "--tenants", help="tenants file (weights, quotas); without it any "
                                       "tenant is served with no limits"),
    queue: bool = typer.Option(True, "--queue/--no-queue", envvar="SPLITSERVE_ROUTER_QUEUE",
                               help="accepted requests wait in the durable JetStream queue and are dispatched by "
                               "fair share as capacity frees (--no-queue: dispatch at once, no durability; for "
                               "comparison)"),
    queue_ack_wait_s: float = typer.Option(30.0, help="a dispatched request's queue message is redelivered this "
                                           "long after its router stops keeping it alive"),
    long_prompt_tokens: int = typer.Option(2048, help="prompts this long decode on the 'long' context pool "
                                           "when one is running (decoders started with --pool long)"),
    request_ttl_s: float = typer.Option(900.0, help="how long the request registry (SS_REQUESTS) remembers a "
                                        "request id: longer than any request waits or runs"),
    max_migrations: int = typer.Option(2, min=0, help="times a request whose worker died is moved to another "
                                       "one before it ends with worker_died (0: never moved)"),
    lora_affinity: bool = typer.Option(True, "--lora-affinity/--no-lora-affinity", help="send a LoRA adapter's "
                                       "requests to workers that have it loaded, unless they are much busier "
                                       "(--no-lora-affinity: to any worker that can load it; for comparison)"),
    model_strategy: list[str] = typer.Option([], "--model-strategy", help="NAME=STRATEGY (repeatable): the "
                                             "routing strategy of one served model (the rest use --strategy)"),
    model_disagg_threshold: list[str] = typer.Option([], "--model-disagg-threshold", help="NAME=TOKENS "
                                                     "(repeatable): one served model's disaggregation threshold "
                                                     "(the rest use --disagg-threshold)"),
    preempt: bool = typer.Option(True, "--preempt/--no-preempt", help="with contracts whose tenants' priority "
                                 "classes differ, a request the gate would dispatch may preempt a running, "
                                 "burst-funded request of a less urgent class when its decoders are full (moved "
                                 "on, never lost; never one inside its tenant's guarantee)"),
    slo_admission: bool = typer.Option(False, "--slo-admission/--no-slo-admission", help="refuse at once "
                                       "(slo_unattainable, HTTP 429 with Retry-After) a request of a tenant with "
                                       "SLO targets that no worker can meet once the queue ahead has gone, instead "
                                       "of serving it late"),
    log_level: str = typer.Option("INFO"),
    drain_timeout_s: float = cli.DrainTimeout,
) -> None:
    from splitserve.services.router.models import ModelTable, parse_model_policies
    from splitserve.services.router.service import RouterService

    try:
        table = ModelTable(list(model) or None)  # a wrong --model is a clear error here, not a traceback
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None
    try:
        policies = table.check_policies(parse_model_policies(model_strategy, model_disagg_threshold))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model-strategy / --model-disagg-threshold") from None
    run_service(RouterService(worker_id, nats_url, model=model or None, strategy=strategy,
                              disagg_threshold=disagg_threshold, no_worker_wait_s=no_worker_wait_s,
                              max_stall_ms=max_stall_ms if max_stall_ms > 0 else None,
                              decoder_prefill_tps=decoder_prefill_tps, tenants_file=tenants, queue=queue,
                              queue_ack_wait_s=queue_ack_wait_s, long_prompt_tokens=long_prompt_tokens,
                              request_ttl_s=request_ttl_s, max_migrations=max_migrations, log_level=log_level,
                              lora_affinity=lora_affinity, model_policies=policies, preempt=preempt,
                              slo_admission=slo_admission,
                              drain_timeout_s=drain_timeout_s))


if __name__ == "__main__":
    app()
