"""The migration fields and messages on the wire: a first-attempt DecodeJob from an older sender still decodes
(defaults), a resumed one round-trips with its tokens packed, and the new subjects validate their tokens."""

from __future__ import annotations

import json

import pytest

from splitserve import proto
from splitserve.proto import DecodeJob, ErrorCode, JobBounced, RevokeJob, RevokeReply, Route, SamplingParams, Subjects


def _job(**kw: object) -> DecodeJob:
    return DecodeJob(request_id="r1", tenant="t", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=8),
                     stream_subject="ss.stream.t.r1", route=Route.DIRECT, decoder_id="d0", created_ms=1.0, **kw)


def test_older_decode_job_decodes_as_first_attempt() -> None:
    doc = json.loads(proto.encode(_job()))
    for k in ("attempt", "resume_token_ids", "resume_text", "start_seq"):
        doc.pop(k)
    job = proto.decode(json.dumps(doc).encode(), DecodeJob)
    assert (job.attempt, job.resume_token_ids, job.resume_text, job.start_seq) == (0, [], "", 0)
    assert job.context_token_ids() == [1, 2, 3]


def test_resumed_decode_job_round_trips() -> None:
    job = _job(attempt=2, resume_token_ids=[7, 8], resume_text="ab", start_seq=2)
    raw = proto.encode(job)
    assert b"[7, 8]" not in raw and b"[7,8]" not in raw  # packed like the prompt
    back = proto.decode(raw, DecodeJob)
    assert back == job and back.context_token_ids() == [1, 2, 3, 7, 8]
    with pytest.raises(proto.ProtocolError):
        proto.decode(proto.encode(job).replace(b'"start_seq":2', b'"start_seq":-1'), DecodeJob)


def test_revoke_and_bounce_messages() -> None:
    r = RevokeJob(request_id="r1", tenant="t", attempt=1, force=True, reason="dead")
    assert proto.decode(proto.encode(r), RevokeJob) == r
    assert proto.decode(proto.encode(RevokeReply(request_id="r1", revoked=False, running=True)), RevokeReply).running
    b = JobBounced(request_id="r1", tenant="t", worker_id="p0", attempt=0, code=ErrorCode.KV_TRANSFER_FAILED,
                   message="push failed")
    assert proto.decode(proto.encode(b), JobBounced) == b
    assert Subjects.revoke("d0") == "ss.decode.d0.revoke"
    assert Subjects.bounced("t", "r1") == "ss.evt.bounced.t.r1"
    with pytest.raises(ValueError):
        Subjects.bounced("t.x", "r1")
