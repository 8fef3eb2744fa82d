"""Typed errors raised by the client SDK, one class per :class:`proto.ErrorCode` family."""

from __future__ import annotations

from splitserve.proto import ErrorCode, StreamError


class SplitserveError(Exception):
    """A request ended with a terminal error. ``code`` is the wire error code."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: ErrorCode | None = None, request_id: str | None = None,
                 retryable: bool = False, retry_after_s: float | None = None, worker: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.request_id = request_id
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        self.worker = worker

    def __str__(self) -> str:
        return f"[{self.code.value}] {self.message}"


class BadRequest(SplitserveError):
    code = ErrorCode.BAD_REQUEST


class PromptTooLong(SplitserveError):
    code = ErrorCode.PROMPT_TOO_LONG


class PayloadTooLarge(SplitserveError):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class NoWorkers(SplitserveError):
    code = ErrorCode.NO_WORKERS


class WorkerDied(SplitserveError):
    code = ErrorCode.WORKER_DIED


class Timeout(SplitserveError):
    code = ErrorCode.TIMEOUT


class Cancelled(SplitserveError):
    code = ErrorCode.CANCELLED


class QuotaExceeded(SplitserveError):
    code = ErrorCode.QUOTA_EXCEEDED


class SloUnattainable(SplitserveError):
    """The tenant's latency targets cannot be met now (the queue ahead and the workers' predicted latency):
    refused at once instead of served late. Retryable after ``retry_after_s``."""

    code = ErrorCode.SLO_UNATTAINABLE


class Unavailable(SplitserveError):
    """No router answered (nothing is running at that NATS URL, or the router is down)."""

    code = ErrorCode.NO_WORKERS


class NotAuthorized(SplitserveError):
    """The NATS server refused this client's credentials, or refused a subject they do not permit (another
    tenant's). Not retryable: fix the credentials or the tenant."""

    code = ErrorCode.UNKNOWN_TENANT


class Forbidden(SplitserveError):
    """The message claimed a tenant other than the one its connection is authorised for, or acted on a request
    of another tenant. Not retryable."""

    code = ErrorCode.FORBIDDEN


class ModelNotFound(SplitserveError):
    """No model of that name is served (the message lists the served ones). Not retryable."""

    code = ErrorCode.MODEL_NOT_FOUND


class ModelNotAllowed(SplitserveError):
    """The tenant may not use that model (the tenants file's ``models:`` for it). Not retryable."""

    code = ErrorCode.MODEL_NOT_ALLOWED


_BY_CODE: dict[ErrorCode, type[SplitserveError]] = {
    ErrorCode.BAD_REQUEST: BadRequest,
    ErrorCode.UNSUPPORTED_VERSION: BadRequest,
    ErrorCode.PROMPT_TOO_LONG: PromptTooLong,
    ErrorCode.PAYLOAD_TOO_LARGE: PayloadTooLarge,
    ErrorCode.NO_WORKERS: NoWorkers,
    ErrorCode.WORKER_DIED: WorkerDied,
    ErrorCode.TIMEOUT: Timeout,
    ErrorCode.EXPIRED: Timeout,
    ErrorCode.CANCELLED: Cancelled,
    ErrorCode.QUOTA_EXCEEDED: QuotaExceeded,
    ErrorCode.SLO_UNATTAINABLE: SloUnattainable,
    ErrorCode.FORBIDDEN: Forbidden,
    ErrorCode.MODEL_NOT_FOUND: ModelNotFound,
    ErrorCode.MODEL_NOT_ALLOWED: ModelNotAllowed,
}


def from_wire(err: StreamError) -> SplitserveError:
    cls = _BY_CODE.get(err.code, SplitserveError)
    return cls(err.message, code=err.code, request_id=err.request_id, retryable=err.retryable,
               retry_after_s=None if err.retry_after_ms is None else err.retry_after_ms / 1000, worker=err.worker)
