"""OpenAI wire shapes for the front door: request models, their translation into a splitserve request, the
response / stream-chunk builders, and the mapping of every ``proto.ErrorCode`` to an HTTP status.

Pure: no I/O, no NATS, no HTTP server, so all of it is unit-tested directly. Request models ignore fields
they do not know (OpenAI adds fields often; clients send them), and reject only what would change the
answer in a way this server cannot honour (``n`` > 1, ``echo``, ``best_of`` > 1, non-text content).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from proto import ErrorCode
from splitserve.client import Result
from splitserve.errors import SplitserveError

# SamplingParams' own bound; decoders cap generation at the model's context anyway.
MAX_TOKENS_CAP = 1_000_000
# OpenAI's documented default for /v1/completions (chat has none: "until the model stops").
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_STOP_SEQUENCES = 16

Kind = Literal["chat", "completion"]


# ---------------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


# status, OpenAI error type, error code. Codes are OpenAI's own where one means the same thing (clients and
# libraries match on context_length_exceeded / rate_limit_exceeded), splitserve's otherwise.
ERROR_MAP: dict[ErrorCode, tuple[int, str, str]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error", "bad_request"),
    # The front door and the router disagree on the wire version: a deployment fault, not the caller's.
    ErrorCode.UNSUPPORTED_VERSION: (500, "server_error", "unsupported_version"),
    ErrorCode.PROMPT_TOO_LONG: (413, "invalid_request_error", "context_length_exceeded"),
    ErrorCode.PAYLOAD_TOO_LARGE: (413, "invalid_request_error", "payload_too_large"),
    # The API key was known here but its tenant is not known to the backend: authenticated, not allowed.
    ErrorCode.UNKNOWN_TENANT: (403, "permission_error", "unknown_tenant"),
    ErrorCode.QUOTA_EXCEEDED: (429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorCode.NO_WORKERS: (503, "server_error", "no_workers"),
    ErrorCode.BUSY: (503, "server_error", "busy"),
    ErrorCode.WORKER_DIED: (503, "server_error", "worker_died"),
    ErrorCode.KV_TRANSFER_FAILED: (503, "server_error", "kv_transfer_failed"),
    ErrorCode.TIMEOUT: (503, "server_error", "timeout"),
    ErrorCode.EXPIRED: (503, "server_error", "expired"),
    # Cancelled by the server side (a drain, an operator): the caller did not ask for it and may retry.
    ErrorCode.CANCELLED: (503, "server_error", "cancelled"),
    ErrorCode.INTERNAL: (500, "server_error", "internal"),
}

# Statuses after which a retry can succeed unchanged: they always carry Retry-After.
_RETRY_STATUSES = frozenset({429, 503})


def api_error_from(exc: SplitserveError, *, kind: Kind) -> ApiError:
    status, typ, code = ERROR_MAP.get(exc.code, (500, "server_error", exc.code.value))
    param = None
    if exc.code in (ErrorCode.PROMPT_TOO_LONG, ErrorCode.PAYLOAD_TOO_LARGE):
        param = "messages" if kind == "chat" else "prompt"
    retry = None
    if status in _RETRY_STATUSES:
        retry = exc.retry_after_s if exc.retry_after_s is not None else 1.0
    return ApiError(status, exc.message, type=typ, param=param, code=code, retry_after_s=retry)


def api_error_from_validation(exc: ValidationError | Any) -> ApiError:
    """The first problem of a request body, with its field path as ``param`` (as OpenAI reports it)."""
    errs = exc.errors() if hasattr(exc, "errors") else []
    if not errs:
        return ApiError(400, "invalid request body")
    first = errs[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # pydantic names union members in the location ("str", "list[str]"): not part of the caller's field path.
    loc = [p for p in loc if not (p in {"str", "int", "float", "bool"} or p.startswith(("list[", "function-")))]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        return ApiError(400, "We could not parse the JSON body of your request: it is not valid JSON.")
    if first.get("type") == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    msg = msg.removeprefix("Value error, ")
    return ApiError(400, f"Invalid value for '{param}': {msg}" if param else msg, param=param, code="invalid_value")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model '{model}' does not exist or you do not have access to it.", param="model",
                    code="model_not_found")


def invalid_api_key() -> ApiError:
    return ApiError(401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


# ---------------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class _Request(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions. ``user`` and everything unknown is ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"only n=1 is supported (one choice per request); got n={v}. "
                             "Send separate requests for several completions.")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are supported; got {len(stops)}")
        return v


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


# OpenAI's newer role names, mapped onto the four the chat template knows.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
          "function": "tool"}


@dataclass(frozen=True)
class GenerateArgs:
    """A validated request, in the terms of ``splitserve.client.Client.generate``."""

    kind: Kind
    prompt: str | list[dict[str, str]] | list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool

    def client_kwargs(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "stop": self.stop}


def _sampling(req: _Request) -> tuple[float, float]:
    # OpenAI's defaults are temperature 1 and top_p 1 (sampling), not greedy.
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    if top_p == 0.0:
        # OpenAI accepts top_p=0 ("only the most likely token"): that is greedy decoding.
        temperature, top_p = 0.0, 1.0
    return temperature, top_p


def _stops(req: _Request) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def _content_text(msg: ChatMessageIn, i: int) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    texts: list[str] = []
    for j, part in enumerate(msg.content):
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"content part of type '{part.type}' is not supported: this model takes text only",
                           param=f"messages.{i}.content.{j}.type", code="invalid_value")
        texts.append(part.text)
    return "\n".join(texts)


def chat_args(req: ChatCompletionRequest, *, default_max_tokens: int) -> GenerateArgs:
    messages: list[dict[str, str]] = []
    for i, m in enumerate(req.messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise ApiError(400, f"unknown role '{m.role}'; expected one of {', '.join(sorted(_ROLES))}",
                           param=f"messages.{i}.role", code="invalid_value")
        messages.append({"role": role, "content": _content_text(m, i)})
    # max_completion_tokens supersedes the deprecated max_tokens when both are sent.
    limit = req.max_completion_tokens or req.max_tokens or default_max_tokens
    temperature, top_p = _sampling(req)
    return GenerateArgs(kind="chat", prompt=messages, max_tokens=min(limit, MAX_TOKENS_CAP), temperature=temperature,
                        top_p=top_p, seed=req.seed, stop=_stops(req), stream=bool(req.stream),
                        include_usage=bool(req.stream_options and req.stream_options.include_usage))


def completion_args(req: CompletionRequest) -> GenerateArgs:
    if req.echo:
        raise ApiError(400, "echo=true is not supported", param="echo", code="invalid_value")
    if req.best_of is not None and req.best_of != 1:
        raise ApiError(400, "only best_of=1 is supported", param="best_of", code="invalid_value")
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix", code="invalid_value")
    p = req.prompt
    prompt: str | list[int]
    if isinstance(p, str):
        prompt = p
    elif p and all(isinstance(x, int) for x in p):
        prompt = [int(x) for x in p]  # type: ignore[arg-type]  # token ids
    elif len(p) == 1:
        prompt = p[0]  # type: ignore[assignment]  # one text or one token-id list
    else:
        raise ApiError(400, f"one prompt per request is supported; got {len(p)}", param="prompt",
                       code="invalid_value")
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    temperature, top_p = _sampling(req)
    return GenerateArgs(kind="completion", prompt=prompt,
                        max_tokens=min(req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_TOKENS_CAP),
                        temperature=temperature, top_p=top_p, seed=req.seed, stop=_stops(req),
                        stream=bool(req.stream),
                        include_usage=bool(req.stream_options and req.stream_options.include_usage))


# ---------------------------------------------------------------------------------------------- responses


def finish_reason(raw: str) -> str:
    # OpenAI knows stop / length; a generation the server cut short (deadline, cancel) is truncated output,
    # which clients read from "length". The raw reason stays in the splitserve extras.
    return raw if raw in ("stop", "length") else "length"


def usage(result: Result) -> dict[str, Any]:
    u = result.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def extras(result: Result) -> dict[str, Any]:
    """splitserve's own view of the request, under one extra top-level key OpenAI clients ignore."""
    return {"request_id": result.request_id, "route": result.route, "prefill_worker": result.prefill_worker,
            "decode_worker": result.decode_worker, "ttft_ms": result.ttft_ms, "finish_reason": result.finish_reason,
            "timings": result.timings.model_dump()}


