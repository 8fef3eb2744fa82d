"""The load a worker reports (``splitserve.routing.load``): one rule for the live workers and the simulator's."""

from __future__ import annotations

import inspect

from splitserve.routing.load import decoder_load, prefiller_load


def test_a_decoder_counts_its_own_prefills_as_running_and_their_work_as_queued() -> None:
    ld = decoder_load(decoding=3, prefilling=1, waiting=2, prefill_tokens_left=120, waiting_prefill_tokens=500,
                      max_seqs=8, free_blocks=10, total_blocks=64, used_blocks=40, step_ms=12.3456)
    assert (ld.active_seqs, ld.queued_requests, ld.queued_prefill_tokens) == (4, 2, 620)
    assert ld.max_seqs == 8 and ld.step_ms == 12.35 and ld.free_blocks == 10


def test_a_prefiller_counts_the_batch_it_runs_as_queued_work_until_done() -> None:
    ld = prefiller_load(running=2, waiting=3, running_tokens=900, waiting_tokens=1500, prefill_tokens_per_s=2000.0)
    assert (ld.active_seqs, ld.queued_requests, ld.queued_prefill_tokens) == (2, 3, 2400)
    assert ld.max_seqs is None and ld.prefill_tokens_per_s == 2000.0
    assert ld.total_blocks == 0  # its pool only stages a prompt's KV on the way out: not a cache to fill


def test_the_live_workers_and_the_simulator_report_by_these_rules() -> None:
    """Written twice, the two drifted (issue 25): both sides call the shared functions."""
    from splitserve.services.decode.service import DecodeService
    from splitserve.services.prefill.service import PrefillService
    from splitserve.sim.workers import DecodeWorker, PrefillWorker

    assert "decoder_load(" in inspect.getsource(DecodeService.load)
    assert "decoder_load(" in inspect.getsource(DecodeWorker.load)
    assert "prefiller_load(" in inspect.getsource(PrefillService.load)
    assert "prefiller_load(" in inspect.getsource(PrefillWorker.load)
