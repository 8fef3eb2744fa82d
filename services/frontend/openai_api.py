"""OpenAI wire shapes for the front door: request models, their translation into a splitserve request, the
response / stream-chunk builders, and the mapping of every ``proto.ErrorCode`` to an HTTP status.

Pure: no I/O, no NATS, no HTTP server, so all of it is unit-tested directly.

Honest by construction: every field OpenAI (or vLLM's server) defines is either implemented (sampling,
``stop``, ``logprobs`` / ``top_logprobs``, ``ignore_eos``, ``min_tokens``, ``priority``, ``user`` as the
session key, ``stream_options.include_usage``) or, when sent with a value that would change the answer,
rejected with a 400 naming it (:data:`UNSUPPORTED`: tools, response_format, penalties, logit_bias, top_k,
min_p, ...). Fields nobody defined are ignored (clients send vendor extras) and logged once per name.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from splitserve.client import Result
from splitserve.errors import SplitserveError
from splitserve.proto import MAX_STOP_CHARS, ErrorCode, TokenLogprob
from splitserve.proto.quoting import clipped

# SamplingParams' own bound; decoders cap generation at the model's context anyway.
MAX_TOKENS_CAP = 1_000_000
# OpenAI's documented default for /v1/completions (chat has none: "until the model stops").
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_STOP_SEQUENCES = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit (vLLM's default max_logprobs too)
PRIORITY_CLASSES = 10  # splitserve's per-tenant priority classes 0 (most urgent) .. 9
# Token counts and token ids travel as 32-bit integers at most: anything larger is the caller's error (a 400
# here), not an overflow when the request is encoded (which was a 500).
MAX_INT32 = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]

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
    ErrorCode.FORBIDDEN: (403, "permission_error", "forbidden"),
    ErrorCode.MODEL_NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    ErrorCode.MODEL_NOT_ALLOWED: (403, "permission_error", "model_not_allowed"),
    ErrorCode.QUOTA_EXCEEDED: (429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorCode.SLO_UNATTAINABLE: (429, "rate_limit_error", "slo_unattainable"),
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
    elif exc.code in (ErrorCode.MODEL_NOT_FOUND, ErrorCode.MODEL_NOT_ALLOWED):
        param = "model"
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
    param = clipped(".".join(loc), 200) or None  # a location may be a key the caller wrote: bounded, as a value
    msg = clipped(str(first.get("msg", "invalid value")))
    if first.get("type") == "json_invalid":
        return ApiError(400, "We could not parse the JSON body of your request: it is not valid JSON.")
    if first.get("type") == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    msg = msg.removeprefix("Value error, ")
    return ApiError(400, f"Invalid value for '{param}': {msg}" if param else msg, param=param, code="invalid_value")


def model_not_found(model: str, served: list[str] | None = None) -> ApiError:
    """OpenAI's 404 for an unknown model; ``served``: the names that are served, listed in the message."""
    msg = f"The model '{model}' does not exist or you do not have access to it."
    if served:
        msg += f" Served models: {', '.join(served)}."
    return ApiError(404, msg, param="model", code="model_not_found")


