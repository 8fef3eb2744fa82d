"""The OpenAI translation, with no HTTP and no NATS: request validation and mapping onto a splitserve
request, response and chunk shapes, and the HTTP status of every proto.ErrorCode."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve import errors
from splitserve.proto import ErrorCode
from splitserve.services.frontend import openai_api as oa
from tests.frontend.fakes import make_result


def chat(**kw: object) -> oa.ChatCompletionRequest:
    return oa.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **kw})


def completion(**kw: object) -> oa.CompletionRequest:
    return oa.CompletionRequest.model_validate({"prompt": "Once upon a time", **kw})


def validation_error(model: type[oa._Request], body: dict[str, object]) -> oa.ApiError:
    with pytest.raises(ValidationError) as ei:
        model.model_validate(body)
    return oa.api_error_from_validation(ei.value)


# --- requests -------------------------------------------------------------------------------------------


def test_chat_defaults_follow_openai() -> None:
    a = oa.chat_args(chat(), default_max_tokens=8192)
    assert a.kind == "chat" and a.prompt == [{"role": "user", "content": "Hi"}]
    assert (a.temperature, a.top_p, a.seed, a.stop) == (1.0, 1.0, None, [])
    assert a.max_tokens == 8192 and not a.stream and not a.include_usage


def test_chat_sampling_fields_are_carried() -> None:
    a = oa.chat_args(chat(temperature=0, top_p=0.5, seed=7, stop="\n", max_tokens=5, stream=True,
                          stream_options={"include_usage": True}, user="u-1", frequency_penalty=0.0,
                          some_future_field={"x": 1}), default_max_tokens=100)
    assert (a.temperature, a.top_p, a.seed, a.stop, a.max_tokens) == (0.0, 0.5, 7, ["\n"], 5)
    assert a.stream and a.include_usage
    # user is the session key; a neutral frequency_penalty and an unknown field change nothing
    assert a.client_kwargs() == {"max_tokens": 5, "temperature": 0.0, "top_p": 0.5, "seed": 7, "stop": ["\n"],
                                 "session_id": "u-1"}


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert oa.chat_args(chat(max_tokens=9, max_completion_tokens=3), default_max_tokens=100).max_tokens == 3
    assert oa.chat_args(chat(max_tokens=10**9), default_max_tokens=100).max_tokens == oa.MAX_TOKENS_CAP


def test_top_p_zero_means_greedy() -> None:
    a = oa.chat_args(chat(top_p=0, temperature=0.8), default_max_tokens=10)
    assert (a.temperature, a.top_p) == (0.0, 1.0)


def test_chat_roles_and_content_parts() -> None:
    req = oa.ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]})
    assert oa.chat_args(req, default_max_tokens=1).prompt == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""}]


def test_chat_rejects_images_and_unknown_roles() -> None:
    img = oa.ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(oa.ApiError) as ei:
        oa.chat_args(img, default_max_tokens=1)
    assert ei.value.status == 400 and ei.value.param == "messages.0.content.0.type"
    with pytest.raises(oa.ApiError) as ei:
        oa.chat_args(chat(messages=[{"role": "wizard", "content": "x"}]), default_max_tokens=1)
    assert ei.value.param == "messages.0.role"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": -1}, "seed"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["", "a"]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [str(i) for i in range(17)]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": "s" * 1025}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
])
def test_invalid_chat_bodies_are_400_with_the_param(body: dict[str, object], param: str) -> None:
    err = validation_error(oa.ChatCompletionRequest, body)
    assert err.status == 400 and err.param == param and err.type == "invalid_request_error"
    assert param in err.message or err.code == "missing_required_parameter"


def test_n_error_message_is_clear() -> None:
    err = validation_error(oa.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "n": 2})
    assert "only n=1 is supported" in err.message and "Value error" not in err.message
    assert oa.chat_args(chat(n=1), default_max_tokens=1)  # n=1 and n=null are fine
    assert oa.chat_args(chat(n=None), default_max_tokens=1)


def test_completion_prompt_forms() -> None:
    assert oa.completion_args(completion()).prompt == "Once upon a time"
    assert oa.completion_args(completion(prompt=["one"])).prompt == "one"
    assert oa.completion_args(completion(prompt=[1, 2, 3])).prompt == [1, 2, 3]
    assert oa.completion_args(completion(prompt=[[4, 5]])).prompt == [4, 5]
    assert oa.completion_args(completion()).max_tokens == oa.COMPLETIONS_DEFAULT_MAX_TOKENS
    for bad in (["a", "b"], [[1], [2]]):
        with pytest.raises(oa.ApiError) as ei:
            oa.completion_args(completion(prompt=bad))
        assert ei.value.status == 400 and ei.value.param == "prompt"


@pytest.mark.parametrize("field", [{"echo": True}, {"best_of": 2}, {"suffix": "end"}])
def test_completion_options_that_would_change_the_answer_are_rejected(field: dict[str, object]) -> None:
    with pytest.raises(oa.ApiError) as ei:
        oa.completion_args(completion(**field))
    assert ei.value.status == 400 and ei.value.param == next(iter(field))
    oa.completion_args(completion(echo=False, best_of=1, logprobs=None))  # the harmless defaults pass


def test_missing_prompt_and_bad_json() -> None:
    err = validation_error(oa.CompletionRequest, {"model": "m"})
    assert err.status == 400 and err.param == "prompt" and err.code == "missing_required_parameter"


# --- errors ----------------------------------------------------------------------------------------------


def test_every_error_code_has_a_status() -> None:
    assert set(oa.ERROR_MAP) == set(ErrorCode)


@pytest.mark.parametrize(("code", "status"), [
    (ErrorCode.BAD_REQUEST, 400), (ErrorCode.UNSUPPORTED_VERSION, 500), (ErrorCode.PROMPT_TOO_LONG, 413),
    (ErrorCode.PAYLOAD_TOO_LARGE, 413), (ErrorCode.UNKNOWN_TENANT, 403), (ErrorCode.QUOTA_EXCEEDED, 429),
    (ErrorCode.NO_WORKERS, 503), (ErrorCode.BUSY, 503), (ErrorCode.WORKER_DIED, 503),
    (ErrorCode.KV_TRANSFER_FAILED, 503), (ErrorCode.TIMEOUT, 503), (ErrorCode.EXPIRED, 503),
    (ErrorCode.CANCELLED, 503), (ErrorCode.INTERNAL, 500),
])
def test_error_code_statuses(code: ErrorCode, status: int) -> None:
    err = oa.api_error_from(errors.SplitserveError("boom", code=code), kind="chat")
    assert err.status == status
    body = err.body()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"] == "boom"
    assert ("Retry-After" in err.headers()) == (status in (429, 503))


def test_retry_after_uses_the_servers_hint() -> None:
    err = oa.api_error_from(errors.QuotaExceeded("slow down", retry_after_s=2.2), kind="chat")
    assert err.headers() == {"Retry-After": "3"} and err.code == "rate_limit_exceeded"
    assert oa.api_error_from(errors.NoWorkers("none"), kind="chat").headers() == {"Retry-After": "1"}


def test_prompt_too_long_names_the_prompt_param() -> None:
    assert oa.api_error_from(errors.PromptTooLong("long"), kind="chat").param == "messages"
    err = oa.api_error_from(errors.PromptTooLong("long"), kind="completion")
    assert err.param == "prompt" and err.code == "context_length_exceeded"


def test_client_side_unavailable_maps_to_503() -> None:
    assert oa.api_error_from(errors.Unavailable("no router"), kind="chat").status == 503


# --- responses -------------------------------------------------------------------------------------------


def test_chat_response_shape() -> None:
    r = oa.Responder(kind="chat", request_id="abc", model="m", created=1)
    out = r.response(make_result("Paris.", cached=4, prompt_tokens=10, completion_tokens=2))
    assert out["id"] == "chatcmpl-abc" and out["object"] == "chat.completion" and out["model"] == "m"
    assert out["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Paris.", "refusal": None},
                               "logprobs": None, "finish_reason": "stop"}]
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 4}}
    assert out["splitserve"]["route"] == "direct" and out["splitserve"]["decode_worker"] == "decode-0"
    assert out["splitserve"]["ttft_ms"] == 12.5


def test_completion_response_shape() -> None:
    r = oa.Responder(kind="completion", request_id="abc", model="m", created=1)
    out = r.response(make_result("there was", finish="length"))
    assert out["id"] == "cmpl-abc" and out["object"] == "text_completion"
    assert out["choices"] == [{"index": 0, "text": "there was", "logprobs": None, "finish_reason": "length"}]


def test_chat_chunks() -> None:
    r = oa.Responder(kind="chat", request_id="abc", model="m", created=1, include_usage=True)
    first = r.first_chunk()
    assert first is not None and first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert r.text_chunk("Hi")["choices"][0] == {"index": 0, "delta": {"content": "Hi"}, "logprobs": None,
                                                "finish_reason": None}
    res = make_result("Hi")
    fin = r.finish_chunk(res)
    assert fin["choices"][0]["delta"] == {} and fin["choices"][0]["finish_reason"] == "stop"
    assert fin["splitserve"]["request_id"] == "r"
    u = r.usage_chunk(res)
    assert u["choices"] == [] and u["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}


def test_completion_chunks_have_no_role_chunk_and_no_usage_key_unless_asked() -> None:
    r = oa.Responder(kind="completion", request_id="abc", model="m", created=1)
    assert r.first_chunk() is None
    c = r.text_chunk("x")
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "x" and "usage" not in c


@pytest.mark.parametrize(("raw", "mapped"), [("stop", "stop"), ("length", "length"), ("expired", "abort"),
                                             ("cancelled", "abort")])
def test_finish_reasons(raw: str, mapped: str) -> None:
    assert oa.finish_reason(raw) == mapped
