"""``splitserve usage --by``: RequestFinished events summed per tenant, per tenant and model, and per adapter."""

from __future__ import annotations

import pytest

from splitserve.ops import sum_usage, usage_rows
from splitserve.proto import ErrorCode, RequestFinished, Usage


def _ev(rid: str, tenant: str, model: str | None, lora: str | None = None, status: str = "ok",
        tokens: tuple[int, int, int] = (10, 5, 0)) -> RequestFinished:
    usage = Usage(prompt_tokens=tokens[0], completion_tokens=tokens[1], cached_tokens=tokens[2])
    return RequestFinished(request_id=rid, tenant=tenant, worker_id="decode-0", status=status,  # type: ignore[arg-type]
                           usage=usage if status == "ok" else None, model=model, lora=lora,
                           error_code=ErrorCode.NO_WORKERS if status == "error" else None)


EVENTS = [
    _ev("1", "a", "smol"), _ev("2", "a", "smol", "sql"), _ev("3", "a", "smol", "sql", tokens=(20, 1, 16)),
    _ev("4", "a", "big"), _ev("5", "b", "big"), _ev("6", "a", None, status="error"),
    # a request ended twice (the router saw the cancel too): the event with usage counts, once
    _ev("2", "a", "smol", "sql", status="cancelled"),
]


def test_rows_split_each_tenant_by_model_then_adapter() -> None:
    by_tenant = usage_rows(EVENTS)
    assert [(u.tenant, u.requests, u.completion_tokens) for u in by_tenant] == [("a", 5, 16), ("b", 1, 5)]
    by_model = {(u.tenant, u.model): (u.requests, u.prompt_tokens, u.errors) for u in usage_rows(EVENTS, "model")}
    assert by_model == {("a", None): (1, 0, 1), ("a", "big"): (1, 10, 0), ("a", "smol"): (3, 40, 0),
                        ("b", "big"): (1, 10, 0)}
    by_adapter = {(u.tenant, u.model, u.adapter): (u.requests, u.cached_tokens)
                  for u in usage_rows(EVENTS, "adapter")}
    assert by_adapter[("a", "smol", "sql")] == (2, 16) and by_adapter[("a", "smol", None)] == (1, 0)
    # every grouping sums to the same totals
    for by in ("tenant", "model", "adapter"):
        assert sum(u.prompt_tokens for u in usage_rows(EVENTS, by)) == 60
    assert sum_usage(EVENTS)["a"].requests == 5


def test_an_unknown_grouping_is_refused() -> None:
    with pytest.raises(ValueError, match="one of tenant, model, adapter"):
        usage_rows(EVENTS, "stage")


def test_stage_seconds_are_summed_per_row_and_exported_as_csv(capsys: pytest.CaptureFixture[str]) -> None:
    from splitserve.cli import _usage_csv
    from splitserve.proto import StageCost

    evs = [_ev("1", "a", "smol"), _ev("2", "a", "smol"), _ev("3", "b", "big")]
    for ev, (p, t, d) in zip(evs, ((0.5, 0.1, 2.0), (0.25, 0.0, 1.0), (1.0, 0.2, 3.0)), strict=True):
        ev.cost = StageCost(prefill_s=p, transfer_s=t, decode_s=d, cached_tokens=16, saved_s=0.05)
    rows = {(u.tenant, u.model): u for u in usage_rows(evs, "model")}
    a = rows[("a", "smol")]
    assert (a.prefill_s, a.transfer_s, a.decode_s, a.saved_s) == (0.75, 0.1, 3.0, 0.1)
    _usage_csv(list(rows.values()))
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split(",")
    assert {"tenant", "model", "prefill_s", "decode_s", "saved_s", "by_error"} <= set(header)
    first = dict(zip(header, lines[1].split(","), strict=True))
    assert (first["tenant"], first["model"], float(first["decode_s"])) == ("a", "smol", 3.0)


def test_a_cost_that_is_not_a_finite_non_negative_time_is_refused() -> None:
    from pydantic import ValidationError

    from splitserve.proto import StageCost

    for bad in ({"decode_s": float("nan")}, {"prefill_s": -1.0}, {"saved_s": float("inf")}, {"cached_tokens": -2}):
        with pytest.raises(ValidationError):
            StageCost(**bad)  # type: ignore[arg-type]
