"""bench.replay's trace readers and scalers on the real trace files: shapes, caps, timing, prefix sharing.

Fast, no stack: only the files under ../shared/data/traces are read (skipped where they are absent)."""

from __future__ import annotations

import math

import pytest

from bench.replay import (
    MOONCAKE_BLOCK,
    TOKEN_HI,
    TOKEN_LO,
    TRACE_FILES,
    Scaling,
    iter_prefix_pairs,
    read_trace,
    reuse_ceiling,
    scale,
)

pytestmark = pytest.mark.skipif(not all(p.is_file() for p in TRACE_FILES.values()),
                                reason="../shared/data/traces is not present")


def test_azure_conv_rows_and_scaling() -> None:
    recs = read_trace("azure-conv", limit=50)
    assert len(recs) == 50
    # The file's first two rows (see its head): 374/44 and 396/109, 4.31 s apart.
    assert (recs[0].input_tokens, recs[0].output_tokens) == (374, 44)
    assert (recs[1].input_tokens, recs[1].output_tokens) == (396, 109)
    assert recs[0].t_s == 0.0 and recs[1].t_s == pytest.approx(4.3146, abs=1e-3)
    assert all(b.t_s >= a.t_s for a, b in zip(recs, recs[1:], strict=False))

    s = Scaling(speedup=4.0, prompt_scale=0.5, max_prompt=300, output_scale=1.0, max_output=32, salt=1)
    reqs = scale(recs, s)
    for r, rec in zip(reqs, recs, strict=True):
        assert len(r.prompt) == max(1, min(300, round(rec.input_tokens * 0.5)))
        assert r.max_tokens == max(1, min(32, rec.output_tokens))
        assert r.send_at_s == pytest.approx(rec.t_s / 4.0)
        assert all(TOKEN_LO <= t < TOKEN_HI for t in r.prompt)
        assert r.block_tokens == 0
    # Azure prompts are unique: no two share a leading block, so nothing should be reusable.
    assert len({tuple(r.prompt[:16]) for r in reqs}) == len(reqs)
    assert reuse_ceiling(reqs) == 0.0
    # The same salt gives the same prompts; another salt gives others (no cache hits across runs).
    assert [r.prompt for r in scale(recs, s)] == [r.prompt for r in reqs]
    other = scale(recs, Scaling(speedup=4.0, prompt_scale=0.5, max_prompt=300, salt=2))
    assert other[0].prompt != reqs[0].prompt


def test_azure_code_caps_prompts() -> None:
    reqs = scale(read_trace("azure-code", limit=30), Scaling(max_prompt=2000, max_output=32))
    assert max(len(r.prompt) for r in reqs) == 2000  # the code trace has several prompts above 2,000
    assert all(1 <= r.max_tokens <= 32 for r in reqs)


def test_mooncake_shapes_and_prefix_sharing() -> None:
    recs = read_trace("mooncake", limit=200)
    assert len(recs) == 200
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / MOONCAKE_BLOCK) for r in recs)
    bt = 16
    reqs = scale(recs, Scaling(block_tokens=bt, max_prompt=2000, max_output=32, salt=7))
    for r in reqs:
        assert len(r.prompt) == max(1, min(2000, math.ceil(r.source.input_tokens * bt / MOONCAKE_BLOCK)))
        assert r.block_tokens == bt
    pairs = list(iter_prefix_pairs(reqs))
    assert pairs, "the first 200 Mooncake rows contain requests with common leading hash ids"
    for a, b, k in pairs:
        n = min(k * bt, len(a.prompt), len(b.prompt))
        assert a.prompt[:n] == b.prompt[:n]  # shared leading hash ids -> identical leading tokens
        if k < min(len(a.source.hash_ids), len(b.source.hash_ids)) and len(a.prompt) > k * bt \
                and len(b.prompt) > k * bt:
            # ... and the first differing hash id gives a differing block.
            assert a.prompt[k * bt:(k + 1) * bt] != b.prompt[k * bt:(k + 1) * bt]
    assert 0.0 < reuse_ceiling(reqs) < 1.0


def test_mooncake_speedup_and_skip() -> None:
    full = read_trace("mooncake", limit=20)
    later = read_trace("mooncake", limit=10, skip=10)
    assert [r.hash_ids for r in later] == [r.hash_ids for r in full[10:20]]
    assert later[0].t_s == 0.0  # offsets restart at the first row kept
    reqs = scale(full, Scaling(speedup=10.0))
    assert reqs[-1].send_at_s == pytest.approx(full[-1].t_s / 10.0)
