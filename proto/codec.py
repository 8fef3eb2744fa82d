"""Bytes <-> models. The only module that knows the payload format (UTF-8 JSON from pydantic).

``decode`` distinguishes three failures, all raised as :class:`ProtocolError` with an ErrorCode that a
service can put straight into an error reply: not JSON / not an object (bad_request), a ``v`` this build
does not speak (unsupported_version), and fields that fail validation (bad_request, with pydantic's
precise location and reason).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from proto.messages import PROTO_VERSION, ErrorCode, StreamMessage

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
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"payload is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "payload must be a JSON object")
    v = obj.get("v", PROTO_VERSION)
    if v != PROTO_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"message version v={v!r} is not supported (this service speaks v={PROTO_VERSION})",
        )
    return obj


def _validation_text(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "message"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def decode(data: bytes, model: type[M]) -> M:
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
    obj = _check_version(data)
    try:
        return _stream_adapter.validate_python(obj)
    except ValidationError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"invalid stream message: {_validation_text(exc)}") from None
