"""Bytes <-> models. The only module that knows the payload format (UTF-8 JSON from pydantic).

``decode`` distinguishes three failures, all raised as :class:`ProtocolError` with an ErrorCode that a
service can put straight into an error reply: not JSON / not an object (bad_request), a ``v`` this build
does not speak (unsupported_version), and fields that fail validation (bad_request, with pydantic's
precise location and reason).

Fast path: a payload in the exact form :func:`encode` writes (``{"v":<this version>,`` first, no other ``"v"``
key anywhere) is validated straight from the bytes (``model_validate_json``: no intermediate dict, about half
the CPU of ``json.loads`` + ``model_validate``). Anything else, and any payload the fast path refuses, takes
the general path, which names the failure exactly as before.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from splitserve.proto.messages import PROTO_VERSION, ErrorCode, StreamMessage
from splitserve.proto.quoting import clipped, quoted

HEADER_KIND = "Ss-Kind"
HEADER_VERSION = "Ss-V"

M = TypeVar("M", bound=BaseModel)


class ProtocolError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json(exclude_none=False).encode()


def headers_for(msg: BaseModel, extra: dict[str, str] | None = None) -> dict[str, str]:
    h = {HEADER_KIND: str(getattr(msg, "kind", type(msg).__name__)), HEADER_VERSION: str(PROTO_VERSION)}
    if extra:
        h.update(extra)
    return h


def _check_version(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"payload is not valid JSON: {clipped(str(exc))}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "payload must be a JSON object")
    v = obj.get("v", PROTO_VERSION)
    if v != PROTO_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"message version v={quoted(v)} is not supported (this service speaks v={PROTO_VERSION})",
        )
    return obj


def _validation_text(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        # A location names keys the sender wrote (an extra field of a megabyte name), and a validator's message
        # may embed the value: both are cut, so an error (a reply, a log line) stays small whatever was sent.
        loc = ".".join(clipped(str(p), 64) for p in err["loc"]) or "message"
        parts.append(f"{loc}: {clipped(err['msg'])}")
    return "; ".join(parts)


_FAST_PREFIX = b'{"v":%d,' % PROTO_VERSION
_V_KEY = b'"v"'


def _fast_form(data: bytes | bytearray | memoryview) -> bool:
    """The payload starts with this version's ``v`` and names no other ``v`` (so a duplicate key cannot
    change the version the general path would have read)."""
    return bytes(data[:len(_FAST_PREFIX)]) == _FAST_PREFIX and bytes(data).count(_V_KEY) == 1


def decode(data: bytes, model: type[M]) -> M:
    if _fast_form(data):
        try:
            return model.model_validate_json(data)
        except ValidationError:
            pass  # the general path below words the error
    obj = _check_version(data)
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"invalid {model.__name__}: {_validation_text(exc)}"
        ) from None


_stream_adapter: TypeAdapter[Any] = TypeAdapter(StreamMessage)


def decode_stream(data: bytes) -> Any:
    """Decode a message on a request's stream subject (delta, final or error)."""
    if _fast_form(data):
        try:
            return _stream_adapter.validate_json(data)
        except ValidationError:
            pass
    obj = _check_version(data)
    try:
        return _stream_adapter.validate_python(obj)
    except ValidationError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"invalid stream message: {_validation_text(exc)}") from None