@dataclass
class Responder:
    """Builds every response object of one request, so ids, timestamps and the model name agree."""

    kind: Kind
    request_id: str
    model: str
    created: int
    include_usage: bool = False

    @property
    def id(self) -> str:
        return f"chatcmpl-{self.request_id}" if self.kind == "chat" else f"cmpl-{self.request_id}"

    def _envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else \
            "chat.completion.chunk" if chunk else "chat.completion"
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                               "system_fingerprint": None, "choices": choices}
        if chunk and self.include_usage:
            out["usage"] = None  # OpenAI sends usage: null on every chunk but the last when it was asked for
        return out

    def _choice(self, text: str | None, finish: str | None, *, role: bool = False) -> dict[str, Any]:
        if self.kind == "completion":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    # --- streaming --------------------------------------------------------------------------------
    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role and empty content; completions have no such chunk."""
        if self.kind != "chat":
            return None
        return self._envelope([self._choice("", None, role=True)], chunk=True)

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._envelope([self._choice(text, None)], chunk=True)

    def finish_chunk(self, result: Result) -> dict[str, Any]:
        choice = self._choice(None if self.kind == "chat" else "", finish_reason(result.finish_reason))
        out = self._envelope([choice], chunk=True)
        out["splitserve"] = extras(result)
        return out

    def usage_chunk(self, result: Result) -> dict[str, Any]:
        out = self._envelope([], chunk=True)
        out["usage"] = usage(result)
        return out

    # --- whole response -----------------------------------------------------------------------------
    def response(self, result: Result) -> dict[str, Any]:
        finish = finish_reason(result.finish_reason)
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": result.text,
                                                              "refusal": None},
                                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish}
        out = self._envelope([choice], chunk=False)
        out["usage"] = usage(result)
        out["splitserve"] = extras(result)
        return out