def invalid_api_key() -> ApiError:
    return ApiError(401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


# ---------------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("continuous_usage_stats is not supported; usage comes in the last chunk")
        return v


def _neutral(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


# Fields this server does not implement, with the values that ask for nothing (accepted: many clients send
# defaults explicitly); any other value is a 400 naming the field.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": _neutral(None, []),
    "tool_choice": _neutral(None, "none"),
    "functions": _neutral(None, []),
    "function_call": _neutral(None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text" and len(v) == 1),
    "presence_penalty": _neutral(None, 0, 0.0),
    "frequency_penalty": _neutral(None, 0, 0.0),
    "repetition_penalty": _neutral(None, 1, 1.0),
    "logit_bias": _neutral(None, {}),
    "top_k": _neutral(None, -1, 0),
    "min_p": _neutral(None, 0, 0.0),
    "prompt_logprobs": _neutral(None),
    "use_beam_search": _neutral(None, False),
    "length_penalty": _neutral(None, 1, 1.0),
    "stop_token_ids": _neutral(None, []),
    "bad_words": _neutral(None, []),
    "allowed_token_ids": _neutral(None),
    "include_stop_str_in_output": _neutral(None, False),
    "skip_special_tokens": _neutral(None, True),
    "spaces_between_special_tokens": _neutral(None, True),
    "truncate_prompt_tokens": _neutral(None),
    "guided_json": _neutral(None),
    "guided_regex": _neutral(None),
    "guided_choice": _neutral(None),
    "guided_grammar": _neutral(None),
    "structured_outputs": _neutral(None),
    "modalities": _neutral(None, ["text"]),
    "audio": _neutral(None),
    "prediction": _neutral(None),
    "reasoning_effort": _neutral(None),
    "web_search_options": _neutral(None),
    "store": _neutral(None, False),
    "return_tokens_as_token_ids": _neutral(None, False),
    "kv_transfer_params": _neutral(None),
    "chat_template": _neutral(None),
    "chat_template_kwargs": _neutral(None, {}),
    "continue_final_message": _neutral(None, False),
    "add_generation_prompt": _neutral(None, True),
    "mm_processor_kwargs": _neutral(None),
}
# Defined by OpenAI but with no effect on the answer here: accepted without a warning.
HARMLESS = frozenset({"metadata", "service_tier", "parallel_tool_calls", "verbosity", "documents",
                      "request_id", "add_special_tokens"})

_warned: set[str] = set()
_warned_lock = threading.Lock()


def unknown_fields_once(extra: dict[str, Any] | None) -> list[str]:
    """Names in ``extra`` not seen before (process-wide): the caller logs each once, not per request."""
    new = []
    with _warned_lock:
        for name in extra or {}:
            if name not in UNSUPPORTED and name not in HARMLESS and name not in _warned:
                _warned.add(name)
                new.append(name)
    return new


def check_unsupported(req: BaseModel) -> None:
    extra = req.model_extra or {}
    for name, neutral in UNSUPPORTED.items():
        if name in extra and not neutral(extra[name]):
            raise ApiError(400, f"'{name}' is not supported by this server (it would change the answer in a way "
                           f"it cannot honour); omit it or send its default", param=name,
                           code="unsupported_parameter")


class _Request(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions. Unknown fields land in ``model_extra``:
    :func:`check_unsupported` rejects the unsupported ones, the rest are ignored (and logged once)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(default=None, ge=0, le=MAX_INT32)
    # vLLM's semantics: lower is served earlier; splitserve has classes 0..9 per tenant.
    priority: int | None = Field(default=None, ge=0, lt=PRIORITY_CLASSES)
    user: str | None = Field(default=None, max_length=256)  # the session key (sticky routing) unless a header
    # vLLM's prefix-cache salt: honoured within the caller's tenant (the router combines it with the tenant's)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

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
        if (longest := max(map(len, stops), default=0)) > MAX_STOP_CHARS:
            raise ValueError(f"a stop sequence is at most {MAX_STOP_CHARS:,} characters; one has {longest:,}")
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
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # completions: how many alternatives


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
    logprobs: int | None = None  # None: none; k: each token's and the k most likely alternatives
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    session_id: str | None = None
    model: str | None = None  # the served model's name (spans and logs)
    cache_salt: str | None = None  # the caller's prefix-cache salt, within its tenant

    def client_kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature,
                               "top_p": self.top_p, "seed": self.seed, "stop": self.stop}
        # only what differs from the defaults, so a caller that sends none of these builds the same request
        for name, default in (("logprobs", None), ("ignore_eos", False), ("min_tokens", 0), ("priority", 0),
                              ("session_id", None), ("model", None), ("cache_salt", None)):
            if getattr(self, name) != default:
                out[name] = getattr(self, name)
        return out

    def served(self, *, model: str | None, session_id: str | None) -> GenerateArgs:
        """The same request with what the HTTP layer knows: the served model, a session header (wins)."""
        from dataclasses import replace

        return replace(self, model=model, session_id=session_id or self.session_id)


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


def _common(req: _Request, max_tokens: int) -> dict[str, Any]:
    """The options both endpoints share, checked together."""
    check_unsupported(req)
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})",
                       param="min_tokens", code="invalid_value")
    return {"ignore_eos": bool(req.ignore_eos), "min_tokens": min_tokens, "priority": req.priority or 0,
            "session_id": req.user or None, "cache_salt": req.cache_salt}


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
    max_tokens = min(limit, MAX_TOKENS_CAP)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return GenerateArgs(kind="chat", prompt=messages, max_tokens=max_tokens, temperature=temperature,
                        top_p=top_p, seed=req.seed, stop=_stops(req), stream=bool(req.stream),
                        include_usage=bool(req.stream_options and req.stream_options.include_usage),
                        logprobs=logprobs, **_common(req, max_tokens))


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
    max_tokens = min(req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_TOKENS_CAP)
    return GenerateArgs(kind="completion", prompt=prompt, max_tokens=max_tokens,
                        temperature=temperature, top_p=top_p, seed=req.seed, stop=_stops(req),
                        stream=bool(req.stream),
                        include_usage=bool(req.stream_options and req.stream_options.include_usage),
                        logprobs=req.logprobs, **_common(req, max_tokens))


