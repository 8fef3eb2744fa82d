"""The wire contract of splitserve: every message on every NATS subject.

Each message is a versioned pydantic v2 model (``proto.messages``); the subject names live beside them
(``proto.subjects``); ``proto.codec`` turns models into NATS payloads and back, and is the only place that
knows the byte format. Nothing in the product publishes an ad-hoc dict.
"""

from splitserve.proto.admin import *  # noqa: F403
from splitserve.proto.admin import __all__ as _admin_all
from splitserve.proto.codec import (
    HEADER_KIND,
    HEADER_VERSION,
    ProtocolError,
    decode,
    decode_stream,
    encode,
    headers_for,
)
from splitserve.proto.messages import *  # noqa: F403
from splitserve.proto.messages import __all__ as _messages_all
from splitserve.proto.subjects import (
    SINGLE_POOL,
    Subjects,
    model_pool,
    model_pools,
    reply_subjects,
    request_key,
    subject_identity,
)

__all__ = [
    "HEADER_KIND",
    "HEADER_VERSION",
    "ProtocolError",
    "Subjects",
    "reply_subjects",
    "SINGLE_POOL",
    "model_pool",
    "model_pools",
    "request_key",
    "subject_identity",
    "decode",
    "decode_stream",
    "encode",
    "headers_for",
    *_messages_all,
    *_admin_all,
]
