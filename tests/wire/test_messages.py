"""The wire contract: round trips, compact token ids, precise errors for malformed and wrong-version input."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve import proto
from splitserve.proto import ErrorCode, GenerateRequest, ProtocolError, StreamDelta, StreamError, StreamFinal, Subjects


def _req(**kw: object) -> GenerateRequest:
    base: dict[str, object] = {"request_id": "r1", "tenant": "acme", "stream_subject": "ss.stream.acme.r1"}
    base.update(kw)
    return GenerateRequest(**base)  # type: ignore[arg-type]


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=300))
def test_token_ids_round_trip(ids: list[int]) -> None:
    req = _req(prompt_token_ids=ids)
    assert proto.decode(proto.encode(req), GenerateRequest).prompt_token_ids == ids


def test_128k_prompt_fits_compactly() -> None:
    ids = [i % 49152 for i in range(128 * 1024)]
    data = proto.encode(_req(prompt_token_ids=ids))
    # 4 bytes per token, base64: well under the 8 MiB the stack configures, and under NATS' 1 MiB default.
    assert len(data) < 1024 * 1024
    assert proto.decode(data, GenerateRequest).prompt_token_ids == ids


def test_plain_list_token_ids_accepted() -> None:
    raw = json.dumps({"v": 1, "kind": "generate_request", "request_id": "r1", "tenant": "acme",
                      "prompt_token_ids": [1, 2, 3]}).encode()
    assert proto.decode(raw, GenerateRequest).prompt_token_ids == [1, 2, 3]


@pytest.mark.parametrize(
    ("payload", "code", "needle"),
    [
        (b"not json", ErrorCode.BAD_REQUEST, "not valid JSON"),
        (b"[1,2]", ErrorCode.BAD_REQUEST, "JSON object"),
        (b'{"v": 2, "request_id": "r"}', ErrorCode.UNSUPPORTED_VERSION, "v=2"),
        (b'{"v": 1, "request_id": "r", "tenant": "t", "stream_subject": "s"}', ErrorCode.BAD_REQUEST,
         "exactly one of prompt"),
        (b'{"v": 1, "request_id": "a.b", "tenant": "t", "prompt": "x"}',
         ErrorCode.BAD_REQUEST, "request_id"),
        (b'{"v": 1, "request_id": "r", "tenant": "t", "prompt": "x",'
         b' "sampling": {"max_tokens": 0}}', ErrorCode.BAD_REQUEST, "max_tokens"),
        (b'{"v": 1, "request_id": "r", "tenant": "t", "prompt_token_ids": "@@@"}',
         ErrorCode.BAD_REQUEST, "base64"),
        # A stream subject is derived from (tenant, request id); any other is refused at decoding.
        (b'{"v": 1, "request_id": "r", "tenant": "t", "prompt": "x", "stream_subject": "$KV.SS_QUOTA.b"}',
         ErrorCode.BAD_REQUEST, "stream_subject must be"),
        (b'{"v": 1, "request_id": "r", "tenant": "t", "prompt": "x", "stream_subject": "ss.stream.b.r"}',
         ErrorCode.BAD_REQUEST, "stream_subject must be"),
    ],
)
def test_malformed_messages_give_precise_errors(payload: bytes, code: ErrorCode, needle: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        proto.decode(payload, GenerateRequest)
    assert ei.value.code == code
    assert needle in ei.value.message


MB = 1_000_000


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"v": "v" * MB}, "1,000,000 chars"),
        ({"v": 1, "tenant": "t" * MB, "request_id": "r", "prompt": "x"}, "tenant"),
        ({"v": 1, "tenant": "t", "request_id": "r" * MB, "prompt": "x"}, "request id"),
        ({"v": 1, "tenant": "t", "request_id": "r", "prompt_token_ids": [1, int("9" * 4000)]}, "token id"),
        ({"v": 1, "tenant": "t", "request_id": "r", "prompt": "x", "sampling": {"k" * MB: 1}}, "sampling.kkk"),
        ({"v": 1, "tenant": "t", "request_id": "r", "prompt": "x", "sampling": {"stop": ["s" * MB]}},
         "at most 1,024 characters"),
    ],
)
def test_an_error_quotes_a_huge_value_cut_short(body: dict[str, object], needle: str) -> None:
    """An error names the value it refuses, cut to a bound: a megabyte field must not come back as a megabyte
    error reply, nor be written into every log line that carries the error."""
    with pytest.raises(ProtocolError) as ei:
        proto.decode(json.dumps(body).encode(), GenerateRequest)
    assert needle in ei.value.message and len(ei.value.message) < 1000, ei.value.message[:2000]


def test_stop_strings_up_to_the_bound_are_taken() -> None:
    req = GenerateRequest(request_id="r", tenant="t", prompt="x",
                          sampling=proto.SamplingParams(stop=["s" * proto.MAX_STOP_CHARS] * 16))
    assert proto.decode(proto.encode(req), GenerateRequest).sampling.stop == req.sampling.stop


def test_stream_union_decodes_each_kind() -> None:
    d = StreamDelta(request_id="r", seq=0, token_ids=[5], text="a")
    e = StreamError(request_id="r", code=ErrorCode.WORKER_DIED, message="gone")
    assert isinstance(proto.decode_stream(proto.encode(d)), StreamDelta)
    assert isinstance(proto.decode_stream(proto.encode(e)), StreamError)
    f = StreamFinal(request_id="r", seq=1, token_ids=[5], text="a", finish_reason="stop",
                    usage=proto.Usage(prompt_tokens=3, completion_tokens=1), route=proto.Route.DIRECT,
                    prefill_worker=None, decode_worker="d0")
    assert proto.decode_stream(proto.encode(f)).usage.prompt_tokens == 3


def test_descriptor_bytes_survive_json() -> None:
    blob = bytes(range(256))
    r = proto.KvReserveReply(request_id="r", ok=True, descriptor=blob)
    assert proto.decode(proto.encode(r), proto.KvReserveReply).descriptor == blob


def test_subjects_reject_injection() -> None:
    assert Subjects.request("acme") == "ss.req.acme"
    for bad in ["a.b", "*", ">", "a b", ""]:
        with pytest.raises(ValueError):
            Subjects.request(bad)


def test_queue_lanes_are_named_by_the_contract() -> None:
    # the routers' work queue and `splitserve k8s` (lanes, KEDA's scaler) both name lanes from here
    assert [Subjects.priority_class(p) for p in (-1, 0, 3, 4, 7, 8, 9, 99)] == [0, 0, 0, 1, 1, 2, 2, 2]
    assert Subjects.QUEUE_CLASSES == 3
    assert (Subjects.queue("acme", 1, "m-1"), Subjects.queue_consumer("acme", 1, "m-1")) == (
        "ss.q.acme.m-1.p1", "dispatch_acme_m-1_p1")
    for bad in ["a.b", "*", ">", "a b", ""]:
        with pytest.raises(ValueError):
            Subjects.queue_consumer(bad, 0, "m")
        with pytest.raises(ValueError):
            Subjects.queue("acme", 0, bad)
    assert proto.subject_identity("ss.q.acme.m-1.p0") == ("acme", None)


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct.Q4_1", "org/model", "a", "x" * 256, "naïve/🙂", ".", "*>"])
def test_a_model_pool_token_is_a_subject_token_and_tells_names_apart(name: str) -> None:
    pool = proto.model_pool(name)
    assert Subjects.queue("t", 0, pool).count(".") == 4  # one token: no dot, wildcard or space
    assert pool == proto.model_pool(name)  # every router and `splitserve k8s lanes` agree
    assert proto.model_pool(name + "x") != pool


def test_model_names_differing_only_where_a_token_cannot_hold_them_get_lanes_of_their_own() -> None:
    assert len({proto.model_pool(n) for n in ("a.b", "a_b", "a/b", "a b", "a*b")}) == 5


def test_router_replica_messages_round_trip_and_subjects() -> None:
    from splitserve.proto import (
        DispatchNote,
        FairShareReport,
        QueuedRequest,
        RequestRecord,
        TenantUsage,
        decode,
        encode,
    )
    from splitserve.proto.subjects import Subjects

    rec = RequestRecord(request_id="r1", tenant="t", state="queued", stream_subject="ss.stream.t.r1",
                        prompt_tokens=5, max_tokens=8, accepted_by="router-0")
    assert decode(encode(rec), RequestRecord) == rec
    usage = TenantUsage(tenant="t", inflight={"r1": (1.5, 13)}, settled=[(2.0, 7)], finishes=[3.0])
    assert decode(encode(usage), TenantUsage).inflight == {"r1": (1.5, 13)}
    for m in (DispatchNote(router_id="router-1", request_id="r1", decoder="d0", blocks=2),
              FairShareReport(router_id="router-1", incarnation="abc", virtual_tokens={"t": 12.5})):
        assert decode(encode(m), type(m)) == m
    # a QueuedRequest from an older router (no record revision) still decodes
    assert QueuedRequest.model_fields["record_revision"].default is None
    assert Subjects.routed("router-1") == "ss.routed.router-1" and Subjects.fair("router-1") == "ss.fair.router-1"
    with pytest.raises(ValueError):
        Subjects.routed("router.1")


def test_one_served_model_has_the_single_pool_and_several_one_each() -> None:
    assert proto.model_pools(["any/name"]) == [proto.SINGLE_POOL] == ["default"]  # renaming files moves no lane
    assert proto.model_pools(["a", "b"]) == [proto.model_pool("a"), proto.model_pool("b")]
    assert proto.model_pools([]) == []