# ---------------------------------------------------------------------------------------------- responses


def finish_reason(raw: str) -> str:
    # OpenAI knows stop / length; a generation the server cut short (a cancel, a deadline) is "abort", as
    # vLLM's server says. The raw reason stays in the splitserve extras.
    return raw if raw in ("stop", "length") else "abort"


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token),
                         "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": _bytes(a.token)}
                                          for a in t.top]} for t in lps],
            "refusal": None}


def completion_logprobs(lps: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    offsets = []
    for t in lps:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in lps], "token_logprobs": [t.logprob for t in lps],
            # a dict per token, as OpenAI's legacy shape: alternatives with the same text collapse (as there)
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in lps], "text_offset": offsets}


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
    logprobs: bool = False  # the request asked for them
    _lp_sent: int = field(default=0, init=False)  # tokens whose logprobs went out in chunks
    _text_offset: int = field(default=0, init=False)

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

    def _lp(self, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if not self.logprobs or lps is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(lps)
        out = completion_logprobs(lps, self._text_offset)
        self._text_offset += sum(len(t.token) for t in lps)
        return out

    def _choice(self, text: str | None, finish: str | None, *, role: bool = False,
                logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        if logprobs is not None:
            self._lp_sent += len(logprobs)
        if self.kind == "completion":
            return {"index": 0, "text": text or "", "logprobs": self._lp(logprobs), "finish_reason": finish}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": self._lp(logprobs), "finish_reason": finish}

    # --- streaming --------------------------------------------------------------------------------
    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role and empty content; completions have no such chunk."""
        if self.kind != "chat":
            return None
        return self._envelope([self._choice("", None, role=True)], chunk=True)

    def text_chunk(self, text: str, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return self._envelope([self._choice(text, None, logprobs=logprobs)], chunk=True)

    def finish_chunk(self, result: Result) -> dict[str, Any]:
        # tokens no text chunk carried (the EOS token, text held back by a stop string) bring their logprobs here
        rest = (result.logprobs or [])[self._lp_sent:] if self.logprobs else None
        choice = self._choice(None if self.kind == "chat" else "", finish_reason(result.finish_reason),
                              logprobs=rest or None)
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
                                      "logprobs": self._lp(result.logprobs or []), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": self._lp(result.logprobs or []),
                      "finish_reason": finish}
        out = self._envelope([choice], chunk=False)
        out["usage"] = usage(result)
        out["splitserve"] = extras(result)
        return out
