"""What a worker's heartbeat says about its load: one rule for the live workers (``services/decode``,
``services/prefill``) and the simulator's (``splitserve.sim.workers``), so the routing policy decides on the same
figures from both. Written twice, the two drifted: the live decoder left the sequence it was prefilling out of
its running count (invisible to the stall rule), and the live prefiller counted the batch it was running as
queued prefill work while the simulated one did not.

Pure: each worker passes its own counts; the rule of what counts where is here."""

from __future__ import annotations

from splitserve.proto import WorkerLoad


def decoder_load(*, decoding: int, prefilling: int, waiting: int, prefill_tokens_left: int,
                 waiting_prefill_tokens: int, max_seqs: int | None, free_blocks: int, total_blocks: int,
                 used_blocks: int, reserved_blocks: int = 0, cached_blocks: int = 0,
                 prefill_tokens_per_s: float | None = None, step_ms: float | None = None,
                 busy_s: dict[str, float] | None = None) -> WorkerLoad:
    """A decoder's load. ``prefilling``: sequences it is prefilling itself (direct requests), which count as
    running (its heartbeat lists them, so the routers stop counting them as their own pending load);
    ``waiting``: requests not admitted yet. Queued prefill work is what is left of the prefills under way plus
    the prompts of waiting requests that need one (``waiting_prefill_tokens``: not those whose KV landed)."""
    return WorkerLoad.model_construct(
        active_seqs=decoding + prefilling, queued_requests=waiting,
        queued_prefill_tokens=prefill_tokens_left + waiting_prefill_tokens, free_blocks=free_blocks,
        total_blocks=total_blocks, reserved_blocks=reserved_blocks, used_blocks=used_blocks,
        cached_blocks=cached_blocks, prefill_tokens_per_s=prefill_tokens_per_s, max_seqs=max_seqs,
        step_ms=None if step_ms is None else round(step_ms, 2), busy_s=busy_s or {})


def prefiller_load(*, running: int, waiting: int, running_tokens: int, waiting_tokens: int,
                   cached_blocks: int = 0, prefill_tokens_per_s: float | None = None,
                   busy_s: dict[str, float] | None = None) -> WorkerLoad:
    """A prefiller's load: the jobs it is prefilling now count as running, and their tokens as queued prefill
    work until they are done (a new job waits for them too), with the waiting jobs' tokens. No KV pool figures:
    a prefiller's pool only stages a prompt's KV on its way out (the policy's overflow check is a decoder's)."""
    return WorkerLoad.model_construct(
        active_seqs=running, queued_requests=waiting, queued_prefill_tokens=running_tokens + waiting_tokens,
        free_blocks=0, total_blocks=0, reserved_blocks=0, used_blocks=0, cached_blocks=cached_blocks,
        prefill_tokens_per_s=prefill_tokens_per_s, max_seqs=None, step_ms=None, busy_s=busy_s or {})
